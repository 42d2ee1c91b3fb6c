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
    from megatrain.run.tune_first import layers_needed

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


def test_tune_first_compiles_what_the_run_runs_and_changes_nothing(tmp_path, monkeypatch):
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
    runs = {}
    try:
        for name, extra in (("tuned", ["engine.tune_first=true"]), ("plain", [])):
            torch._dynamo.reset()
            dyn.counters.clear()
            train(cfg_for(tmp_path / name, "engine.compile=on", *extra))
            runs[name] = dyn.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert seen["graphs"] > 0 and runs["tuned"] == seen["graphs"], (seen, runs)  # nothing compiled after the copy
    assert "on a 1-layer copy" in seen["message"]
    records = {n: [json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in runs}
    keys = ("loss", "grad_norm", "eval_loss")
    assert [[r.get(k) for k in keys] for r in records["tuned"]] == [[r.get(k) for k in keys] for r in records["plain"]]
    startup = next(r["startup_s"] for r in records["tuned"] if "startup_s" in r)
    assert list(startup)[1] == "kernels compiled and tuned first (a copy of the model with one layer of each kind)"
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
