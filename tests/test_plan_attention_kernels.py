"""The planner times each layer's attention on the kernel it runs on CUDA: SDPA's causal flash kernel for plain rows,
the variable-length flash kernel for packed rows and windows shorter than the row where it runs them
(models/base.prefers_flex), FlexAttention for the rest, Gemma 2's soft-capping and gpt-oss's sinks, each at its
measured share of SDPA's rate at the rows' span (calibration.KERNEL_RATE); and `megatrain train` without a probed
profile plans with this machine's CPU AdamW rate."""

from dataclasses import replace
from pathlib import Path

import pytest

from megatrain.models import get_adapter
from megatrain.planner import Workload
from megatrain.planner.flops import kind_span
from megatrain.planner.calibration import KERNEL_RATE, SDPA_RATE
from megatrain.planner.profile import DEFAULTS, LayerRate, layer_shape
from megatrain.planner.kernel_time import kernel_extra, kernel_share, sdpa_rate
from megatrain.planner.timing import step_time

CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "model-configs"


def adapter_of(name: str, **overrides):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(CONFIGS / name)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return get_adapter(cfg)


def test_kernel_per_family_and_row():
    llama = adapter_of("llama-3.1-8b")
    assert llama.cuda_attention("full", 4096, packed=False) == ("flash", "plain")
    assert llama.cuda_attention("full", 4096, packed=True) == ("flex", "plain")  # measured faster at head_dim 128
    assert llama.cuda_attention("full", 32768, packed=True) == ("varlen", "plain")  # long rows: varlen
    wide = adapter_of("llama-3.1-8b", head_dim=256)
    assert wide.cuda_attention("full", 4096, packed=True) == ("varlen", "plain")
    gemma2 = adapter_of("gemma-2-9b")  # soft-capped scores: FlexAttention on every layer, packed or not
    assert {gemma2.cuda_attention(k, 4096, False) for k in gemma2.layer_kinds} == {("flex", "softcap")}
    assert {gemma2.cuda_attention(k, 4096, True) for k in gemma2.layer_kinds} == {("flex", "softcap")}
    gemma3 = adapter_of("gemma-3-27b")  # no capping: sliding layers run a masked kernel only past their window
    window = gemma3.sliding_window
    assert gemma3.cuda_attention("sliding", window, False) == ("flash", "plain")
    assert gemma3.cuda_attention("sliding", window + 1, False) == ("flex", "plain")
    assert gemma3.cuda_attention("sliding", 65536, False) == ("varlen", "plain")
    assert gemma3.cuda_attention("full", 4 * window, False) == ("flash", "plain")
    gpt_oss = adapter_of("gpt-oss-120b")  # sinks need the kernel's log-sum-exp: FlexAttention everywhere
    assert {gpt_oss.cuda_attention(k, 4096, False) for k in gpt_oss.layer_kinds} == {("flex", "sinks")}


def test_kernel_share_is_the_measured_points_log_linear_between():
    for (kernel, score, d), pts in KERNEL_RATE.items():
        assert [p[0] for p in pts] == sorted(p[0] for p in pts), (kernel, score, d)
        for span, f, fb in pts:
            assert kernel_share(kernel, score, d, span) == pytest.approx((f, fb), rel=1e-12)
            assert 0 < f <= 1 and 0 < fb <= 1
        assert kernel_share(kernel, score, d, pts[0][0] / 4) == kernel_share(kernel, score, d, pts[0][0])  # flat
        assert kernel_share(kernel, score, d, pts[-1][0] * 4) == kernel_share(kernel, score, d, pts[-1][0])
        for (s0, f0, b0), (s1, f1, b1) in zip(pts, pts[1:]):  # the geometric mean of two spans: the mean share
            assert kernel_share(kernel, score, d, (s0 * s1) ** 0.5) == pytest.approx(((f0 + f1) / 2, (b0 + b1) / 2),
                                                                                   rel=1e-9)
    assert kernel_share("varlen", "plain", 96, 4096) == kernel_share("varlen", "plain", 128, 4096)  # nearest (log)
    # soft-capping measured at head_dim 256 only: at 128, plain's share there times softcap's over plain's at 256
    plain128, soft256, plain256 = (kernel_share("flex", s, d, 3000) for s, d in
                                   (("plain", 128), ("softcap", 256), ("plain", 256)))
    assert kernel_share("flex", "softcap", 128, 3000) == pytest.approx(
        (plain128[0] * soft256[0] / plain256[0], plain128[1] * soft256[1] / plain256[1]), rel=1e-12)
    # shorter documents run slower per FLOP (blocks and tails partly empty): the shares fall with the span
    for kernel in ("varlen", "flex"):
        shares = [kernel_share(kernel, "plain", 128, s)[1] for s in (400, 1800, 4096, 32768)]
        assert shares == sorted(shares) and shares[0] < 0.25 < shares[-1]


def test_sdpa_rate_is_the_measured_points_log_linear_between():
    for d, pts in SDPA_RATE.items():
        for T, f, fb in pts:
            assert sdpa_rate(d, T) == pytest.approx((f, fb), rel=1e-12)
            assert 1e14 < fb < f < 1e15  # FLOP/s; the backward's rate below the forward's
        assert sdpa_rate(d, pts[0][0] / 8) == sdpa_rate(d, pts[0][0])
        assert sdpa_rate(d, pts[-1][0] * 8) == sdpa_rate(d, pts[-1][0])
    (t0, f0, b0), (t1, f1, b1) = SDPA_RATE[128][:2]
    assert sdpa_rate(128, (t0 * t1) ** 0.5) == pytest.approx(((f0 + f1) / 2, (b0 + b1) / 2), rel=1e-9)
    assert sdpa_rate(96, 4096) == sdpa_rate(128, 4096)


def test_kernel_extra_per_layer_and_token():
    """Each layer on another kernel costs the time that kernel takes beyond SDPA's over its FLOPs at its span:
    forward 2·span·heads·head_dim per token at kernel_share of SDPA_RATE, forward + backward 3.5x those FLOPs."""
    llama = adapter_of("llama-3.1-8b")
    assert kernel_extra(llama, Workload((1,), 4096)) == (0.0, 0.0)  # SDPA's kernel: nothing added

    def extra(adapter, kernel, score, span):
        f, fb = kernel_share(kernel, score, adapter.head_dim, span)
        rf, rfb = sdpa_rate(adapter.head_dim, span)
        x = 2.0 * span * adapter.num_heads * adapter.head_dim
        return x * (1 / f - 1) / rf, 3.5 * x * (1 / fb - 1) / rfb

    # packed rows of 4,096 at head_dim 128 run FlexAttention: at the whole row's span while the documents are not
    # known, at theirs once they are (data.sampler.packed_span)
    assert kernel_extra(llama, Workload((1,), 4096, packed=True)) == pytest.approx(
        extra(llama, "flex", "plain", 4096), rel=1e-12)
    known = Workload((1,), 4096, packed=True, attn_len=1800.0)
    assert kernel_extra(llama, known) == pytest.approx(extra(llama, "flex", "plain", 1800), rel=1e-12)
    assert kernel_extra(llama, Workload((1,), 65536, packed=True, attn_len=20000.0)) == pytest.approx(
        extra(llama, "varlen", "plain", 20000), rel=1e-12)  # long packed rows: the varlen kernel
    # gemma-3: its sliding layers on the varlen kernel past the window, at the window's span; the full ones nothing
    gemma3 = adapter_of("gemma-3-27b")
    T, kinds = 65536, gemma3.layer_kinds
    window = kind_span(gemma3, "sliding", T)
    xf, xfb = extra(gemma3, "varlen", "plain", window)
    n = kinds.count("sliding") / len(kinds)
    assert kernel_extra(gemma3, Workload((1,), T)) == pytest.approx((n * xf, n * xfb), rel=1e-12)
    # gpt-oss: every layer on FlexAttention with sinks, the sliding ones over 128 keys at that span's (low) share
    gpt_oss = adapter_of("gpt-oss-120b")
    kinds = gpt_oss.layer_kinds
    full, sliding = extra(gpt_oss, "flex", "sinks", 4096), extra(gpt_oss, "flex", "sinks",
                                                                 kind_span(gpt_oss, "sliding", 4096))
    mean = [(kinds.count("full") * a + kinds.count("sliding") * b) / len(kinds) for a, b in zip(full, sliding)]
    assert kernel_extra(gpt_oss, Workload((1,), 4096)) == pytest.approx(tuple(mean), rel=1e-12)


def test_step_time_adds_the_kernel_per_layer_use():
    """Packed rows of a dense model: each layer's forward use costs xf more per token, each backward use xfb
    (FlexAttention's time beyond SDPA's at 4,096 tokens and head_dim 128), with a probed layer rate or without."""
    llama = adapter_of("llama-3.1-8b", num_hidden_layers=4)
    units = llama.units()
    plain = step_time(llama, units, Workload((2, 2), 4096, compile=True), DEFAULTS)
    w = Workload((2, 2), 4096, compile=True, packed=True)
    packed = step_time(llama, units, w, DEFAULTS)
    xf, xfb = kernel_extra(llama, w)
    tokens = 4 * 4096
    assert packed["compute_s"] - plain["compute_s"] == pytest.approx(llama.num_layers * tokens * (xf + xfb),
                                                                     rel=1e-9)
    assert "KERNEL_RATE" in packed["rate_source"] and "KERNEL_RATE" not in plain["rate_source"]
    # a probed layer rate (the probe ran SDPA over plain rows): the same extra on top of it
    shape = dict(zip(("hidden", "intermediate", "heads", "kv_heads", "head_dim"), layer_shape(llama)))
    probed = replace(DEFAULTS, layer_rates=[LayerRate(**shape, micro=2, seq=4096, compile=True, forward_flops=5e14,
                                                      backward_flops=4.5e14)])
    assert probed.layer_rate(llama, 2, 4096, True)[1] == "measured at this shape"
    d = step_time(llama, units, w, probed)["compute_s"] - step_time(llama, units, Workload((2, 2), 4096, compile=True),
                                                                   probed)["compute_s"]
    assert d == pytest.approx(llama.num_layers * tokens * (xf + xfb), rel=1e-9)
    # rows of short documents (attention over 400 tokens a token): less attention work at a lower share, less time
    short = step_time(llama, units, Workload((2, 2), 4096, compile=True, packed=True, attn_len=400.0), DEFAULTS)
    assert short["compute_s"] < plain["compute_s"] < packed["compute_s"]
    # a CPU run has no kernel choice: nothing added
    cpu_plain = step_time(llama, units, Workload((2, 2), 4096, device="cpu"), DEFAULTS)
    cpu_packed = step_time(llama, units, Workload((2, 2), 4096, device="cpu", packed=True), DEFAULTS)
    assert cpu_plain["compute_s"] == cpu_packed["compute_s"]


def test_train_measures_the_cpu_adamw_without_a_profile(tmp_path, monkeypatch):
    from megatrain.config import load_config
    from megatrain.planner import plan as plan_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no probed profile at the default path
    cfg = load_config(None, [])
    prof = plan_mod.run_profile(cfg, "cuda", adam_params=1 << 18)
    assert not prof.measured and prof.source.startswith("defaults, CPU AdamW measured here")
    assert prof.adamw_params_per_s > 0 and prof.adamw_params_per_s != DEFAULTS.adamw_params_per_s
    import torch

    from megatrain.planner.probe import adamw_thread_counts

    assert prof.adamw_threads in adamw_thread_counts(torch.get_num_threads())
    assert f"with {prof.adamw_threads} threads" in prof.source
    assert plan_mod.run_profile(cfg, "cpu") == DEFAULTS  # a CPU run updates inline: the defaults' note stands
    # a probed profile is kept as it is
    import json

    probed = tmp_path / "probed.json"
    probed.write_text(json.dumps({"host": "elsewhere", "cpu": {"adamw_params_per_s": 1.5e9}}))
    kept = plan_mod.run_profile(load_config(None, [f"plan.profile={probed}"]), "cuda", adam_params=1 << 18)
    assert kept.measured and kept.adamw_params_per_s == 1.5e9 and kept.source == str(probed)


def test_a_distributed_run_plans_with_the_adamw_rate_rank_0_measured(tmp_path, monkeypatch):
    """Ranks that each measured the CPU AdamW would plan with different rates, hence maybe different placements:
    rank 0 measures, publishes the number in the run's store (Distributed.agreed), and the other ranks, waiting for
    it there, plan with it without measuring."""
    import threading
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from megatrain.config import load_config
    from megatrain.distributed.session import Distributed
    from megatrain.planner import plan as plan_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = load_config(None, [])
    store = dist.HashStore()
    arrived = threading.Barrier(3)  # Distributed.phase: every rank arrives before rank 0 measures
    ranks = [SimpleNamespace(world=SimpleNamespace(rank=r), store=store, phase=lambda name: arrived.wait(60))
             for r in range(3)]
    measured, got = [], {}

    def run(r):
        def agree(name, compute):
            return Distributed.agreed(ranks[r], name, lambda: measured.append(r) or compute())
        prof = plan_mod.run_profile(cfg, "cuda", adam_params=1 << 18, agree=agree, ranks_per_node=3)
        got[r] = (prof.adamw_params_per_s, prof.adamw_threads)

    others = [threading.Thread(target=run, args=(r,)) for r in (1, 2)]
    for t in others:  # they start first, and wait for rank 0's number
        t.start()
    run(0)
    for t in others:
        t.join(timeout=60)
    assert set(measured) == {0}  # the thread count and the rate, both rank 0's
    assert got[0][0] > 0 and got[1] == got[0] and got[2] == got[0]
    from megatrain.planner.probe import adamw_thread_counts  # the node's counts: this process's threads x 3 ranks

    assert got[0][1] in adamw_thread_counts(torch.get_num_threads() * 3)


def test_a_failed_measurement_of_rank_0_fails_the_others_at_once_not_at_the_store_timeout():
    import threading
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatrain.distributed.session import Distributed

    store = dist.HashStore()
    arrived = threading.Barrier(2)
    ranks = [SimpleNamespace(world=SimpleNamespace(rank=r), store=store, phase=lambda name: arrived.wait(60))
             for r in range(2)]
    seen = {}

    def other():
        try:
            Distributed.agreed(ranks[1], "rate", lambda: 1.0)
        except RuntimeError as e:
            seen[1] = str(e)

    def broken():
        raise ValueError("no layer to run")

    t = threading.Thread(target=other)
    t.start()
    with pytest.raises(ValueError):
        Distributed.agreed(ranks[0], "rate", broken)
    t.join(timeout=30)
    assert not t.is_alive() and seen[1] == "rank 0 could not compute rate (ValueError: no layer to run)"


def test_plan_on_the_training_machine_uses_the_rate_train_measures(tmp_path, monkeypatch, capsys):
    """`megatrain plan` run where the training runs (a GPU here, no probed profile) plans with the CPU AdamW rate
    measured here, as `megatrain train` does at its start, so both choose the same placement; planned from a
    machine without a GPU, the defaults stand."""
    import json

    from megatrain.config import load_config
    from megatrain.planner import plan as plan_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no probed profile at the default path
    cfg = load_config(None, ["train.device=cuda"])

    def planned() -> dict:
        plan_mod.plan_command(cfg, as_json=True)
        return json.loads(capsys.readouterr().out)

    elsewhere = planned()
    assert elsewhere["profile"] == DEFAULTS.source
    assert elsewhere["cpu_adamw_params_per_s"] == DEFAULTS.adamw_params_per_s
    import torch

    monkeypatch.setattr(plan_mod, "torch_cuda_available", lambda: True)  # a GPU here, as the plan sees it
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (140 * 2**30, 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a GPU")
    here = planned()
    assert here["profile"].startswith("defaults, CPU AdamW measured here")
    assert here["cpu_adamw_params_per_s"] > 0 and here["cpu_adamw_params_per_s"] != DEFAULTS.adamw_params_per_s


def test_the_cpu_adamw_runs_with_the_fewest_threads_as_fast_as_the_most():
    """The optimizer's thread count: three quarters and half of the cores are timed (and all of them on at most 16),
    and the fewest within 5% of the fastest is used (the x4 host's 64 vCPUs: 0.1-3.2 Gparam/s with 64 threads,
    3.7-4.2 with 32; the x2 host's 32: all 32 starved the GPU's feeder)."""
    import torch

    from megatrain.planner.probe import adamw_rates, adamw_thread_counts, choose_adamw_threads

    assert adamw_thread_counts(64) == [32, 48] and adamw_thread_counts(32) == [16, 24]
    assert adamw_thread_counts(16) == [8, 12, 16] and adamw_thread_counts(8) == [4, 6, 8]
    assert adamw_thread_counts(4) == [4] and adamw_thread_counts(0) == [1]
    assert choose_adamw_threads({32: 3.95e9, 48: 3.1e9, 64: 0.9e9}) == 32
    assert choose_adamw_threads({8: 3.0e9, 12: 3.9e9, 16: 4.0e9}) == 12  # within 5%: fewer threads
    assert choose_adamw_threads({8: 3.5e9, 12: 3.7e9, 16: 4.0e9}) == 16
    before = torch.get_num_threads()
    rates = adamw_rates(1 << 16, torch.bfloat16, [1, 2], reps=1)
    assert set(rates) == {1, 2} and all(r > 0 for r in rates.values())
    assert torch.get_num_threads() == before


def test_the_run_uses_the_planned_adamw_threads(tmp_path, monkeypatch):
    """runtime_options gives the optimizer the thread count the plan's AdamW rate was measured with, never more
    than this process has (a distributed rank's share of the node's cores)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from megatrain.config import load_config
    from megatrain.run.prepare import runtime_options

    cfg = load_config(None, [])
    placement = SimpleNamespace()
    plan = SimpleNamespace(profile=dataclasses.replace(DEFAULTS, adamw_threads=1), placement=placement)
    assert runtime_options(cfg, torch.device("cpu"), plan).adam_threads == 1
    plan.profile = dataclasses.replace(DEFAULTS, adamw_threads=10_000)
    assert runtime_options(cfg, torch.device("cpu"), plan).adam_threads == torch.get_num_threads()
    plan.profile = DEFAULTS  # no measured count: torch's
    assert runtime_options(cfg, torch.device("cpu"), plan).adam_threads is None
    # a distributed rank: the node's count split between the node's ranks
    plan.profile = dataclasses.replace(DEFAULTS, adamw_threads=32)
    got = runtime_options(cfg, torch.device("cpu"), plan, ranks_per_node=4).adam_threads
    assert got == min(8, torch.get_num_threads())
    plan.profile = dataclasses.replace(DEFAULTS, adamw_threads=2)
    assert runtime_options(cfg, torch.device("cpu"), plan, ranks_per_node=4).adam_threads == 1


def test_packed_rows_are_timed_at_their_documents_attention_span():
    """Packed documents of length d attend over d, not the row: with the data's span sum(d²)/sum(d) known
    (Workload.attn_len) the attention's FLOPs and time shrink, the matmuls' do not, and without it (a bound) the
    plan is today's; plain rows ignore it."""
    from megatrain.planner.timing import executed_flops

    llama = adapter_of("llama-3.1-8b")
    units = llama.units()
    T = 131072
    bound = Workload((1,), T, packed=True, compile=True)
    docs = Workload((1,), T, packed=True, compile=True, attn_len=16384.0)
    assert bound.span_len == T and docs.span_len == 16384.0
    assert Workload((1,), T, attn_len=16384.0).span_len == T  # plain rows attend over the row
    f_bound, f_docs = executed_flops(llama, units, bound), executed_flops(llama, units, docs)
    attn = lambda w: 2.0 * w.span_len * llama.num_heads * llama.head_dim * llama.num_layers * T  # noqa: E731
    # every use's matmul FLOPs are the same; the forward wave's attention scales with the span exactly
    assert f_bound["forward"] - f_docs["forward"] == pytest.approx(attn(bound) - attn(docs), rel=1e-9)
    s_bound, s_docs = step_time(llama, units, bound, DEFAULTS), step_time(llama, units, docs, DEFAULTS)
    assert s_docs["step_s"] < 0.8 * s_bound["step_s"]
    assert step_time(llama, units, Workload((1,), T, packed=True, compile=True, attn_len=float(T)),
                     DEFAULTS)["step_s"] == s_bound["step_s"]


def test_a_run_retimes_packed_rows_from_its_documents():
    """`megatrain train` knows the documents once the data is read: the plan's step is timed again over their span,
    its memory and placement unchanged; plain rows and a span of the whole row leave the plan as it was."""
    from megatrain.planner.estimate import estimate, retime_packed
    llama = adapter_of("llama-3.1-8b", num_hidden_layers=2)
    plan = estimate(llama, Workload((1,), 65536, packed=True, compile=True), DEFAULTS)
    before, gpu, host, notes = dict(plan.time), plan.gpu_peak, dict(plan.host), len(plan.notes)
    retime_packed(plan, llama, 65536.0)  # documents as long as the row: nothing to retime
    assert plan.time == before and len(plan.notes) == notes
    retime_packed(plan, llama, 8192.0)  # eight documents of 8,192 tokens a row (sampler.packed_span)
    assert plan.workload.attn_len == 8192.0 and plan.step_s < 0.8 * before["step_s"]
    assert plan.gpu_peak == gpu and plan.host == host and "documents and padding pieces" in plan.notes[-1]
    plain = estimate(llama, Workload((1,), 65536, compile=True), DEFAULTS)
    t = dict(plain.time)
    retime_packed(plain, llama, 8192.0)
    assert plain.time == t
