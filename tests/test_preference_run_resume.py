"""A dpo run killed with SIGKILL (a child process: no handler runs) and continued with resume=auto equals an
uninterrupted run, losses and final weights: killed after a checkpoint, with the reference log-probs precomputed
(the checkpoint names their file) or streamed (the frozen copy rebuilt from the model's source, not from the
checkpoint's weights); and killed during the reference pass, which then goes on from the parts it stored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from megatrain.config import load_config
from preference_helpers import pair_config, records, step_losses
from test_checkpoint_helpers import unit_hashes

STEPS = 8


def train(cfg, *overrides: str) -> dict:
    from megatrain.run.trainer import train as run

    return run(load_config(cfg, list(overrides)))


def start(cfg, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatrain.cli", "train", str(cfg)],
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_when(proc: subprocess.Popen, cond, timeout: float = 90.0) -> None:
    try:
        t0 = time.time()
        while not cond():
            if proc.poll() is not None:
                raise AssertionError(f"training ended early (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
            assert time.time() - t0 < timeout, "timed out"
            time.sleep(0.01)
        proc.kill()  # SIGKILL
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()


def logged_steps(out) -> set[int]:
    path = out / "metrics.jsonl"
    got = set()
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in r:
            got.add(r["step"])
    return got


def same_run(tmp_path, cfg) -> None:
    """The killed and resumed run in tmp/run equals one run uninterrupted in tmp/whole."""
    train(cfg, f"output.dir={tmp_path / 'whole'}")
    out, whole = tmp_path / "run", tmp_path / "whole"
    assert step_losses(out) == step_losses(whole)
    evals = lambda o: [r for r in records(o) if "eval_loss" in r]  # noqa: E731
    assert evals(out)[-1] == evals(whole)[-1]
    assert unit_hashes(out / "checkpoints" / f"step-{STEPS}") == unit_hashes(whole / "checkpoints" / f"step-{STEPS}")


@pytest.mark.parametrize("reference", ["precompute", "stream"])
def test_kill_9_after_a_checkpoint_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    cfg = pair_config(tmp_path, "dpo", train={"steps": STEPS, "eval_every": 4}, checkpoint={"every": 2, "keep": 0},
                      preference={"reference": reference})
    out = tmp_path / "run"
    proc = start(cfg, MEGATRAIN_TEST_SAVE_DELAY_S="0.05")
    kill_when(proc, lambda: (out / "checkpoints" / "step-4" / "manifest.json").is_file() and
              len(logged_steps(out)) >= 5)
    assert max(logged_steps(out)) < STEPS
    summary = train(cfg, "resume=auto")
    assert summary["checkpoint"].endswith(f"step-{STEPS}")
    state = json.loads((out / "checkpoints" / "step-4" / "run_state.json").read_text())
    assert state["reference"]["strategy"] == reference
    if reference == "precompute":  # the checkpoint names the table it was trained against
        (table,) = (out / "reference").glob("*.safetensors")
        assert state["reference"]["file"] == table.name
    same_run(tmp_path, cfg)


def test_kill_9_during_the_reference_pass_then_resume_goes_on_from_its_parts(tmp_path, capsys):
    cfg = pair_config(tmp_path, "dpo", train={"steps": STEPS, "eval_every": 4}, checkpoint={"every": 4, "keep": 0},
                      preference={"reference": "precompute"})
    out = tmp_path / "run"
    proc = start(cfg, MEGATRAIN_TEST_REFERENCE_DELAY_S="0.3")
    parts = lambda: list((out / "reference").glob("*.partial/part-*.safetensors"))  # noqa: E731
    kill_when(proc, lambda: len(parts()) >= 2)
    scored = len(parts())
    assert not logged_steps(out) and not list((out / "reference").glob("*.safetensors"))
    train(cfg, "resume=auto")
    err = capsys.readouterr().err
    assert "scored by an interrupted pass" in err, err[-2000:]
    assert scored >= 2 and not list((out / "reference").glob("*.partial"))
    same_run(tmp_path, cfg)
