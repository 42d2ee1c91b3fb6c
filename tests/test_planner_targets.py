"""The placements the planner chooses for the runs this project exists for, planned from config.json alone with the
H200's probe (bench/results/probe-h200/profile.json), CUDA defaults (compiled layers), no memory keys set:
what `megatrain plan` says before a run (GPU runs check it against measurement: bench/README.md)."""

from pathlib import Path

import pytest
from transformers import AutoConfig

from megatrain.models import get_adapter
from megatrain.planner import Workload, make_plan
from megatrain.planner.placement import FREE_ALL
from megatrain.planner.profile import GiB, load_profile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = load_profile(ROOT / "bench" / "results" / "probe-h200" / "profile.json")


def plan(name, micro, n, seq, gpu_gib=None, host_gib=None, layers=None):
    cfg = AutoConfig.from_pretrained(ROOT / "bench" / "model-configs" / name)
    if layers:
        cfg.num_hidden_layers = layers
    adapter = get_adapter(cfg)
    gpu = gpu_gib * GiB if gpu_gib else float(PROFILE.gpu_total_bytes)
    return make_plan(adapter, Workload((micro,) * n, seq, compile=True), PROFILE, suggest=False, gpu_limit=gpu,
                     host_available=host_gib * GiB if host_gib else None, choose_keys=FREE_ALL)


def test_llama_70b_at_half_a_million_tokens_per_step_fits_one_h200():
    p = plan("llama-3.1-70b", 1, 128, 4096, host_gib=1536)
    assert p.fits, p.problems
    assert p.gpu_needed <= 130 * GiB
    assert p.host_total / p.params <= 18.5
    assert p.time["tflops_6n"] >= 400
    # the default placement would need 900 GiB of GPU: the plan says why it chose another
    assert "the default placement needs" in p.why


@pytest.mark.parametrize("name,micro,n,seq,gpu", [
    ("llama-3.1-8b", 1, 16, 4096, 22),  # a 24 GB card's class
    ("llama-3.1-8b", 1, 64, 4096, 78),  # an H100 80 GB (what it has free)
    ("qwen2.5-14b", 79, 2, 1024, 80),
])
def test_runs_that_did_not_fit_now_fit(name, micro, n, seq, gpu):
    p = plan(name, micro, n, seq, gpu_gib=gpu)
    assert p.fits, p.problems
    assert p.gpu_needed <= gpu * GiB


def test_gpu_memory_is_flat_in_depth_under_a_budget():
    """Width 2048, 131,072 tokens per step, 16 to 128 layers under a 24 GiB budget: every depth fits; from the depth
    where the default placement stops fitting (32) the GPU peak stays within 10% (spare GPU memory is used first:
    16 layers need less than the budget), and the predicted throughput within 5%, while host RAM grows with the
    parameters."""
    plans = [plan("llama-2048-shape", 16, 4, 2048, gpu_gib=24, layers=d) for d in (16, 32, 64, 128)]
    assert all(p.fits and p.gpu_needed <= 24 * GiB for p in plans), [p.problems for p in plans]
    peaks = [p.gpu_peak for p in plans[1:]]
    assert max(peaks) <= 1.10 * min(peaks), [x / GiB for x in peaks]
    assert plans[-1].host_total > 4 * plans[1].host_total
    rates = [p.time["tflops_6n"] for p in plans]
    assert max(rates) <= 1.05 * min(rates), rates


def test_a_placement_at_the_host_limit_gives_way_to_one_with_room():
    """Qwen2.5-32B, 158 x 1024 on one H200 with 500 GiB of host (the 4-GPU machine's host): the placements that keep
    the bf16 copy fit only to the last GiB (499.6 of 500 before this rule: within the plan's own error of the limit),
    while streaming the fp32 master fits with 58 GiB to spare and is as fast. The planner takes the one with room;
    with 600 GiB the copy leaves room and is kept, and the plan says what streaming the master would save."""
    from megatrain.planner.placement import HOST_HEADROOM, NEAR_FASTEST

    short = plan("qwen2.5-32b", 79, 2, 1024, host_gib=500)
    assert short.fits and short.placement.stream_dtype == "fp32", short.why
    assert short.host_total <= (1 - HOST_HEADROOM) * 500 * GiB
    assert "less than 5% of the host RAM would stay free" in short.why
    roomy = plan("qwen2.5-32b", 79, 2, 1024, host_gib=600)
    assert roomy.fits and roomy.placement.stream_dtype == "bf16", roomy.why
    assert roomy.host_total <= (1 - HOST_HEADROOM) * 600 * GiB
    assert "that keep the bf16 copy (streaming the fp32 master instead: 61.0 GiB less)" in roomy.why
    assert short.step_s <= (1 + NEAR_FASTEST) * roomy.step_s


def test_a_run_that_fits_keeps_the_default_placement():
    p = plan("qwen2.5-7b", 79, 2, 1024)
    assert p.fits and p.why == "the default placement fits"
    assert p.placement.spill_layers == 0 and p.placement.grads_to_host == 0 and p.placement.wave_groups == 1


def test_plan_json_for_70b_names_the_placement(tmp_path):
    """`megatrain plan CONFIG --json` on the 70B run, as a script reads it: the figures and the placement chosen."""
    import json

    from test_plan import cli, write_70b_run

    cfg = write_70b_run(tmp_path)
    r = cli("plan", str(cfg), "--json", "train.device=cuda", "train.micro_batch_size=1", "train.grad_accum_steps=128",
            "data.max_seq_len=4096", "memory.host_budget_gb=1536", "checkpoint.at_end=false",
            f"plan.profile={ROOT / 'bench' / 'results' / 'probe-h200' / 'profile.json'}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("fits", "gpu_peak_gib", "host_peak_gib", "host_bytes_per_param", "step_time_s", "tflops_6n",
                "placement", "placement_why"):
        assert key in out, key
    assert out["fits"] and out["gpu_needed_gib"] <= 130 and out["host_bytes_per_param"] <= 18.5
    assert out["placement"]["wave_groups"] > 1 and out["tokens_per_step"] == 128 * 4096
    # the report says the same in words
    r = cli("plan", str(cfg), "train.device=cuda", "train.micro_batch_size=1", "train.grad_accum_steps=128",
            "data.max_seq_len=4096", "memory.host_budget_gb=1536", "memory.wave_groups=1",
            f"plan.profile={ROOT / 'bench' / 'results' / 'probe-h200' / 'profile.json'}", cwd=tmp_path)
    assert "placement: memory.checkpoint_every=" in r.stdout and "memory.wave_groups=1" in r.stdout
    assert r.returncode in (0, 1)


def test_host_memory_only_grows_with_gradients_and_inputs_sent_there():
    """The search's pruning (placement._Search.settle): a structure whose host memory is over the limit before any
    gradient or input is sent to the host is dropped unsearched, which is right only if sending more never takes
    host memory back."""
    from dataclasses import replace

    from megatrain.planner.memory import host_memory
    from megatrain.runtime.schedule import Placement

    adapter = get_adapter(AutoConfig.from_pretrained(ROOT / "bench" / "model-configs" / "qwen2.5-14b"))
    units = adapter.units()
    n, L = len(units), len(units) - 2
    for micro in ((79, 79), (16,) * 6):
        for base in (Placement(), Placement(checkpoint_every=2), Placement(wave_groups=2, group_grads="host"),
                     Placement(wave_groups=3, group_grads="gpu", stream_dtype="fp32"),
                     Placement(checkpoint_every=4, keep_top_layers=8, seq_tile=8192)):
            w = Workload(micro, 1024, compile=True, placement=base)
            last_row = None
            for g in (0, 1, 7, n // 2, n):
                row = [sum(host_memory(units, replace(w, placement=replace(base, grads_to_host=g, spill_layers=s)),
                                       adapter.tied).values()) for s in (0, 1, 9, L // 2, L)]
                assert row == sorted(row), (micro, base, g, row)
                if last_row is not None:
                    assert all(b >= a for a, b in zip(last_row, row)), (micro, base, g)
                last_row = row


@pytest.mark.parametrize("name,micro,n,seq,gpu,host", [
    ("qwen2.5-14b", 79, 2, 1024, 80, 249),  # fp32 streaming, at the host's edge
    ("llama-3.1-8b", 1, 16, 4096, 22, 125),
    ("qwen2.5-14b", 79, 2, 1024, 80, 150),  # nothing fits
])
def test_the_pruned_search_chooses_what_the_full_search_chooses(monkeypatch, name, micro, n, seq, gpu, host):
    from megatrain.planner import placement

    pruned = plan(name, micro, n, seq, gpu_gib=gpu, host_gib=host)
    monkeypatch.setattr(placement._Search, "host", lambda self, pl: 0.0)  # never prune
    full = plan(name, micro, n, seq, gpu_gib=gpu, host_gib=host)
    assert pruned.fits == full.fits and pruned.placement == full.placement
    assert pruned.step_s == full.step_s and pruned.host_total == full.host_total
