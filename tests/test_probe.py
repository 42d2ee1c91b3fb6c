"""`megatrain probe` measures what it can on this machine (CPU here), writes a profile that `plan` reads, and runs
where pydantic and datasets are not installed; host memory honours cgroup limits."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.planner import sysmem
from megatrain.planner import Workload, make_plan
from megatrain.planner.profile import DEFAULTS, GiB, from_dict, load_profile

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "megatrain" / "defaults" / "tiny-llama"

# Run the probe as `python3 -m megatrain.planner.probe` with pydantic, datasets and megatrain's config, data and trainer
# modules made unimportable: the GPU machine has torch, transformers and psutil only.
NO_PYDANTIC = """
import runpy, sys
for name in ("pydantic", "datasets", "megatrain.config", "megatrain.data", "megatrain.run.trainer"):
    sys.modules[name] = None
sys.argv = ["megatrain.planner.probe"] + sys.argv[1:]
runpy.run_module("megatrain.planner.probe", run_name="__main__", alter_sys=True)
"""


def test_probe_runs_without_pydantic_and_plan_uses_it(tmp_path):
    out = tmp_path / "profile.json"
    r = subprocess.run([sys.executable, "-c", NO_PYDANTIC, "--out", str(out), "--adam-params", "1000000",
                        "--matmul", "256", "--layer", f"{TINY}:2x16"], capture_output=True, text=True, timeout=300,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "CPU AdamW" in r.stderr and "profile written" in r.stderr
    raw = json.loads(out.read_text())
    assert raw["host_memory"]["available_bytes"] > 0 and raw["cpu"]["adamw_params_per_s"] > 0
    layer = raw["cpu"]["layers"][0]
    assert (layer["hidden"], layer["micro"], layer["seq"]) == (128, 2, 16) and layer["backward_flops"] > 0
    prof = load_profile(out)
    assert prof.measured and prof.adamw_params_per_s == raw["cpu"]["adamw_params_per_s"]
    assert prof.gpu_total_bytes == 0  # measured on a machine without a GPU
    # the plan of a CPU run takes the CPU rates from it and no longer says it uses defaults
    from transformers import AutoConfig

    from megatrain.models import get_adapter

    adapter = get_adapter(AutoConfig.from_pretrained(TINY))
    plan = make_plan(adapter, Workload((2,), 16, device="cpu"), prof)
    assert not any("no machine profile" in n for n in plan.notes)
    assert plan.time["optimizer_s"] == pytest.approx(plan.params / prof.adamw_params_per_s)


def test_probe_is_a_cli_subcommand(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "probe", "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "--layer MODEL_DIR:BxT" in r.stdout


H200_PROFILE = {
    "version": 1, "created": "2026-11-22 10:00:00", "host": "gpu-box",
    "host_memory": {"total_bytes": 128 * GiB, "available_bytes": 120 * GiB, "source": "/proc/meminfo"},
    "cpu": {"count": 16, "adamw_params_per_s": 4.0e9, "matmul_flops": 1e12},
    "gpu": {"name": "NVIDIA H200", "total_bytes": 150_000_000_000, "peak_bf16_flops": 989.4e12,
            "bandwidth": {"h2d_pinned_bps": 55e9, "d2h_pinned_bps": 54e9, "bidirectional_per_direction_bps": 50e9},
            "matmul_bf16_flops": 780e12, "head_flops": 400e12,
            "layers": [{"model": "qwen2.5-7b", "hidden": 3584, "intermediate": 18944, "heads": 28, "kv_heads": 4,
                        "head_dim": 128, "micro": 32, "seq": 1024, "compile": False, "forward_flops": 450e12,
                        "backward_flops": 500e12, "activation_peak_bytes": 10 * GiB}]},
}


def test_gpu_profile_sets_the_rates_of_the_plan(tmp_path):
    from transformers import AutoConfig

    from megatrain.models import get_adapter
    from megatrain.planner.timing import executed_flops

    prof = from_dict(H200_PROFILE, "h200.json")
    assert prof.peak_bf16 == 989.4e12 and prof.h2d_bps == 55e9 and prof.bidir_bps == 50e9
    adapter = get_adapter(AutoConfig.from_pretrained(ROOT / "bench" / "model-configs" / "qwen2.5-7b"))
    w = Workload((32,) * 4 + (30,), 1024)
    plan = make_plan(adapter, w, prof)
    assert plan.time["rate_source"] == "measured at this shape"
    fl = executed_flops(adapter, adapter.units(), w)
    expected = fl["forward"] / 450e12 + fl["backward"] / 500e12 + fl["head"] / 400e12
    assert plan.time["compute_s"] == pytest.approx(expected, rel=1e-6)
    assert plan.time["mfu"] is not None
    assert plan.gpu_peak_phase.startswith("backward, layer 27, micro-batch 1/5")  # a 32-row micro-batch
    assert plan.gpu["layer activations (1 micro-batch)"] == 10 * GiB  # the probe's measured peak, not the model's
    assert "layer activations: measured by the probe at this shape" in plan.notes
    other = make_plan(adapter, Workload((8,), 4096), prof)  # another shape: the nearest measured one, said so
    assert other.time["rate_source"].startswith("measured at 32x1024")
    assert make_plan(adapter, w, DEFAULTS).time["rate_source"] == "default rate"


def test_plan_for_another_machine_uses_its_recorded_memory(tmp_path):
    """Planning on a laptop for the profiled GPU box: host RAM and GPU size come from the profile."""
    from megatrain.config import load_config
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.planner import plan_for_config, target_device

    path = tmp_path / "h200.json"
    path.write_text(json.dumps(H200_PROFILE))
    cfg = load_config(None, [f"plan.profile={path}", f"model.path={ROOT / 'bench/model-configs/qwen2.5-7b'}",
                             "data.max_seq_len=1024", "train.micro_batch_size=32", "train.grad_accum_steps=5",
                             f"output.dir={tmp_path / 'out'}"])
    prof = load_profile(path)
    device = target_device(cfg, prof)
    assert device == "cuda"  # 'auto' without a GPU here: plans for the profile's GPU
    plan = plan_for_config(cfg, get_adapter(load_hf_config(cfg.model.path)), device, prof)
    if not __import__("torch").cuda.is_available():
        assert plan.host_available == 120 * GiB and "gpu-box" in plan.host_source
        assert plan.gpu_limit == 150_000_000_000
    assert not [p for p in plan.problems if not p.startswith("disk")], plan.problems  # (checkpoints: this disk)


# ---- host memory: cgroup limits ------------------------------------------------------------------------------------
def test_cgroup_v2_limit_binds(tmp_path):
    cg = tmp_path / "cgroup"
    (cg / "user.slice" / "job").mkdir(parents=True)
    (cg / "user.slice" / "memory.max").write_text("max\n")
    (cg / "user.slice" / "memory.current").write_text("0\n")
    job = cg / "user.slice" / "job"
    (job / "memory.max").write_text(str(24 * GiB) + "\n")
    (job / "memory.current").write_text(str(4 * GiB) + "\n")
    (job / "memory.stat").write_text(f"anon 1\ninactive_file {1 * GiB}\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("0::/user.slice/job\n")
    limits = sysmem.cgroup_limits(str(proc), str(cg))
    assert limits == [(f"cgroup v2 {job}/memory.max", 24 * GiB, 3 * GiB)]


def test_cgroup_v1_parent_limit_binds(tmp_path):
    mem = tmp_path / "cgroup" / "memory"
    child = mem / "process_api" / "abc"
    child.mkdir(parents=True)
    unlimited = "9223372036854771712\n"
    (child / "memory.limit_in_bytes").write_text(unlimited)
    (child / "memory.usage_in_bytes").write_text(str(GiB))
    (mem / "process_api" / "memory.limit_in_bytes").write_text(str(16 * GiB))
    (mem / "process_api" / "memory.usage_in_bytes").write_text(str(6 * GiB))
    (mem / "process_api" / "memory.stat").write_text(f"cache 5\ntotal_inactive_file {2 * GiB}\n")
    proc = tmp_path / "cgroup.txt"
    proc.write_text("5:devices:/\n4:memory:/process_api/abc\n0::/\n")
    limits = sysmem.cgroup_limits(str(proc), str(tmp_path / "cgroup"))
    assert limits == [(f"cgroup v1 {mem / 'process_api'}/memory.limit_in_bytes", 16 * GiB, 4 * GiB)]


def test_host_memory_is_the_smaller_of_meminfo_and_cgroup(monkeypatch):
    real = sysmem.meminfo("/proc/meminfo")
    assert real["MemTotal"] >= real["MemAvailable"] > 0
    monkeypatch.setattr(sysmem, "meminfo", lambda: {"MemTotal": 128 * GiB, "MemAvailable": 100 * GiB})
    monkeypatch.setattr(sysmem, "cgroup_limits", lambda: [("cgroup v2 /job/memory.max", 24 * GiB, 4 * GiB)])
    hm = sysmem.host_memory()
    assert (hm.total, hm.available, hm.source) == (24 * GiB, 20 * GiB, "cgroup v2 /job/memory.max")
    monkeypatch.setattr(sysmem, "cgroup_limits", lambda: [])
    hm = sysmem.host_memory()
    assert (hm.total, hm.available) == (128 * GiB, 100 * GiB) and "MemAvailable" in hm.source


def test_a_probed_moe_layer_is_counted_by_active_parameters_and_matched_only_to_its_shape(tmp_path):
    """The probe counts a MoE layer's executed FLOPs by its active parameters (the planner's count) and records the
    expert sizes; a profile's MoE rate applies to that MoE shape only, and a dense rate never to a MoE layer (which
    without a measured rate runs at MOE_DEFAULT_SHARE of the default rate, said in the plan)."""
    from conftest import make_model_dir
    from transformers import AutoConfig

    from megatrain.models import get_adapter
    from megatrain.planner.probe import layer_rate
    from megatrain.planner.profile import MOE_DEFAULT_SHARE, LayerRate, Profile

    make_model_dir(tmp_path, "qwen3_moe", seed=0)
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    r = layer_rate(str(tmp_path), 2, 16, "cpu", False, reps=1)
    assert (r["experts"], r["top_k"], r["expert_intermediate"]) == (4, 2, 48)
    unit = next(u for u in ad.units() if u.kind == "layer")
    assert ad.active_numel(unit) < unit.numel
    attn = 2.0 * 16 * ad.num_heads * ad.head_dim
    assert r["forward_flops"] == pytest.approx((2.0 * ad.active_numel(unit) + attn) * 32 / r["forward_s"])
    rate = LayerRate(**{k: v for k, v in r.items() if k in LayerRate.__dataclass_fields__})
    prof = Profile(source="t", measured=True, layer_rates=[rate])
    assert prof.layer_rate(ad, 2, 16, False)[0] == rate
    dense = LayerRate(**{**rate.__dict__, "experts": 0, "top_k": 0, "expert_intermediate": 0})
    prof = Profile(source="t", measured=True, layer_rates=[dense])
    assert prof.layer_rate(ad, 2, 16, False)[0] is None
    w = Workload((2,), 16)
    moe_plan = make_plan(ad, w, DEFAULTS)
    assert f"MoE layers at {MOE_DEFAULT_SHARE:.2f}" in moe_plan.time["rate_source"]
