"""The planner's meta-device runs with the stand-ins for torch._dynamo, sympy and torch's symbolic shapes
(planner/meta_trace.py) measure what they measure with the real modules, for several families and shapes, trip on
none of them (so that `megatrain plan` never imports sympy), and leave nothing of the stand-ins behind."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "bench" / "model-configs"
# dense (llama), soft-capping (gemma-2), sinks and experts (gpt-oss), experts (mixtral): a fresh process each, a few
# seconds of CI apiece, so one per kind of layer (qwen2's ops are llama's and biases, qwen3-moe's mixtral's)
FAMILIES = ["llama-3.1-8b", "gemma-2-9b", "gpt-oss-20b", "mixtral-8x7b"]

_MEASURE = """
import json, sys, torch
from megatrain.models import get_adapter, load_hf_config
from megatrain.planner.activations import head_memory, layer_memory
from megatrain.planner.meta_trace import without_dynamo
real = sys.argv[1] == "real"
if real:
    import sympy, torch._dynamo, torch.fx.experimental.symbolic_shapes, torch.utils._sympy.functions
out, tripped = [], []
for path in sys.argv[2:]:
    adapter = get_adapter(load_hf_config(path, plan_only=True))
    for rows, seq in ((2, 512), (1, 1536)):
        # each variant under two opposite (packed rows, CUDA kernels) pairs, alternating: all four meet a variant
        for i, kw in enumerate(({}, {"seq_tile": 256}, {"attn_block": 256}, {"stash": True, "plain": False})):
            for packed, cuda in (((False, True), (True, False)) if i % 2 == 0 else ((False, False), (True, True))):
                with without_dynamo() as state:
                    out.append(layer_memory(adapter, rows, seq, torch.bfloat16, packed, cuda_attention=cuda, **kw))
                tripped += list(state.values())
        for cuda in (True, False):
            with without_dynamo() as state:
                out.append({"head": head_memory(adapter, rows, seq, rows * (seq - 1), 512, torch.bfloat16, cuda=cuda)})
            tripped += list(state.values())
loaded = [m for m in ("sympy", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                      "torch.utils._sympy.functions") if m in sys.modules]
print(json.dumps({"sizes": out, "tripped": tripped, "loaded": loaded}))
"""


def _run(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_stand_ins_measure_what_the_real_modules_measure():
    """Each family's layer (whole, tiled, its attention's backward blocked, keeping its attention; plain and packed
    rows; CUDA's kernels and the CPU's) and LM head at two shapes: the same sizes with the stand-ins (each family in
    a fresh process) as with the real modules loaded. No trip; the families the planner reads without transformers
    (models/fields.py) load neither sympy nor torch._dynamo nor the symbolic shapes (the others' modeling code may
    load them itself: then nothing is stood in)."""
    paths = [str(CONFIGS / name) for name in FAMILIES]
    stub = [json.loads(_run(_MEASURE, "stub", p).splitlines()[-1]) for p in paths]
    real = json.loads(_run(_MEASURE, "real", *paths).splitlines()[-1])
    assert all(s["tripped"] == [] for s in stub) and real["tripped"] == []
    assert stub[0]["loaded"] == [] and len(real["loaded"]) == 4  # (qwen2's: test_plan_imports)
    sizes = [x for s in stub for x in s["sizes"]]
    assert sizes == real["sizes"] and len(sizes) == 2 * 10 * len(FAMILIES)
    assert all(v > 0 for one in sizes for v in one.values())


def test_after_the_stand_ins_torch_compiles_with_the_real_modules():
    """After a meta run under the stand-ins: none left in sys.modules, and torch.compile with dynamic shapes (which
    needs the real sympy and symbolic shapes) runs."""
    code = """
import sys, torch
from megatrain.planner.meta_trace import without_dynamo
with without_dynamo() as state:
    x = torch.empty(4, 8, device="meta")
    y = (x.float() * 2).cos().sum(-1)
    torch.empty(3, 5, device="meta", dtype=torch.bfloat16).t().contiguous().to(torch.float32)
assert not state, state
assert not any(m in sys.modules for m in ("sympy", "torch._dynamo", "torch.fx.experimental.symbolic_shapes",
                                          "torch.utils._sympy.functions"))
f = torch.compile(lambda t: (t * 2).cos().sum(), backend="eager", dynamic=True)
print(float(f(torch.ones(3))), float(f(torch.ones(5))))
import sympy
from torch.fx.experimental.symbolic_shapes import guard_or_false
print(type(sympy.S).__module__.startswith("sympy"), guard_or_false.__module__)
"""
    out = _run(code).split()
    c = float(__import__("torch").cos(__import__("torch").tensor(2.0)))
    assert abs(float(out[0]) - 3 * c) < 1e-5 and abs(float(out[1]) - 5 * c) < 1e-5
    assert out[2] == "True" and out[3] == "torch.fx.experimental.symbolic_shapes"


def test_an_error_under_the_stand_ins_runs_again_with_the_real_modules():
    """A run that needs more of the symbolic shapes than the stand-in has: measured again with the real module."""
    code = """
from megatrain.planner.meta_trace import measure
def needs_more():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    return ShapeEnv.__module__
print(measure(needs_more))
"""
    assert _run(code).split()[-1] == "torch.fx.experimental.symbolic_shapes"


def test_the_shapes_stand_in_answers_as_torch_on_plain_values():
    """Each guard function of the symbolic shapes' stand-in gives what torch's own gives on plain ints and bools
    (for the names this torch has; has_hint and size_hint are the names older releases' meta kernels import), and
    trips on a name it lacks."""
    import pytest
    import torch
    import torch.fx.experimental.symbolic_shapes as real

    from megatrain.planner.meta_trace import Tripped, _shapes_stand_in

    def trip(what):
        raise Tripped(what)

    stub = _shapes_stand_in(torch, trip)
    unary = ("has_hint", "size_hint", "has_guarding_hint", "guarding_hint_or_throw", "is_nested_int")
    checked = 0
    for name in unary:
        for value in (0, 7, 4096):
            assert getattr(stub, name)(value) == getattr(stub, name)(value)
            if hasattr(real, name):
                assert getattr(stub, name)(value) == getattr(real, name)(value), (name, value)
                checked += 1
    for name in ("expect_true", "guard_or_false", "guard_or_true", "guard_size_oblivious", "statically_known_true"):
        for value in (True, False):
            assert getattr(stub, name)(value) == getattr(real, name)(value), (name, value)
            checked += 1
    assert stub.sym_eq((1, 2), (1, 2)) == real.sym_eq((1, 2), (1, 2)) and stub.sym_eq(3, 4) == real.sym_eq(3, 4)
    assert stub.sym_and(True, False) == real.sym_and(True, False)
    assert stub.sym_or(False, True) == real.sym_or(False, True)
    assert checked >= 19  # the five guards on two bools, and three unary functions this torch has on three ints
    assert stub.has_hint(5) is True and stub.size_hint(5) == 5  # older torch: has_hint(int) True, size_hint(int) itself
    with pytest.raises(AssertionError):
        stub.size_hint(2.5)
    with pytest.raises(Tripped):
        stub.ShapeEnv
