"""rollout_estimate (megatrain/rollout/plan.py): the KV cache and the bounds written out for a real config."""

from dataclasses import replace
from pathlib import Path

import pytest

from megatrain.models import load_hf_config
from megatrain.planner.calibration import ROLLOUT_HBM_BPS, ROLLOUT_MATMUL_EFFICIENCY, ROLLOUT_STEP_OVERHEAD_S
from megatrain.planner.profile import DEFAULTS
from megatrain.planner.rollout_estimate import rollout_estimate

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "model-configs"


def test_qwen25_7b_resident_and_streamed_bounds():
    cfg = load_hf_config(CONFIGS / "qwen2.5-7b")
    prof = replace(DEFAULTS, gpu_name="NVIDIA H100 80GB HBM3", h2d_bps=50e9)
    seqs, prompt, new = 512, 128, 512
    # 28 layers x 4 KV heads x 128 x (K and V) x bf16, per position
    assert rollout_estimate(cfg, seqs, prompt, new, "resident", prof)["kv_bytes"] == \
        seqs * (prompt + new) * 28 * 4 * 128 * 2 * 2
    st = rollout_estimate(cfg, 8, prompt, new, "streamed", prof)
    assert st["bound"] == "bus"
    # bound by the bus: the host's work of a step runs while the layers cross it
    assert st["decode_step_s"] == pytest.approx(st["layer_bytes"] / 50e9)
    one = rollout_estimate(cfg, 1, prompt, new, "resident", prof)
    assert one["bound"] == "hbm"
    kv = (prompt + new // 2) * 28 * 4 * 128 * 2 * 2
    assert one["decode_step_s"] == pytest.approx((one["weight_bytes"] + kv) / ROLLOUT_HBM_BPS["H100"]
                                                 + ROLLOUT_STEP_OVERHEAD_S)
    big = rollout_estimate(cfg, 4096, prompt, new, "resident", prof)
    assert big["bound"] == "compute" and big["tokens_per_s"] > one["tokens_per_s"]
    assert big["decode_step_s"] > 4096 * 2 * 7e9 / (prof.peak_bf16 * ROLLOUT_MATMUL_EFFICIENCY)
    assert st["resident_bytes"] < rollout_estimate(cfg, 8, prompt, new, "resident", prof)["resident_bytes"]
    with pytest.raises(ValueError, match="rollout mode"):
        rollout_estimate(cfg, 8, prompt, new, "auto", prof)


def test_the_rollout_phase_counts_the_updates_before_it_and_the_weights_copy():
    """The sampler reads the store's copy, so the last step's updates finish first: with clipping all of them (they
    otherwise overlap the next forward), without it the tail that outlasts the backward; a resident sampler then
    copies the bf16 weights to the device at the profile's H2D rate. Both are in the rollout's time."""
    from types import SimpleNamespace

    from megatrain.models import get_adapter
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.profile import GiB
    from megatrain.planner.rollout_plan import plan_rollout

    adapter = get_adapter(load_hf_config(CONFIGS / "qwen2.5-7b"))
    grpo = SimpleNamespace(prompts_per_rollout=64, num_generations=8, max_new_tokens=512, num_iterations=1,
                           beta=0.0, rollout="resident")
    cfg = SimpleNamespace(grpo=grpo, train=SimpleNamespace(objective="grpo", micro_batch_size=64, grad_accum_steps=8),
                          data=SimpleNamespace(max_seq_len=640))
    for clipping in (True, False):
        plan = make_plan(adapter, Workload((64,) * 8, 640, device="cuda", clipping=clipping), DEFAULTS,
                         suggest=False, host_available=1024 * GiB)
        plan_rollout(plan, cfg, adapter)
        r, tm = plan.rollout, plan.time
        assert r["drain_s"] == (tm["optimizer_s"] if clipping else tm["optimizer_wait_s"])
        assert r["drain_s"] > 0 if clipping else r["drain_s"] >= 0
        assert r["setup_s"] == pytest.approx(r["resident_bytes"] / DEFAULTS.h2d_bps)
        assert r["rollout_s"] == pytest.approx(r["drain_s"] + r["setup_s"] + r["prefill_s"]
                                               + r["decode_step_s"] * 512)
    grpo.rollout = "streamed"  # the layers cross the bus in every decode step: no copy before it
    plan_rollout(plan, cfg, adapter)
    assert plan.rollout["setup_s"] == 0.0
