"""The planner's SSD tier: host RAM without the states on disk (plus the tier's cache and staging buffer), the SSD's
bytes resident and moved per step, the disk's seconds and the step it sets, the search v -> v+m -> v+m+master when
host RAM is short, and `megatrain plan` naming it all. Qwen2.5-14B figures are derived here from its config.json
fields alone (not from the adapter), and checked against the planner's."""

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from megatrain.models import get_adapter
from megatrain.planner import Workload, make_plan
from megatrain.planner.memory import SSD_CACHE, SSD_STAGING, host_memory
from megatrain.planner.placement import FREE_ALL
from megatrain.planner.profile import DEFAULTS, GiB, from_dict
from megatrain.planner.report import render
from megatrain.runtime.schedule import Placement

QWEN14 = Path(__file__).resolve().parent.parent / "bench" / "model-configs" / "qwen2.5-14b"
PAGE = 4096


def page(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def qwen14_units() -> list[int]:
    """Parameters of each unit (embedding, 48 layers, final norm + LM head), from config.json's numbers."""
    c = json.loads((QWEN14 / "config.json").read_text())
    h, inter, heads, kv, V, L = (c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                 "num_key_value_heads", "vocab_size", "num_hidden_layers"))
    hd = h // heads
    layer = (h * h + h) + 2 * (h * kv * hd + kv * hd) + h * h + 3 * h * inter + 2 * h  # q, k, v (biases), o, MLP, norms
    return [V * h] + [layer] * L + [V * h + h]


@pytest.fixture(scope="module")
def qwen14():
    return get_adapter(AutoConfig.from_pretrained(QWEN14))


def test_qwen14_host_bytes_exclude_disk_states(qwen14):
    """v on disk, fp32 streaming: host holds master + m (4 B/param each, tiles padded to 2048 elements), the tier's
    cache (DEPTH + 2 = 4 slots of one 64 Mi-element landing piece, fp32) and one unit's staging buffer (the
    largest unit, the head: 152064 x 5120 + 5120 fp32); no Adam v."""
    numels = qwen14_units()
    units = qwen14.units()
    assert [u.numel for u in units] == numels and sum(numels) == 14_770_033_664
    padded = sum(-(-n // 2048) * 2048 for n in numels)
    w = Workload((158,), 1024, compile=True, disk_states=("v",),
                 placement=Placement(stream_dtype="fp32"))
    host = host_memory(units, w)
    assert "Adam v (fp32)" not in host
    assert host["fp32 master weights"] == host["Adam m (fp32)"] == 4 * padded
    assert host[SSD_CACHE] == 4 * 1 * (64 << 20) * 4 == 1 * GiB
    assert host[SSD_STAGING] == page(4 * (152064 * 5120 + 5120)) == 3_114_291_200  # the head: LM head + final norm
    assert "bf16 streaming copy (pinned)" not in host
    # every state on disk but the bf16 copy: 2 B/param of it, 3 kinds in the cache
    w3 = Workload((158,), 1024, compile=True, disk_states=("v", "m", "master"))
    h3 = host_memory(units, w3)
    assert not {"fp32 master weights", "Adam m (fp32)", "Adam v (fp32)"} & h3.keys()
    assert h3["bf16 streaming copy (pinned)"] == 2 * padded and h3[SSD_CACHE] == 3 * GiB


@pytest.mark.parametrize("clipping", [True, False])
def test_qwen14_ssd_bytes_time_and_bound(qwen14, clipping):
    """v on disk: the SSD holds, reads and writes each unit's v file (4 B/param, a page at most of rounding) every
    step; at DESIGN.md's 1.2 GB/s read and 1.6 GB/s write that is 86 s, far beyond the ~30 s of compute: the disk
    sets the step, which is the disk's time plus the compute it cannot overlap (the step outside the updates'
    window)."""
    files = sum(page(4 * n) for n in qwen14_units())
    assert 4 * 14_770_033_664 <= files < 4 * 14_770_033_664 + 50 * PAGE
    w = Workload((158,), 1024, compile=True, clipping=clipping, disk_states=("v",))
    p = make_plan(qwen14, w, DEFAULTS, suggest=False)
    ssd = p.ssd
    assert ssd["resident_bytes"] == ssd["read_bytes"] == ssd["write_bytes"] == files
    disk_s = files / 1.2e9 + files / 1.6e9
    assert ssd["disk_s"] == pytest.approx(disk_s) and 85 < disk_s < 87
    t = p.time
    assert t["bound"] == "SSD (optimizer states)"
    assert t["step_s"] == pytest.approx(disk_s + t["compute_s"] - t["optimizer_window_s"])
    assert t["compute_s"] < 40 and t["step_s"] > disk_s
    ram = make_plan(qwen14, Workload((158,), 1024, compile=True, clipping=clipping), DEFAULTS, suggest=False)
    assert not ram.ssd and ram.step_s < t["step_s"] / 2
    # a disk of 12 GB/s either way hides most of it: the step is the all-RAM one again, or close
    fast = from_dict({"disk": {"read_bps": 12e9, "write_bps": 12e9}}, "test")
    fast.layer_rates, fast.gpu_name, fast.gpu_total_bytes = DEFAULTS.layer_rates, DEFAULTS.gpu_name, \
        DEFAULTS.gpu_total_bytes
    pf = make_plan(qwen14, w, fast, suggest=False)
    assert pf.ssd["disk_s"] == pytest.approx(2 * files / 12e9)
    assert pf.step_s < 0.6 * t["step_s"]


@pytest.mark.parametrize("host_gib,states,stream", [(128, ("v",), "fp32"), (100, ("v", "m"), "bf16"),
                                                     (60, ("v", "m", "master"), "bf16")])
def test_search_moves_v_then_m_then_master(qwen14, host_gib, states, stream):
    """Qwen2.5-14B, 158 x 1024: all in RAM needs ~199 GiB (14 B/param + the runtime). With memory.disk_path the
    planner moves the fewest states that fit: at 128 GiB v (fp32 streaming: 8 B/param = 110 GiB), at 100 GiB v and
    m, at 60 GiB all three beside the bf16 copy (2 B/param = 27.5 GiB)."""
    w = Workload((158,), 1024, compile=True)
    gpu = float(DEFAULTS.gpu_total_bytes)
    none = make_plan(qwen14, w, DEFAULTS, host_available=host_gib * GiB, choose_keys=FREE_ALL, gpu_limit=gpu,
                     suggest=False)
    assert not none.fits and not none.workload.disk_states
    p = make_plan(qwen14, w, DEFAULTS, host_available=host_gib * GiB, choose_keys=FREE_ALL, gpu_limit=gpu,
                  disk_path="/ssd", suggest=False)
    assert p.fits and p.workload.disk_states == states and p.placement.stream_dtype == stream
    assert p.host_total <= host_gib * GiB and "SSD tier" in p.why
    text = render(p)
    assert "SSD tier (/ssd)" in text and f"{p.ssd['resident_bytes'] / GiB:.1f} GiB resident" in text
    assert "bound by SSD" in text
    js = p.as_json()
    assert js["disk_states"] == list(states) and js["ssd"]["read_gib_per_step"] == pytest.approx(
        p.ssd["read_bytes"] / GiB)


def test_ssd_space_is_checked(qwen14):
    w = Workload((158,), 1024, compile=True, disk_states=("v",))
    p = make_plan(qwen14, w, DEFAULTS, disk_path="/ssd", ssd_free=10 * GiB, suggest=False)
    assert any(x.startswith("SSD: the tier's files take 55.0 GiB, 10.0 GiB free") for x in p.problems)


def test_suggestion_names_disk_path(qwen14):
    """A run whose states do not fit host RAM (on the CPU, the quick case): the suggestions name memory.disk_path,
    with the states the planner would move, the SSD's bytes and the disk's time."""
    w = Workload((1,), 128, device="cpu", precision="fp32")
    need = make_plan(qwen14, w, DEFAULTS, suggest=False).host_total
    p = make_plan(qwen14, w, DEFAULTS, host_available=need - 2.0 * 14.77e9, suggest=True)
    assert not p.fits
    s = [x for x in p.suggestions if x.startswith("memory.disk_path=")]
    assert len(s) == 1 and "puts v there: 55 GiB on the SSD, 110 GiB read+written per step" in s[0], p.suggestions


def test_nothing_fits_says_what_the_host_would_have_to_hold(qwen14):
    """Every state on the SSD and still over the host budget: the refusal names the structure that needed the least
    host RAM and its largest parts (the bf16 copy the GPU streams from, which must stay in RAM)."""
    w = Workload((158,), 1024, compile=True)
    p = make_plan(qwen14, w, DEFAULTS, host_available=24 * GiB, choose_keys=FREE_ALL,
                  gpu_limit=float(DEFAULTS.gpu_total_bytes), disk_path="/ssd", suggest=False)
    assert not p.fits
    assert "nor with v, m and the master on the SSD tier (no placement fits" in p.why, p.why
    tail = p.why.split("nor with v, m and the master on the SSD tier")[1]
    assert "the least host RAM the search met is " in tail and "largest parts: bf16 streaming copy (pinned) 27.5 GiB" \
        in tail, tail
    least = float(tail.split("the least host RAM the search met is ")[1].split(" GiB")[0])
    assert 27.5 < least and least * GiB > 24 * GiB


def test_the_gpu_runs_of_the_ssd_tier_are_reproduced():
    """The SSD-tier runs on an H100 of nvidia-h200-x2 (bench/results/qwen2.5-14b-host128-ssd-two-runs-h100-cli,
    Qwen2.5-14B 158 x 1024 in
    128 GiB, Adam v and m on /var/tmp), re-planned from config.json with the disk and CPU AdamW rates each run
    measured at its start (bench/ssd_replan.py): the planner gives each run's own plan back, and run 1's steady step
    (the third: the second was the first optimizer pass, whose reads were holes) is within issue 16's 15% of it.
    Run 2's is not: its start-up measurement caught the disk at 1.38 / 1.17 GB/s where the step got 1.50 / 1.64,
    and its plan was 36% long (the measurement is now 8 GiB); no tolerance covers a wrong input."""
    import sys

    root = QWEN14.parent.parent.parent
    sys.path.insert(0, str(root / "bench"))
    from ssd_replan import replan, rerun_result

    d = root / "bench" / "results" / "qwen2.5-14b-host128-ssd-two-runs-h100-cli"
    first = replan(d / "result.json")
    like = json.loads((d / "result.json").read_text())
    second = replan(d / "qwen14b_ssd2_metrics.log",
                    rerun_result(like, d / "qwen14b_ssd2.log", d / "qwen14b_ssd2_metrics.log"), d / "qwen14b_ssd2.log")
    for rows, own in ((first, 161.09), (second, 210.51)):
        start = rows[0]
        assert start["step"] is None and start["run_plan_s"] == pytest.approx(own, abs=0.01)
        assert start["pred_s"] == pytest.approx(own, rel=0.01)  # the rates as printed (2 decimals) give it back
        assert [r["step"] for r in rows[1:]] == [2, 3] and rows[1]["first_pass"] and not rows[2]["first_pass"]
    assert first[0]["meas_s"] == pytest.approx(168.95, abs=0.01)  # the steady step alone
    assert abs(first[0]["pred_s"] / first[0]["meas_s"] - 1) <= 0.15
    assert second[0]["pred_s"] / second[0]["meas_s"] - 1 > 0.30  # the wrong disk rates at start, as reported


def test_the_ssd_run_planned_with_8_gib_measured_at_start_is_reproduced():
    """Session 31's SSD-tier run (bench/results/qwen2.5-14b-host128-ssd-h100-cli, the same 14B in 128 GiB on an
    H100 of
    nvidia-h200-x2, the disk measured over 8 GiB at start): re-planned from config.json with the rates it measured
    at its start, the planner gives its own plan back (171.5 s), and that plan is within issue 16's 15% of the mean
    of its steady steps (3 and 4: 179.1, 183.6 s). Its first optimizer pass (step 2) read nothing that was never
    written (the tier zero-fills those pieces)."""
    import sys

    root = QWEN14.parent.parent.parent
    sys.path.insert(0, str(root / "bench"))
    from ssd_replan import replan

    f = root / "bench" / "results" / "qwen2.5-14b-host128-ssd-h100-cli" / "result.json"
    rows = replan(f)
    start = rows[0]
    assert start["step"] is None and start["run_plan_s"] == pytest.approx(171.52, abs=0.01)
    assert start["pred_s"] == pytest.approx(171.52, rel=0.01)
    assert start["meas_s"] == pytest.approx((179.13 + 183.65) / 2, abs=0.01)
    assert abs(start["pred_s"] / start["meas_s"] - 1) <= 0.15
    steps = json.loads(f.read_text())["result"]["steps"]
    first_pass = next(s for s in steps if s.get("disk_write_gb"))
    assert first_pass["step"] == 2 and first_pass["disk_read_gb"] < 0.02 * first_pass["disk_write_gb"]


def test_suggestions_count_the_ssd_space_there_is(qwen14, monkeypatch):
    """With memory.disk_path set, a suggested change fits only with what that SSD holds: a run whose states exceed
    the host RAM and the SSD's free space together gets no suggestion that puts them on the SSD anyway, and no
    trial plans are made (their host need cannot go below the states the SSD cannot take)."""
    from megatrain.planner import suggest

    w = Workload((4,), 128, device="cpu")
    states = 12.0 * 14_770_033_664
    kw = dict(host_available=0.75 * states, disk_path="/ssd", choose_keys=FREE_ALL)
    roomy = make_plan(qwen14, w, DEFAULTS, ssd_free=2 * states, **kw, suggest=True)
    assert roomy.fits and roomy.workload.disk_states  # the SSD takes what host RAM cannot
    trials = []
    real = suggest.estimate
    monkeypatch.setattr(suggest, "estimate", lambda *a, **k: trials.append(1) or real(*a, **k))
    small = make_plan(qwen14, w, DEFAULTS, ssd_free=0.1 * states, **kw, suggest=True)
    assert not small.fits and any(x.startswith(("host RAM", "SSD")) for x in small.problems), small.problems
    assert trials == [] and len(small.suggestions) == 1, small.suggestions
    assert small.suggestions[0].startswith("nothing smaller fits") and "SSD" in small.suggestions[0]
