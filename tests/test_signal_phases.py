"""SIGTERM and SIGINT in every phase of a run (issue 33): start-up, the step-0 evaluation, a save, the export. Each
ends cleanly, keeps what a completed step saved, and says what it did on one line; a second signal while the
optimizer waits on a save stops at once without a traceback. (The stop after a step, and kill -9 during a save:
test_resume_signals.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain.checkpoint import complete_checkpoints, verify_checkpoint
from test_checkpoint_helpers import run, setup_run
from test_resume_signals import wait_until

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "megatrain" / "defaults" / "default.yaml"


def start(*argv, delay: float = 0.0) -> subprocess.Popen:
    env = dict(os.environ, MEGATRAIN_TEST_SAVE_DELAY_S=str(delay), PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "megatrain.cli", "train", *map(str, argv)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc) -> str:
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in err, err[-3000:]
    return err


def last_line(err: str) -> str:
    return [line for line in err.splitlines() if line.strip()][-1]


def test_sigterm_during_start_up_writes_nothing(tmp_path):
    """The demo's start-up (imports, checks, tokenising, the plan's CPU measurement) takes seconds: a SIGTERM in it
    used to kill the process without a word."""
    out = tmp_path / "out"
    proc = start(DEMO, f"output.dir={out}")
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]  # nothing produced: a failure's status
    assert last_line(err) == "megatrain: stopped by SIGTERM during start-up, before anything was written", err
    assert not out.exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_the_step_0_evaluation(tmp_path, sig):
    """The demo evaluates (held-out loss, greedy exact match) before step 1: a SIGTERM there killed the run
    silently. The evaluation ends at its next batch, its partial numbers are not logged, and the run says that no
    step was trained and nothing saved."""
    out = tmp_path / "out"
    proc = start(DEMO, f"output.dir={out}", "train.steps=5", "checkpoint.every=1")
    wait_until(lambda: (out / "metrics.jsonl").exists(), proc, timeout=120)  # opened just before the evaluation
    proc.send_signal(sig)
    err = finish(proc)
    name = signal.Signals(sig).name
    assert proc.returncode == 0, err[-2000:]
    assert f"evaluation at step 0 cut short by {name}: not logged" in err
    assert last_line(err) == f"stopped by {name} before step 1: no step trained, nothing saved", err
    assert "eval_loss" not in (out / "metrics.jsonl").read_text()
    assert not complete_checkpoints(out / "checkpoints")


@pytest.mark.parametrize("gap", [0.3, 1.0])
def test_a_second_sigterm_while_the_optimizer_waits_on_a_save(tmp_path, gap):
    """The first SIGTERM during the save of step 2 (slowed down, so that the next step's optimizer waits on it);
    the second `gap` seconds later stopped the run with the optimizer's traceback. It now stops at once on one
    line: the save in progress abandoned, the last complete checkpoint kept and valid."""
    cfg = setup_run(tmp_path, train={"steps": 24}, checkpoint={"every": 2, "keep": 0})
    ckpts = tmp_path / "run" / "checkpoints"
    proc = start(cfg, delay=0.5)
    wait_until(lambda: any(ckpts.glob(".step-2.tmp/unit-*")), proc, timeout=120)
    proc.send_signal(signal.SIGTERM)
    time.sleep(gap)
    proc.send_signal(signal.SIGTERM)
    err = finish(proc)
    assert proc.returncode == 130, err[-2000:]
    line = last_line(err)
    assert line.startswith("megatrain: stopped at once by a second SIGTERM: a save in progress was abandoned; "), err
    done = complete_checkpoints(ckpts)
    for _, p in done:
        verify_checkpoint(p)
    if done:
        assert f"the last checkpoint, {done[-1][1]}, stays" in line, line


def test_sigterm_during_the_export_keeps_the_checkpoint(tmp_path, monkeypatch, capsys):
    """export.at_end: a signal during the export stops it (its checkpoint is complete: nothing is lost) and says
    how to write the model from the checkpoint."""
    import megatrain.checkpoint.export as export_mod

    cfg = setup_run(tmp_path, train={"steps": 2})
    real = export_mod.export_store

    def interrupted(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises before this ends)
        return real(*a, **kw)

    monkeypatch.setattr(export_mod, "export_store", interrupted)
    summary = run(cfg, "export.at_end=true")
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    assert summary["stopped_during"] == "export" and summary["checkpoint"] == str(ckpt)
    verify_checkpoint(ckpt)
    assert not (tmp_path / "run" / "export").exists()
    assert f"export stopped by SIGTERM: the checkpoint {ckpt} is complete; `megatrain export {ckpt} " \
           in capsys.readouterr().err


def test_a_stop_in_the_runs_own_start_up_exits_as_one_before_it(tmp_path, monkeypatch):
    """A signal at start-up is caught by the command line or, once the run's handler is in, by the run: either way
    nothing was produced, and the status says so (128 + the signal's number)."""
    import megatrain.run.trainer as trainer
    from megatrain.cli import main

    def stopped(*a, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # (the handler raises before this ends)

    monkeypatch.setattr(trainer, "prepare", stopped)
    assert main(["train", str(DEMO), f"output.dir={tmp_path / 'out'}"]) == 128 + signal.SIGTERM
    assert not (tmp_path / "out").exists()
