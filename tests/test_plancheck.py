"""The plan held against a GPU run's steady steps (run/plancheck.py): silent while the steps are not steady or are
within 15% of the plan; once, when one is not, a line naming the step, both times, the GPU's idle time, the SSD
tier's disk rate against the plan's and the probe that would make the plan right; never for a CPU run."""

import io
from pathlib import Path

import pytest
import torch

from transformers import AutoConfig

from megatrain.models import get_adapter
from megatrain.planner import Workload, make_plan
from megatrain.planner.estimate import packed_step_time, retime_packed
from megatrain.planner.profile import DEFAULTS, GiB
from megatrain.run.metrics import MetricsLogger
from megatrain.run.plancheck import MEDIAN_OF, SLOW_STEP, STEADY_AFTER, PlanCheck

QWEN14 = Path(__file__).resolve().parent.parent / "bench" / "model-configs" / "qwen2.5-14b"


def ssd_plan(device: str = "cuda"):
    """Qwen2.5-14B 158 x 1024 with Adam v and m on the SSD tier, as
    bench/results/qwen2.5-14b-host128-ssd-two-runs-h100-cli ran it."""
    adapter = get_adapter(AutoConfig.from_pretrained(QWEN14))
    w = Workload((79, 79), 1024, device=device, compile=True, disk_states=("v", "m"))
    return make_plan(adapter, w, DEFAULTS, suggest=False, host_available=128 * GiB)


def record(step: int, s: float, **extra) -> dict:
    return {"step": step, "loss": 1.0, "step_time_s": s, **extra}


def test_silent_until_steady_then_once_and_only_when_off_the_plan():
    plan = ssd_plan()
    pred = plan.time["step_s"]
    check = PlanCheck(plan, first_step=0)
    assert check(record(1, pred * 3)) is None and check(record(2, pred * 3)) is None  # not steady yet
    assert check(record(3, pred * 1.1)) is None  # within 15%
    assert check(record(4, pred * 3)) is None  # said at most once, on the first steady step

    check = PlanCheck(plan, first_step=5)  # a resumed process: steady after its own first two steps
    assert check(record(7, pred / 1.36)) is None
    line = check(record(8, pred / 1.36, busy_compute=0.23, disk_gbps=1.53, disk_busy=0.96))
    ssd = plan.time["ssd"]
    assert line.startswith(f"plan check: step 8 took {pred / 1.36:.2f} s, the plan {pred:.2f} s (36% long; bound by")
    assert f"GPU idle {0.77 * pred / 1.36:.2f} s (planned {plan.time['gpu_idle_s']:.2f})" in line
    assert (f"the SSD tier's disk did 1.53 GB/s while busy (96% of the step) where the plan used read "
            f"{ssd['read_bps'] / 1e9:.2f}, write {ssd['write_bps'] / 1e9:.2f} GB/s") in line
    assert line.count("megatrain probe --disk") == 1 and "built-in H200 rates" in line
    assert check(record(9, pred * 3)) is None  # (two steady steps: too few for a median to name a stall)

    short = PlanCheck(plan, first_step=0)(record(3, pred * 1.5))
    assert "33% short" in short and "disk did" not in short  # no disk fields in the record: not claimed


def test_a_cpu_run_or_no_plan_is_never_checked():
    plan = ssd_plan("cpu")
    assert PlanCheck(plan, 0)(record(3, plan.time["step_s"] * 10)) is None
    assert PlanCheck(None, 0)(record(3, 1.0)) is None


def test_the_logger_shows_the_line_once(tmp_path):
    plan = ssd_plan()
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=5, stream=out)
    log.check = PlanCheck(plan, 0)
    for step in range(1, 6):
        log.log(record(step, plan.time["step_s"] * 2, tokens=161792, tokens_per_s=1.0, grad_norm=1.0, lr=1e-5))
    log.close()
    assert out.getvalue().count("plan check: step 3 took") == 1 and "(50% short;" in out.getvalue()


def test_a_stalled_step_is_named_once_with_its_idle_stretches():
    """Issue 36's run: steps of about 15 s and one of 26.2 s in which the GPU idled 11.7 s; it is named once the
    steady steps give a median, even when it was the first steady one, with its idle stretches; never twice."""
    gaps = [{"ms": 1900.0, "after": "forward layer 3", "before": "forward layer 4"},
            {"ms": 650.0, "after": "", "before": "embed"}]
    for plan in (None, ssd_plan(), ssd_plan("cpu")):
        check = PlanCheck(plan, first_step=0)
        first = STEADY_AFTER + 1
        times = [14.8, 16.1, 26.2, 15.1, 15.3, 40.0]
        said = []
        for i, t in enumerate(times):
            extra = dict(busy_compute=1 - 11.7 / 26.2, idle_gaps=gaps) if t == 26.2 else dict(busy_compute=0.97)
            line = check(record(first + i, t, **extra))
            said += [x for x in (line or "").splitlines() if x.startswith("slow step")]
        assert len(said) == 1, said  # once: the 40 s step later is not named
        median = sorted(times[:MEDIAN_OF])[MEDIAN_OF // 2]
        assert said[0].startswith(f"slow step: step {first + 2} took 26.20 s, {26.2 / median:.2f}x the median "
                                  f"{median:.2f} s of {MEDIAN_OF} steady steps; GPU idle 11.70 s")
        assert "longest idle stretches: 1.90 s (after forward layer 3 before forward layer 4), 0.65 s (before embed)" \
            in said[0]


def test_a_stall_names_the_optimizers_rate_in_it_against_the_median():
    """The CPU AdamW's rate in the slow step against the steady steps' median: whether the GPU waited for a slowed
    optimizer or for something else."""
    check = PlanCheck(None, first_step=0)
    rates = {3: 3.1, 4: 3.3, 5: 3.2, 6: 1.6}
    lines = [check(record(s, 20.0 if s == 6 else 15.0, optimizer_gparams_per_s=r)) for s, r in rates.items()]
    assert lines[:3] == [None] * 3
    assert lines[3].startswith("slow step: step 6 took 20.00 s") and \
        lines[3].endswith("; CPU AdamW 1.60 Gparam/s (median 3.15)")
    check = PlanCheck(None, first_step=0)  # no optimizer fields (a record of before, a GPU-only step): nothing said
    assert "AdamW" not in [check(record(s, 20.0 if s == 6 else 15.0)) for s in rates][3]


def test_steps_within_the_tolerance_or_before_steady_are_not_stalls():
    check = PlanCheck(None, first_step=0)
    assert all(check(record(s, 50.0 if s <= STEADY_AFTER else 10.0)) is None for s in range(1, 10))  # warm-up slow
    t = 10.0 * (1 + SLOW_STEP) * 0.99
    assert check(record(10, t)) is None and check(record(11, 10.0)) is None
    line = check(record(12, 10.0 * (1 + SLOW_STEP) * 1.01))  # just past: named, without stats it names no idle
    assert line.startswith("slow step: step 12 took") and "idle" not in line


def test_a_grpo_step_is_held_against_the_plan_by_its_parts():
    """A grpo step's record carries its rollout batch's sampling and log-prob passes on the batch's first step only:
    the training part (train_s) is held against the plan's training step, the rollout against the plan's rollout,
    and the steps that ran a rollout are not stalls for it."""
    plan = ssd_plan()
    train = plan.time["step_s"] * 0.95  # a GPU plan with a rollout phase (rollout_plan.py's keys that are read)
    plan.rollout = {"train_step_s": train, "rollout_s": 20.0, "mode": "resident", "decode_step_s": 0.0324}
    check = PlanCheck(plan, first_step=0)
    said = []
    for step in range(1, 11):  # a rollout batch of two optimizer steps: the rollout on the odd steps
        roll = 80.0 if step % 2 else 0.0  # 4x the plan's rollout, within the plan's training time
        line = check(record(step, train * 1.02 + roll, train_s=train * 1.02, rollout_s=roll,
                            rollout_tokens_per_s=3275.0, rollout_decode_step_median_s=0.145))
        said += (line or "").splitlines()
    assert said == [f"plan check: step 3's rollout took 80.00 s (3,275 tokens/s), the plan 20.00 s (75% short; "
                    f"resident, decode step 32.4 ms planned, 145.0 ms median measured)"], said

    # the parts before and at the start of sampling, where the record and the plan both have them
    plan.rollout.update(drain_s=2.3, setup_s=0.28, prefill_s=1.9)
    line = PlanCheck(plan, first_step=0)(record(3, train + 27.1, train_s=train, rollout_s=27.1,
                                                rollout_drain_s=4.1, rollout_setup_s=1.2, rollout_prefill_s=2.4))
    assert line.endswith("; the last step's updates 4.10 s (planned 2.30); the sampler's set-up 1.20 s (planned "
                         "0.28); prefill 2.40 s (planned 1.90)"), line

    check = PlanCheck(plan, first_step=0)
    line = check(record(3, train * 2 + 20.0, train_s=train * 2, rollout_s=20.0))
    assert line.startswith(f"plan check: step 3's training took {train * 2:.2f} s, the plan {train:.2f} s (50% short")
    assert "rollout" not in line  # within the plan's


def test_a_stall_names_an_optimizer_held_outside_its_work():
    """The optimizer's longest piece of work against what that piece takes at the step's rate (the records'
    optimizer_longest_s and optimizer_longest_usual_s): five times over and more than 0.1 s, the line says its
    threads were held; within that, nothing more is said."""
    check = PlanCheck(None, first_step=0)
    held = {"optimizer_longest_s": 0.56, "optimizer_longest_usual_s": 0.031}
    lines = [check(record(s, 18.0 if s == 6 else 15.0, optimizer_gparams_per_s=2.2,
                          **(held if s == 6 else {"optimizer_longest_s": 0.04, "optimizer_longest_usual_s": 0.03})))
             for s in range(3, 7)]
    assert lines[3].endswith("; the optimizer's longest piece of work took 0.56 s where its size takes 0.031 s: its "
                             "threads were held, not slowed (page faults waiting behind another process reading "
                             "this one's /proc/PID/smaps, memory reclaim)")
    check = PlanCheck(None, first_step=0)
    lines = [check(record(s, 18.0 if s == 6 else 15.0, optimizer_longest_s=0.09, optimizer_longest_usual_s=0.01))
             for s in range(3, 7)]
    assert lines[3].startswith("slow step: step 6") and "held" not in lines[3]


def test_the_pipelines_stats_name_its_longest_piece_of_work():
    """OptimizerPipeline.take_stats (the inline CPU path: one piece a unit) and optimizer_fields: the longest
    update and, from its size and the record's rate, what it usually takes."""
    from megatrain.models import get_adapter
    from megatrain.run.metrics import optimizer_fields
    from megatrain.runtime import CpuAdamW, HostStore
    from megatrain.runtime.optimizer_pipeline import OptimizerPipeline
    from megatrain.runtime.pinned import PinnedHost
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    store = HostStore(get_adapter(cfg), torch.float32)
    store.init_random(0, 0.02)
    pipe = OptimizerPipeline(store, CpuAdamW(), torch.device("cpu"), PinnedHost(cuda=False))
    pipe.begin_step(lr=None)
    for i, t in enumerate(store.tiles):
        pipe.put(i, torch.randn(t.numel), to_host=False)
    pipe.finish_step(lr=1e-3, clip_coef=1.0)
    stats = pipe.take_stats()
    sizes = [t.numel for t in store.tiles]
    assert stats["params"] == sum(sizes) and stats["longest_params"] in sizes
    assert 0 < stats["longest_s"] <= stats["update_s"]
    fields = optimizer_fields(stats)
    assert fields["optimizer_longest_s"] == stats["longest_s"]
    assert fields["optimizer_longest_usual_s"] == pytest.approx(stats["longest_params"] * stats["update_s"] /
                                                                stats["params"])
    assert pipe.take_stats()["longest_s"] == 0.0  # reset with the rest


def packed_plan():
    """Qwen2.5-7B cut to 6 layers, one packed row of 131,072 tokens a step, timed at the data's mean span of 30,000
    (estimate.retime_packed), and span -> the plan's time for a step of that span (estimate.packed_step_time)."""
    cfg = AutoConfig.from_pretrained(QWEN14.parent / "qwen2.5-7b")
    cfg.num_hidden_layers = 6
    adapter = get_adapter(cfg)
    plan = make_plan(adapter, Workload((1,), 131072, device="cuda", compile=True, packed=True), DEFAULTS,
                     suggest=False, host_available=512 * GiB)
    retime_packed(plan, adapter, 30000.0)
    return plan, packed_step_time(plan, adapter), adapter


def test_packed_steps_are_held_at_their_own_documents_span():
    """Packed rows: each step's documents set its attention work (11 to 29 s a step on one 524,288-token row of
    documents of 32k-98k tokens), so a step is held against the plan at its own span (the record's attn_len), and a
    step of long documents at the usual pace is no stall; a step slow for its documents is."""
    plan, expect, adapter = packed_plan()
    assert expect(30000.0) == pytest.approx(plan.time["step_s"], rel=0.01)  # the plan's own span: its own time
    short, long_ = expect(8000.0), expect(90000.0)
    assert short < plan.time["step_s"] / 1.2 and long_ > plan.time["step_s"] * 1.2  # the span matters this much
    assert expect(131072 * 4) == expect(131072.0)  # at most the row
    assert packed_step_time(ssd_plan(), adapter) is None  # unpacked rows: none

    check = PlanCheck(plan, 0, expect)  # a step of long documents at the plan's pace: no plan line
    assert check(record(3, long_ * 1.05, attn_len=90000.0)) is None
    line = PlanCheck(plan, 0)(record(3, long_ * 1.05, attn_len=90000.0))  # held against the one time: "off"
    assert line and "short" in line
    line = PlanCheck(plan, 0, expect)(record(3, long_ * 1.5, attn_len=90000.0))
    assert line.startswith(f"plan check: step 3 took {long_ * 1.5:.2f} s, the plan {long_:.2f} s for its documents' "
                           f"attention span of 90,000 tokens (33% short;")

    spans = [30000.0, 90000.0, 8000.0, 60000.0, 15000.0, 90000.0]
    check, said = PlanCheck(plan, 0, expect), []
    for i, span in enumerate(spans):  # every step at the plan's pace for its documents, the fifth 1.4x it
        t = expect(span) * (1.4 if i == 4 else 1.0)
        said += [x for x in (check(record(STEADY_AFTER + 1 + i, t, attn_len=span)) or "").splitlines()
                 if x.startswith("slow step")]
    assert len(said) == 1 and said[0].startswith(
        f"slow step: step {STEADY_AFTER + 5} took {expect(15000.0) * 1.4:.2f} s, 1.40x the {expect(15000.0):.2f} s "
        f"its documents take at the median pace of 5 steady steps"), said
    check, said = PlanCheck(plan, 0, expect), []  # at the plan's pace throughout: nothing, though the times vary 3x
    for i, span in enumerate(spans):
        said.append(check(record(STEADY_AFTER + 1 + i, expect(span), attn_len=span)))
    assert said == [None] * len(spans)
