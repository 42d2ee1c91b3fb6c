"""The planner's fitted constants live in one table (megatrain/planner/calibration.py), each with its unit, meaning and
the benchmark that refits it; no planner module defines one of its own; and no comment, docstring or string in
megatrain/ says when or where something was measured (a date, a results folder, a session) or cites the design notes
outside the repository."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest

from megatrain.planner import calibration

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "megatrain"
PLANNER = PACKAGE / "planner"

# Module-level numbers in planner/ that are units or definitions, not fitted: (file, name) -> why
NOT_FITTED = {
    ("probe.py", "GiB"): "a unit",
    ("profile.py", "PROFILE_VERSION"): "the profile file's format version",
    ("profile.py", "PEAK_BF16"): "datasheet peak rates, for MFU",
    ("profile.py", "FLEX_BLOCK"): "FlexAttention's block size, the kernel's own",
    ("sysmem.py", "UNLIMITED"): "the number cgroup v1 reports for no limit",
    ("placement.py", "CHECKPOINT_INTERVALS"): "the search's grid of checkpoint intervals",
    ("placement.py", "GROUP_COUNTS"): "the search's grid of wave-group counts",
    ("plan.py", "QUICK_ADAMW_PARAMS"): "the size of the tile timed at a run's start (its cost, not a fit)",
    ("probe.py", "CPU_LAYER_FLOPS"): "the most work the CPU layer timed at a run's start may take (its cost)",
    ("probe.py", "CPU_LAYER_PARAMS"): "the largest layer timed at a CPU run's start (its memory, not a fit)",
    ("rollout_estimate.py", "BF16"): "a unit: bytes per bf16 element",
}

# Where the planner's modules use a fitted constant under their own name (other code imports it from there)
USED_AS = {
    "memory": ("RUNTIME_HOST", "GPU_WORKSPACE", "GPU_RESERVE", "GPU_RESERVE_COMPILED", "GPU_RESERVE_STREAMS",
               "LONG_ROW", "GPU_RESERVE_LONG_ROW", "GPU_RESERVE_LONG_ROW_STREAMS", "CUDA_CONTEXT",
               "COMPILED_ACTIVATIONS"),
    "placement": ("SEQ_TILE", "REUSE_FROM", "ATTN_BLOCK", "NEAR_FASTEST", "HOST_HEADROOM"),
    "profile": ("COMPILED_SPEEDUP", "RATE_SEQ_RANGE", "ATTENTION_BY_SEQ", "KERNEL_RATE",
                "BLOCKED_ATTENTION_SLOWDOWN", "MOE_DEFAULT_SHARE"),
    "timing": ("ADAMW_IN_STEP", "FP32_SLOWDOWN", "SATURATED"),
    "world": ("INTRA_NODE_BPS", "INTER_NODE_BPS"),
    "probe": ("ADAMW_THREADS_TOLERANCE", "ALL_CORES_UP_TO"),
}

# When or where something was measured, and the design notes outside the repository (docs/design.md, rule N)
HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|bench/results|results/20|[Ss]ession \d|DESIGN\.md")


def test_every_entry_has_value_unit_meaning_and_a_benchmark_that_exists():
    assert len(calibration.TABLE) >= 40
    for name, fit in calibration.TABLE.items():
        assert fit.name == name and fit.value is not None, name
        assert getattr(calibration, name) is fit.value, f"{name}: the module's name is not the table's value"
        for field in ("unit", "meaning", "refit"):
            assert isinstance(getattr(fit, field), str) and getattr(fit, field).strip(), f"{name}: no {field}"
        scripts = re.findall(r"bench/[\w-]+\.py", fit.refit)
        assert scripts or "megatrain probe" in fit.refit, f"{name}: refit names no benchmark: {fit.refit!r}"
        for s in scripts:
            assert (ROOT / s).is_file(), f"{name}: {s} does not exist"
        assert not HISTORY.search(fit.meaning + fit.refit), f"{name}: says when or where it was measured"


def test_the_modules_use_the_tables_values():
    """The names other code imports (memory.GPU_RESERVE, profile.COMPILED_SPEEDUP, ...) are the table's objects."""
    for module, names in USED_AS.items():
        mod = importlib.import_module(f"megatrain.planner.{module}")
        for name in names:
            assert getattr(mod, name) is calibration.TABLE[name].value, f"{module}.{name}"
    from megatrain.planner.profile import DEFAULTS

    assert DEFAULTS.h2d_bps == calibration.DEFAULT_H2D_BPS and DEFAULTS.layer_flops == calibration.DEFAULT_LAYER_FLOPS
    assert DEFAULTS.adamw_params_per_s == calibration.DEFAULT_ADAMW_PARAMS_PER_S


def _has_number(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Constant) and isinstance(n.value, (int, float, complex))
               and not isinstance(n.value, bool) for n in ast.walk(node))


def _constant_names(path: Path) -> list[tuple[str, int]]:
    """Module-level assignments of a name that is not lower case (X, GiB, _X) to an expression holding a number."""
    out = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        for name in names:
            if name.lstrip("_")[:1].isupper() and _has_number(value):
                out.append((name, node.lineno))
    return out


def test_no_fitted_number_outside_the_table():
    found = []
    for path in sorted(PLANNER.glob("*.py")):
        if path.name == "calibration.py":
            continue
        for name, line in _constant_names(path):
            if (path.name, name) not in NOT_FITTED:
                found.append(f"planner/{path.name}:{line} {name}")
    assert not found, ("module-level numbers in planner/ outside calibration.py (a fitted one belongs in its table; a "
                       f"unit or definition in NOT_FITTED here): {found}")


def test_the_check_finds_a_fitted_number(tmp_path):
    p = tmp_path / "m.py"
    p.write_text('GiB = 2**30\nX = 0.5  # fitted\nY: float = 3 * GiB\nNAMES = ("a", "b")\nflag = True\nZ = f(1)\n')
    assert [n for n, _ in _constant_names(p)] == ["GiB", "X", "Y", "Z"]


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def history_in(source: str) -> list[tuple[int, str]]:
    """(line, match) of every comment, docstring or other string literal that says when or where something was
    measured."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and HISTORY.search(tok.string):
            out.append((tok.start[0], HISTORY.search(tok.string).group(0)))
    tree = ast.parse(source)
    out += [(line, HISTORY.search(doc).group(0)) for line, doc in _docstrings(tree) if HISTORY.search(doc)]
    out += [(n.lineno, HISTORY.search(n.value).group(0)) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and HISTORY.search(n.value)]
    return sorted(set(out))


@pytest.mark.parametrize("text", ["x = 1  # measured 2026-11-21\n", '"""See DESIGN.md rule 5."""\n',
                                  'def f():\n    """bench/results/h200: 5 s"""\n',
                                  'NOTE = "fitted to results/2026-11-25 runs"\n', "# found in session 12\n"])
def test_the_check_finds_history(text):
    assert history_in(text)


def test_no_comment_or_docstring_says_when_or_where_it_was_measured():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}:{line}: {m}" for line, m in history_in(path.read_text())]
    assert not found, f"say what and why (cite docs/design.md, rule N; a kept bench script), not when or where: {found}"
