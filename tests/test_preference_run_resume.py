"""A dpo run killed with SIGKILL (a child process: no handler runs) and continued with resume=auto equals an
uninterrupted run, losses and final weights: killed during the reference pass, which then goes on from the parts it
stored; killed after a checkpoint, with the reference log-probs precomputed (the checkpoint names their file) or
streamed (the frozen copy rebuilt from the model's source, not from the checkpoint's weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megatrain.config import load_config
from preference_helpers import pair_config, records, step_losses
from test_checkpoint_helpers import unit_hashes
from test_resume_signals import wait_until

STEPS = 8


def train(cfg, *overrides: str) -> dict:
    from megatrain.run.trainer import train as run

    return run(load_config(cfg, list(overrides)))


def start(cfg, *overrides: str, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatrain.cli", "train", str(cfg), *overrides],
                            env=dict(os.environ, PYTHONUNBUFFERED="1", **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def kill_when(proc: subprocess.Popen, cond, timeout: float = 90.0) -> None:
    try:
        wait_until(cond, proc, timeout)
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


def same_steps(out, whole) -> None:
    """The run in `out` (killed and resumed) equals the one in `whole` (uninterrupted): every step's loss, the last
    evaluation, the final weights and optimizer states bit for bit."""
    assert step_losses(out) == step_losses(whole)
    evals = lambda o: [{k: v for k, v in r.items() if k != "step"} for r in records(o) if "eval_loss" in r]  # noqa
    assert evals(out)[-1] == evals(whole)[-1]
    assert unit_hashes(out / "checkpoints" / f"step-{STEPS}") == unit_hashes(whole / "checkpoints" / f"step-{STEPS}")


def test_kill_9_then_resume_equals_the_uninterrupted_run(tmp_path, capsys):
    """precompute: killed during the reference pass, then (resumed) after a checkpoint, then resumed to the end;
    stream: killed after a checkpoint, resumed to the end. Both equal one uninterrupted run (the two strategies
    give the same numbers: test_preference_run)."""
    cfg = pair_config(tmp_path, "dpo", train={"steps": STEPS, "eval_every": 4}, checkpoint={"every": 2, "keep": 0},
                      preference={"reference": "precompute"})
    whole = tmp_path / "whole"
    train(cfg, f"output.dir={whole}")

    out = tmp_path / "run"
    parts = lambda: list((out / "reference").glob("*.partial/part-*.safetensors"))  # noqa: E731
    kill_when(start(cfg, MEGATRAIN_TEST_REFERENCE_DELAY_S="0.3"), lambda: len(parts()) >= 2)
    scored = len(parts())
    assert scored >= 2 and not logged_steps(out) and not list((out / "reference").glob("*.safetensors"))

    after_checkpoint = lambda o: lambda: (o / "checkpoints" / "step-4" / "manifest.json").is_file() and \
        len(logged_steps(o)) >= 5  # noqa: E731
    proc = start(cfg, "resume=auto", MEGATRAIN_TEST_SAVE_DELAY_S="0.05")
    kill_when(proc, after_checkpoint(out))
    assert max(logged_steps(out)) < STEPS
    assert "scored by an interrupted pass" in proc.stderr.read()
    assert not list((out / "reference").glob("*.partial"))
    state = json.loads((out / "checkpoints" / "step-4" / "run_state.json").read_text())
    (table,) = (out / "reference").glob("*.safetensors")
    assert state["reference"] == {"strategy": "precompute", "file": table.name, "fingerprint": table.stem}
    train(cfg, "resume=auto")
    same_steps(out, whole)

    streamed = tmp_path / "streamed"
    kill_when(start(cfg, f"output.dir={streamed}", "preference.reference=stream", MEGATRAIN_TEST_SAVE_DELAY_S="0.05"),
              after_checkpoint(streamed))
    state = json.loads((streamed / "checkpoints" / "step-4" / "run_state.json").read_text())
    assert state["reference"]["strategy"] == "stream" and not (streamed / "reference").exists()
    train(cfg, f"output.dir={streamed}", "preference.reference=stream", "resume=auto")
    same_steps(streamed, whole)
