"""`megatrain plan`'s import graph and the planner's meta-device runs without torch._dynamo (planner/meta_trace.py):
the same sizes as with it, and no import of torch._dynamo, transformers' modeling modules or custom-op registration
in a plan's process."""

import json
import os
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
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600)
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


def test_no_stand_in_while_another_thread_runs():
    """The stand-in is process-wide: with a second Python thread alive (a start-up phase running beside the plan),
    the meta run imports the real torch._dynamo."""
    code = """
import sys, threading, torch
from megatrain.planner.meta_trace import without_dynamo
stop = threading.Event()
t = threading.Thread(target=stop.wait)
t.start()
with without_dynamo() as state:
    assert sys.modules.get("torch._dynamo") is None
    (torch.empty(4, device="meta").float() * 2).cos()
stop.set()
t.join()
print(not state and "torch._dynamo" in sys.modules)
"""
    assert _run(code).split()[-1] == "True"


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


def _configs():
    dirs = sorted(CONFIGS.iterdir()) + sorted(Path("/work/shared/model-configs").glob("*"))
    return [d for d in dirs if (d / "config.json").is_file()]


def test_plan_fields_build_the_adapter_autoconfig_builds():
    """For every real config here whose family the planner reads without transformers (models/fields.py): the same
    adapter (every attribute, units, layer kinds) and the same figures the planner reads (dtype, quantization) as
    from AutoConfig; the others fall back to AutoConfig."""
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.models.fields import FAMILIES, PlanFields
    from megatrain.planner.plan import _file_dtype

    light = 0
    for d in _configs():
        fields, full = load_hf_config(d, plan_only=True), load_hf_config(d)
        if not isinstance(fields, PlanFields):
            raw = json.loads((d / "config.json").read_text())
            assert fields.model_type not in FAMILIES or raw.get("use_sliding_window") or raw.get("rope_scaling"), d
            continue
        light += 1
        a, b = get_adapter(fields), get_adapter(full)
        assert {k: v for k, v in vars(a).items() if k != "hf_config"} == \
               {k: v for k, v in vars(b).items() if k != "hf_config"}, d
        assert a.units() == b.units() and a.layer_kinds == b.layer_kinds, d
        assert _file_dtype(fields) == _file_dtype(full), d
        assert fields.rope_parameters == full.rope_parameters, d
        assert getattr(full, "quantization_config", None) is None
        assert getattr(fields, "quantization_config", None) is None
        for k in ("hidden_size", "num_hidden_layers", "vocab_size", "max_position_embeddings", "rms_norm_eps"):
            assert getattr(fields, k) == getattr(full, k), (d, k)
    assert light >= 10


def test_plan_fields_fall_back_when_the_file_asks_for_more(tmp_path):
    """A rope scaling, a quantization, qwen2's sliding window or a size left to its default: AutoConfig reads it."""
    from megatrain.models.fields import plan_fields

    raw = json.loads((CONFIGS / "llama-3.1-8b" / "config.json").read_text())
    assert plan_fields(raw) is not None
    assert plan_fields({**raw, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}) is None
    assert plan_fields({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}) is None
    assert plan_fields({**raw, "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}}) is None
    assert plan_fields({**raw, "quantization_config": {"quant_method": "fp8"}}) is None
    assert plan_fields({k: v for k, v in raw.items() if k != "rms_norm_eps"}) is None
    assert plan_fields({**raw, "model_type": "gemma2"}) is None
    qwen = json.loads((CONFIGS / "qwen2.5-7b" / "config.json").read_text())
    assert plan_fields(qwen).sliding_window is None
    assert plan_fields({**qwen, "use_sliding_window": True}) is None
    mistral = json.loads((CONFIGS / "mistral-7b-v0.3" / "config.json").read_text())
    assert plan_fields({k: v for k, v in mistral.items() if k != "sliding_window"}) is None
    qwen3 = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    assert plan_fields({**qwen3, "use_sliding_window": True, "sliding_window": 4096}) is None
    for key in ("head_dim", "num_key_value_heads"):  # (Qwen3Config's defaults are a model's own sizes)
        assert plan_fields({k: v for k, v in qwen3.items() if k != key}) is None


def test_qwen3_fields_without_layer_types_equal_qwen3config():
    """qwen3's config.json without layer_types (older files): the layer types, window and sizes Qwen3Config derives."""
    from transformers import Qwen3Config

    from megatrain.models import get_adapter
    from megatrain.models.fields import plan_fields

    raw = json.loads((CONFIGS / "qwen3-8b" / "config.json").read_text())
    raw.pop("layer_types", None)
    fields, full = plan_fields(raw), Qwen3Config(**raw)
    for k in ("layer_types", "sliding_window", "head_dim", "num_key_value_heads", "rope_parameters"):
        assert getattr(fields, k) == getattr(full, k), k
    a, b = get_adapter(fields), get_adapter(full)
    assert {k: v for k, v in vars(a).items() if k != "hf_config"} == \
           {k: v for k, v in vars(b).items() if k != "hf_config"} and a.layer_kinds == b.layer_kinds


_PLAN_IMPORTS = """
import json, sys
from megatrain.cli import main
import torch._library.custom_ops as ops
registered = []
original = ops.CustomOpDef._register_to_dispatcher
def count(self, *a, **kw):
    registered.append(self._name)
    return original(self, *a, **kw)
ops.CustomOpDef._register_to_dispatcher = count
status = main(sys.argv[1:])
heavy = sorted(m for m in sys.modules if m == "torch._dynamo" or m.startswith(("torch._dynamo.", "torch._inductor",
               "transformers", "triton", "torch.distributed.tensor", "torch.distributed.fsdp")))
print(json.dumps({"status": status, "heavy": heavy, "custom_ops": registered}))
"""


@pytest.mark.parametrize("model,seq", [("qwen2.5-7b", 1024), ("llama-3.1-8b", 131072)])
def test_megatrain_plan_imports_neither_dynamo_nor_transformers(tmp_path, model, seq):
    """`megatrain plan` of a llama or qwen2 model for a GPU: no torch._dynamo (and what it pulls in: FSDP, DTensor,
    Inductor, triton), no transformers, no custom op registered (sys.modules after the plan, in a fresh process)."""
    data = ROOT / "megatrain" / "defaults" / "reverse-train.jsonl"
    argv = ["plan", f"model.path={CONFIGS / model}", f"data.path={data}", "data.format=alpaca", "train.device=cuda",
            "train.micro_batch_size=1", f"data.max_seq_len={seq}",
            f"output.dir={tmp_path / 'out'}", "checkpoint.at_end=false", "memory.host_budget_gb=125",
            f"plan.profile={ROOT / 'bench' / 'results' / 'probe-h100' / 'profile.json'}"]
    got = json.loads(_run(_PLAN_IMPORTS, *argv).splitlines()[-1])
    assert got["status"] in (0, 1) and got["heavy"] == [] and got["custom_ops"] == [], got
