"""The package's layout stays what DESIGN.md ("Layout") says: dependencies point one way, modules stay small, and
no module reaches into another's private names."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megatrain"
MODULES = sorted(p for p in ROOT.rglob("*.py"))

# package -> the megatrain packages it may import (itself always; errors.py everywhere)
ALLOWED = {
    "models": set(),
    "data": set(),
    "runtime": {"models"},
    "checkpoint": {"models"},
    "planner": {"runtime", "models"},
    "distributed": {"runtime", "models"},
    "run": {"runtime", "data", "checkpoint", "planner", "models", "config", "distributed"},
    "config": {"data", "config_checks"},
    "config_checks": set(),
    "cli": {"run", "planner", "checkpoint", "data", "config", "models"},
    "__main__": {"cli"},
}


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(absolute megatrain module, imported names, line) of every import in the file, function-local ones too."""
    tree = ast.parse(path.read_text())
    pkg_parts = ["megatrain", *path.relative_to(ROOT).parent.parts]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("megatrain"):
                out.append((mod, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("megatrain")]
    return out


def target_package(mod: str, names: list[str]) -> set[str]:
    parts = mod.split(".")
    if len(parts) > 1:
        return {parts[1]}
    return set(names)  # `from megatrain import data`


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dependencies_point_one_way(path):
    pkg = package_of(path)
    if pkg in ("__init__", "errors"):
        return
    allowed = ALLOWED[pkg] | {pkg, "errors", "__init__"}
    for mod, names, line in imports(path):
        bad = target_package(mod, names) - allowed - {"__version__"}
        assert not bad, f"{path.relative_to(ROOT)}:{line} imports {mod} ({pkg} may import {sorted(ALLOWED[pkg])})"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_of_other_modules(path):
    here = ".".join(["megatrain", *path.relative_to(ROOT).with_suffix("").parts]).removesuffix(".__init__")
    for mod, names, line in imports(path):
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        assert mod == here or not private, f"{path.relative_to(ROOT)}:{line} imports {private} from {mod}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path):
    n = len(path.read_text().splitlines())
    assert n <= 500, f"{path.relative_to(ROOT)} has {n} lines"


def test_every_package_says_what_lives_there():
    for init in ROOT.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init.relative_to(ROOT)} needs a docstring naming its modules"
