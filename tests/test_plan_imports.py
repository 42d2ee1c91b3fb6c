"""`megatrain plan`'s import graph and the planner's meta-device runs without torch._dynamo (planner/meta_trace.py):
the same sizes as with it, and no import of torch._dynamo, transformers' modeling modules or custom-op registration
in a plan's process."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "bench" / "model-configs"
FAMILIES = ["llama-3.1-8b", "gemma-2-9b", "gpt-oss-20b", "mixtral-8x7b"]  # SDPA, soft-capping, sinks, experts

_MEASURE = """
import json, sys, torch
from megatrain.models import get_adapter, load_hf_config
from megatrain.planner.activations import head_memory, layer_memory
from megatrain.planner.meta_trace import without_dynamo
if sys.argv[1] == "real":
    import torch._dynamo
out, tripped = [], []
for path in sys.argv[2:]:
    adapter = get_adapter(load_hf_config(path))
    for packed in (False, True):
        for kw in ({}, {"seq_tile": 256}, {"attn_block": 256}, {"stash": True, "plain": False}):
            with without_dynamo() as state:
                out.append(layer_memory(adapter, 2, 512, torch.bfloat16, packed, **kw))
            tripped += list(state.values())
    with without_dynamo() as state:
        out.append({"head": head_memory(adapter, 2, 512, 1022, 512, torch.bfloat16, cuda=True)})
    tripped += list(state.values())
print(json.dumps({"sizes": out, "tripped": tripped}))
"""


def _run(code: str, *args: str) -> str:
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def test_meta_runs_without_dynamo_measure_what_they_measure_with_it():
    """The stand-in changes no size: each family's layer (whole, tiled, its attention's backward blocked, keeping its
    attention; plain and packed rows) and LM head, measured in a fresh process with and without torch._dynamo."""
    paths = [str(CONFIGS / name) for name in FAMILIES]
    stub = json.loads(_run(_MEASURE, "stub", *paths).splitlines()[-1])
    real = json.loads(_run(_MEASURE, "real", *paths).splitlines()[-1])
    assert not real["tripped"]  # (with torch._dynamo loaded nothing is replaced)
    assert stub["sizes"] == real["sizes"] and len(stub["sizes"]) == 9 * len(FAMILIES)
    assert all(v > 0 for sizes in stub["sizes"] for v in sizes.values())


def test_the_stand_in_is_gone_after_a_meta_run_and_compile_sees_torchs_own_marks():
    """After without_dynamo: no stand-in in sys.modules, no mark torch cached from it (a later torch.compile imports
    the real torch._dynamo and sees torch's own wrappers)."""
    code = """
import sys, torch
from megatrain.planner.meta_trace import without_dynamo
with without_dynamo() as state:
    x = torch.empty(4, 8, device="meta")
    y = (x.float() * 2).cos().sum(-1)
assert not state and "torch._dynamo" not in sys.modules and "_dynamo" not in torch.__dict__
import torch._dynamo
assert torch._dynamo.disable.__module__.startswith("torch._dynamo")
f = torch.compile(lambda t: (t * 2).cos(), backend="eager")
print(float(f(torch.ones(3)).sum()))
"""
    out = _run(code)
    assert abs(float(out.split()[-1]) - 3 * float(torch.cos(torch.tensor(2.0)))) < 1e-6


def test_a_tripped_stand_in_measures_again_with_the_real_module():
    """A run that needs more of torch._dynamo than `disable` is run again with the real one: the same result."""
    code = """
import sys, torch
from megatrain.planner.meta_trace import measure
def needs_more():
    import torch._dynamo
    return torch._dynamo.config.cache_size_limit  # the stand-in has no config
print(measure(needs_more), "torch._dynamo" in sys.modules)
"""
    out = _run(code).split()
    assert out[1] == "True" and int(out[0]) > 0
