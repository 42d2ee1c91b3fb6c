"""engine.tune_first: the layers' kernels are compiled (and on CUDA tuned) on a copy of the model with one layer of
each kind, before the host store exists; the run then compiles nothing again for those shapes and trains exactly
as without it."""

import json

import pytest
import torch

from megatrain.config import load_config
from megatrain.errors import MegatrainError


def cfg_for(out, *overrides):
    return load_config(None, [f"output.dir={out}", "train.steps=2", "train.eval_every=0",
                              "train.exact_match_path=", *overrides])


def test_the_copy_has_one_layer_of_each_kind():
    from megatrain.planner.tune_copy import layers_needed

    assert layers_needed(["full"] * 32) == 1
    assert layers_needed(["full", "sliding"] * 4) == 2
    assert layers_needed(["sliding"] * 5 + ["full"] + ["sliding"] * 5) == 6


def test_the_first_step_is_drawn_and_put_back(tmp_path):
    """The loader is where it was after the first step was drawn for tuning: the run's first step is the same; after
    a resume, the step resumed from."""
    from megatrain.run.prepare import check_inputs
    from megatrain.run.tune_first import first_step

    loader = check_inputs(cfg_for(tmp_path / "run")).loader
    state = loader.state_dict()
    peeked = first_step(loader)
    assert loader.state_dict() == state
    drawn = loader.next_step()
    assert [torch.equal(m.input_ids, b["input_ids"]) for m, b in zip(peeked, drawn)] == [True] * len(drawn)
    later = loader.state_dict()  # after one step: as a checkpoint would hold it
    second = loader.next_step()
    loader.load_state_dict(state)
    resumed = first_step(loader, later)
    assert [torch.equal(m.input_ids, b["input_ids"]) for m, b in zip(resumed, second)] == [True] * len(second)
    assert loader.state_dict() == later


def test_tune_first_compiles_what_the_run_runs_and_changes_nothing(tmp_path, monkeypatch, capsys):
    """With engine.compile: on (CPU here), the copy compiles every graph the run's first step and its evaluations
    need; the run compiles none after it, and its losses, grad norms, evaluations and checkpoint equal those of the
    same run without tune_first, bit for bit (the copy's weights and tokens come from generators of its own)."""
    import torch._dynamo.utils as dyn
    from safetensors.torch import load_file

    import megatrain.run.tune_first as tf
    from megatrain.run.trainer import train

    seen = {}
    tune = tf.tune_first

    def counted(*args, **kwargs):
        seen["message"] = tune(*args, **kwargs)
        seen["graphs"] = dyn.counters["stats"]["unique_graphs"]
        return seen["message"]

    monkeypatch.setattr(tf, "tune_first", counted)
    runs, logs = {}, {}
    try:
        for name, extra in (("tuned", ["engine.tune_first=true"]), ("plain", [])):
            torch._dynamo.reset()
            dyn.counters.clear()
            capsys.readouterr()
            train(cfg_for(tmp_path / name, "engine.compile=on", *extra))
            runs[name] = dyn.counters["stats"]["unique_graphs"]
            out = capsys.readouterr()
            logs[name] = out.out + out.err
    finally:
        torch._dynamo.reset()
    assert seen["graphs"] > 0 and runs["tuned"] == seen["graphs"], (seen, runs)  # nothing compiled after the copy
    assert "on a 1-layer copy" in seen["message"]
    # the start summary says what was compiled first, instead of "the first step compiles the layers"
    assert f"the layers' kernels compiled and tuned first: {seen['message']}" in logs["tuned"]
    assert "the first step compiles the layers" in logs["plain"]
    records = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    keys = ("loss", "grad_norm", "eval_loss")
    assert [[r.get(k) for k in keys] for r in records["tuned"]] == [[r.get(k) for k in keys] for r in records["plain"]]
    startup = next(r["startup_s"] for r in records["tuned"] if "startup_s" in r)
    assert list(startup)[1] == "kernels compiled and tuned first (a copy of the model with one layer of each kind)"
    assert list(startup)[-1] == "garbage collected and frozen before step 1"  # (run/collector.py)
    files = sorted(p.relative_to(tmp_path / "tuned") for p in (tmp_path / "tuned").rglob("*.safetensors"))
    assert files
    for f in files:
        a, b = load_file(tmp_path / "tuned" / f), load_file(tmp_path / "plain" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_tune_first_without_compiled_layers_is_refused(tmp_path):
    from megatrain.run.prepare import check_inputs

    with pytest.raises(MegatrainError, match="engine.tune_first: the layers are not compiled on cpu"):
        check_inputs(cfg_for(tmp_path / "run", "engine.tune_first=true"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("setting,device,compile_,ranks,expected", [
    ("auto", "cuda", "auto", 1, True),  # the default: compiled on CUDA, one process
    ("auto", "cuda", "off", 1, False),  # nothing compiled: nothing to tune
    ("auto", "cuda", "auto", 2, False),  # torchrun: each rank would build a copy
    ("auto", "cpu", "on", 1, False),  # CPU: Inductor's autotuning makes no page-locked copies
    ("on", "cpu", "on", 1, True),
    ("off", "cuda", "auto", 1, False),
])
def test_auto_tunes_first_where_the_autotuner_pins_host_memory(tmp_path, setting, device, compile_, ranks, expected):
    from megatrain.planner.workload import tunes_first, workload_from_config

    cfg = cfg_for(tmp_path, f"engine.tune_first={setting}", f"engine.compile={compile_}")
    assert tunes_first(cfg.engine, device, ranks > 1) is expected
    assert workload_from_config(cfg, device, distributed=ranks > 1).tune_first is expected


def test_yaml_booleans_read_as_on_and_off(tmp_path):
    assert cfg_for(tmp_path).engine.tune_first == "auto"
    assert cfg_for(tmp_path, "engine.tune_first=true").engine.tune_first == "on"
    assert cfg_for(tmp_path, "engine.tune_first=false").engine.tune_first == "off"
    with pytest.raises(MegatrainError, match="engine.tune_first"):
        cfg_for(tmp_path, "engine.tune_first=sometimes")


def test_the_plan_leaves_the_autotuning_copies_off_the_peak_when_tuned_first(tmp_path):
    """bench/results/qwen2.5-7b-158x1024-tune-first-h100x2-cli: Qwen2.5-7B, 158 x 1024, fp32 streaming, a cold
    Inductor cache. Without
    tune_first the first step pinned a 4 GiB block on top of the store (91.23 GiB peak, planned 91.37); with it the
    peak was 87.41 GiB. The plan of each: the same components, less the 4 GiB block when tuned first. (Host RAM
    that holds the run but not its store and the copy's phase at once, as in those runs: one after the other.)"""
    from pathlib import Path

    from megatrain.models import get_adapter, load_hf_config
    from megatrain.planner.memory import AUTOTUNE
    from megatrain.planner.plan import plan_for_config
    from megatrain.planner.world import World

    GiB = 2**30
    model = Path(__file__).resolve().parents[1] / "bench" / "model-configs" / "qwen2.5-7b"
    adapter = get_adapter(load_hf_config(str(model)))
    common = [f"model.path={model}", "train.device=cuda", "train.micro_batch_size=79", "train.grad_accum_steps=2",
              "data.max_seq_len=1024", "memory.stream_dtype=fp32", "memory.host_budget_gb=95",
              "memory.gpu_budget_gb=78"]
    tuned = plan_for_config(cfg_for(tmp_path, *common), adapter, "cuda")
    cold = plan_for_config(cfg_for(tmp_path, *common, "engine.tune_first=off"), adapter, "cuda")
    ranks = plan_for_config(cfg_for(tmp_path, *common), adapter, "cuda", world=World(ranks_per_node=2))
    assert AUTOTUNE not in tuned.host and cold.host[AUTOTUNE] == 4 * GiB
    assert AUTOTUNE + " x 2 ranks" in ranks.host  # torchrun: no copy first, each rank's first step pins its own
    assert tuned.host_total == pytest.approx(cold.host_total - 4 * GiB)
    assert abs(cold.host_total / GiB / 91.23 - 1) < 0.01  # measured cold (x2-h100-c)
    assert abs(tuned.host_total / GiB / 87.41 - 1) < 0.01  # measured tuned first
    assert any("engine.tune_first" in n and "4.00 GiB" in n for n in tuned.notes)


def test_the_plan_counts_the_copy_phase_and_takes_it_where_it_is_the_peak():
    """The copy's phase (planner/tune_copy.py) is counted as memory.host_memory counts a run, over the copy
    run/tune_first.py builds: its store is the truncated model's without Adam m and v (its optimizer updates nothing),
    byte for byte. Qwen2.5-7B: 1 layer, 11 GiB, below
    the run's 87 GiB. A 2-layer model at 80,896 tokens per micro-batch: the autotuner's block (64 MiB) outweighs the
    layer the copy leaves out, so the copy's phase is the plan's host peak."""
    from pathlib import Path

    from conftest import tiny_hf_config

    from megatrain.models import get_adapter, load_hf_config
    from megatrain.planner.memory import AUTOTUNE, MASTER, STATE_NAMES, TUNE_COPY, host_memory
    from megatrain.planner.plan import make_plan
    from megatrain.planner.profile import load_profile
    from megatrain.planner.tune_copy import copy_host, truncated_config
    from megatrain.planner.workload import Workload
    from megatrain.runtime import HostStore, Placement
    from megatrain.runtime.store import store_dtypes

    GiB = 2**30
    prof = load_profile(None)
    tiny = get_adapter(tiny_hf_config("llama", layers=2))
    w = Workload((79, 79), 1024, compile=True, tune_first=True)
    layers, phase = copy_host(tiny, w)
    store = HostStore(get_adapter(truncated_config(tiny.hf_config, layers)), *store_dtypes("bf16", "bf16"),
                      adam_states=False)
    assert layers == 1 and phase[AUTOTUNE] > 0
    assert STATE_NAMES["m"] not in phase and STATE_NAMES["v"] not in phase
    assert phase[MASTER] + phase["bf16 streaming copy (pinned)"] == store.host_bytes()
    plan = make_plan(tiny, w, prof, suggest=False)
    run_peak = sum(host_memory(tiny.units(), w, tiny.tied).values())
    assert plan.host[TUNE_COPY] > 0 and plan.host_total == pytest.approx(sum(phase.values()))
    assert plan.host_total > run_peak and any("with 1 layer" in n for n in plan.notes)

    qwen = get_adapter(load_hf_config(str(Path(__file__).resolve().parents[1] / "bench" / "model-configs" /
                                          "qwen2.5-7b")))
    w7 = Workload((79, 79), 1024, compile=True, tune_first=True, placement=Placement(stream_dtype="fp32"))
    layers, phase = copy_host(qwen, w7)
    copy_params = sum(u.numel for u in qwen.units()) - 27 * qwen.units()[1].numel  # embedding, head, one layer
    assert layers == 1 and phase[AUTOTUNE] == 4 * GiB
    assert phase[MASTER] == pytest.approx(4 * copy_params, rel=1e-3) and STATE_NAMES["m"] not in phase
    plan7 = make_plan(qwen, w7, prof, suggest=False)
    assert TUNE_COPY not in plan7.host and 11 * GiB < sum(phase.values()) < 12 * GiB < plan7.host_total
