"""The package's layout stays what DESIGN.md ("Layout") says: dependencies point one way, modules stay small, no
module reaches into another's private names, and no modules import each other in a circle."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "megatrain"
MODULES = sorted(p for p in ROOT.rglob("*.py"))

# package -> the megatrain packages it may import (itself always; errors.py everywhere)
ALLOWED = {
    "models": set(),
    "rl": set(),  # the grpo config section and the rewards: a leaf, like data
    "data": {"rl"},  # rl: the built-in rewards' checks of each prompt row (data/prompts.py)
    "runtime": {"models"},
    "checkpoint": {"models", "runtime"},  # runtime: the SSD tier's request loop and aligned buffers (fastio.py)
    "planner": {"runtime", "models"},
    "distributed": {"runtime", "models"},
    "rollout": {"runtime", "models", "planner"},  # the GRPO sampler: the store's weights, the machine profile
    "run": {"runtime", "data", "checkpoint", "planner", "models", "config", "distributed", "rl", "rollout"},
    "config": {"data", "runtime", "config_checks", "rl"},  # runtime: the placement knobs (runtime/knobs.py); rl: grpo
    "config_checks": set(),
    "cli": {"run", "planner", "checkpoint", "data", "config", "models", "rl"},
    "__main__": {"cli"},
}


def package_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def imports(path: Path, root: Path = ROOT) -> list[tuple[str, list[str], int]]:
    """(absolute megatrain module, imported names, line) of every import in the file, function-local ones too."""
    tree = ast.parse(path.read_text())
    pkg_parts = ["megatrain", *path.relative_to(root).parent.parts]
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


# ---- no import circles ----------------------------------------------------------------------------------------
def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """megatrain module -> {megatrain module it imports: line of the first such import}, from every import in the
    file: at the top, inside functions and under TYPE_CHECKING alike. `from pkg import name` imports the module
    pkg.name where there is one, else pkg (its __init__.py); importing a module of another package runs that
    package's __init__.py first, so it imports that too."""
    def name(path: Path) -> str:
        parts = ["megatrain", *path.relative_to(root).with_suffix("").parts]
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    files = {name(p): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for here, path in files.items():
        edges = graph[here] = {}
        for mod, names, line in imports(path, root):
            for target in [f"{mod}.{n}" if f"{mod}.{n}" in files else mod for n in names] or [mod]:
                parts = target.split(".")
                for i in range(1, len(parts) + 1):  # the target and the packages above it, but not this file's own
                    dep = ".".join(parts[:i])
                    if dep in files and dep != here and (i == len(parts) or not here.startswith(dep + ".")):
                        edges.setdefault(dep, line)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Circles [a, b, ..., a] that name every module of each group of modules that import each other (the strongly
    connected components, Tarjan): the shortest through the group's first module by name, then through the first
    one not named yet, and so on."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        inside, named = set(group), set()
        for start in sorted(group):
            if start in named:
                continue
            came: dict[str, str | None] = {start: None}
            queue = [start]
            for v in queue:  # breadth first: the shortest way back to `start`
                if start in graph[v]:
                    path = [v]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    out.append([*reversed(path), start])
                    named.update(path)
                    break
                for w in sorted(graph[v]):
                    if w in inside and w not in came:
                        came[w] = v
                        queue.append(w)
    return sorted(out)


def describe_circle(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def test_no_import_circles():
    graph = import_graph()
    found = [describe_circle(c, graph) for c in circles(graph)]
    assert not found, "import circles (each module with the line that imports the next):\n" + "\n".join(found)


def test_circles_are_found_through_function_local_type_checking_and_package_imports(tmp_path):
    """The check itself: a circle closed by an import inside a function and one under TYPE_CHECKING is found and
    named; so is one through a package's __init__.py (importing a module of another package runs it first); a
    package's __init__.py importing its own modules is not a circle."""
    files = {"__init__.py": "",
             "a.py": "from .b import f\n",
             "b.py": "def f():\n    from . import c\n",
             "c.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from .a import f\n",
             "p/__init__.py": "from .m import x\nfrom ..q.n import y\n",
             "p/m.py": "x = 1\n",
             "q/__init__.py": "",
             "q/n.py": "from ..p.m import x\ny = x\n",
             "ok/__init__.py": "from .u import z\n",
             "ok/u.py": "from .v import z\n",
             "ok/v.py": "import megatrain.a\nz = 0\n"}
    root = tmp_path / "megatrain"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    graph = import_graph(root)
    assert graph["megatrain.b"] == {"megatrain.c": 2}  # inside a function
    assert graph["megatrain.q.n"] == {"megatrain.p": 1, "megatrain.p.m": 1}  # the package's __init__.py runs first
    assert graph["megatrain.ok.u"] == {"megatrain.ok.v": 1}  # its own package's __init__.py is already running
    assert circles(graph) == [["megatrain.a", "megatrain.b", "megatrain.c", "megatrain.a"],
                              ["megatrain.p", "megatrain.q.n", "megatrain.p"]]
    assert describe_circle(circles(graph)[0], graph) == \
        "megatrain.a (line 1) -> megatrain.b (line 2) -> megatrain.c (line 4) -> megatrain.a"
    graph["megatrain.a"]["megatrain.d"], graph["megatrain.d"] = 1, {"megatrain.a": 1}  # a shorter one through a:
    assert circles(graph)[:2] == [["megatrain.a", "megatrain.d", "megatrain.a"],  # b and c are still named
                                  ["megatrain.b", "megatrain.c", "megatrain.a", "megatrain.b"]]
