"""Real interruptions, in a subprocess: `kill -9` in the middle of a save leaves the previous checkpoint valid and
`resume: auto` continues from it; SIGTERM finishes the step, saves, exits 0, and the resumed run is exact."""

import json
import os
import signal
import subprocess
import sys
import time

from megatrain.checkpoint import complete_checkpoints, verify_checkpoint
from test_checkpoint_helpers import losses, run, setup_run, unit_hashes

STEPS = 24


def start_training(cfg, delay: float) -> subprocess.Popen:
    # The test-only writer delay makes every save slow (and, through before_update, the training behind it).
    env = dict(os.environ, MEGATRAIN_TEST_SAVE_DELAY_S=str(delay), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "megatrain.cli", "train", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_until(cond, proc, timeout=60.0):
    t0 = time.time()
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"training ended early (rc {proc.returncode}): {proc.stderr.read()[-2000:]}")
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.01)


def logged_losses(out) -> dict[int, float]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return {}
    got = {}
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "loss" in r:
            got[r["step"]] = r["loss"]
    return got


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": STEPS}, checkpoint={"every": 2, "keep": 0})
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = start_training(cfg, delay=0.1)
    try:
        partial = ckpts / ".step-4.tmp"
        wait_until(lambda: (ckpts / "step-2" / "manifest.json").is_file() and partial.is_dir()
                   and any(partial.glob("unit-*.safetensors")), proc)
        proc.kill()  # SIGKILL: no handler runs, files are left as they are
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    killed = logged_losses(out)
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert [s for s, _ in complete_checkpoints(ckpts)] == [2]
    verify_checkpoint(ckpts / "step-2")  # every file matches its checksum

    summary = run(cfg, "resume=auto")
    assert summary["first_loss"] == killed[1]
    resumed = losses(out)  # no step twice
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert all(resumed[s] == v for s, v in killed.items())  # the steps re-done after the kill: the same numbers
    assert not partial.exists()  # the killed save's leftovers are cleared by the next save


def stopped_by(cfg, out, sig, reader_gone: bool = False) -> tuple[subprocess.Popen, str]:
    """A training run sent `sig` once it has logged 3 steps (reader_gone: its stdout and stderr closed first, as
    when `| tee` ends with the same Ctrl-C); (the process, ended, and its stderr)."""
    proc = start_training(cfg, delay=0.05)
    try:
        wait_until(lambda: len(logged_losses(out)) >= 3, proc)
        if reader_gone:
            proc.stderr.close()  # every later write to stderr is EPIPE
            proc.stdout.close()
            proc.send_signal(sig)
            proc.wait(timeout=60)
            return proc, ""
        proc.send_signal(sig)
        return proc, proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_saves_and_the_resumed_run_is_exact(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": STEPS, "precision": "bf16"}, checkpoint={"every": 2, "keep": 1})
    out = tmp_path / "run"
    proc, err = stopped_by(cfg, out, signal.SIGTERM)
    assert proc.returncode == 0, err[-2000:]
    stopped = max(logged_losses(out))
    assert stopped < STEPS
    ckpt = out / "checkpoints" / f"step-{stopped}"
    assert f"stopped by SIGTERM after step {stopped}: checkpoint saved to {ckpt}" in err
    assert "Traceback" not in err
    verify_checkpoint(ckpt)

    run(cfg, "resume=auto")
    reference = tmp_path / "reference"
    run(cfg, f"output.dir={reference}")
    assert losses(out) == losses(reference)
    assert unit_hashes(out / "checkpoints" / f"step-{STEPS}") == unit_hashes(reference / "checkpoints" / f"step-{STEPS}")


def test_ctrl_c_with_its_log_reader_gone_still_saves(tmp_path):
    """`megatrain train ... 2>&1 | tee log` and Ctrl-C: the terminal's SIGINT ends tee too, so the run's next log
    line meets a closed pipe; the run still finishes its step, saves and exits 0 (the line goes nowhere)."""
    cfg = setup_run(tmp_path, train={"steps": STEPS}, checkpoint={"every": 100, "at_end": True})
    out = tmp_path / "run"
    proc, _ = stopped_by(cfg, out, signal.SIGINT, reader_gone=True)
    assert proc.returncode == 0
    stopped = max(logged_losses(out))
    assert stopped < STEPS
    verify_checkpoint(out / "checkpoints" / f"step-{stopped}")


def test_sighup_stops_like_sigterm(tmp_path):
    """The terminal or the SSH session closed: the run saves and exits as on SIGTERM."""
    cfg = setup_run(tmp_path, train={"steps": STEPS}, checkpoint={"every": 100, "at_end": True})
    out = tmp_path / "run"
    proc, err = stopped_by(cfg, out, signal.SIGHUP)
    assert proc.returncode == 0, err[-2000:]
    stopped = max(logged_losses(out))
    assert f"stopped by SIGHUP after step {stopped}: checkpoint saved" in err
    verify_checkpoint(out / "checkpoints" / f"step-{stopped}")


def test_a_command_stopped_before_it_produced_anything_exits_non_zero(tmp_path):
    """`megatrain export ... && upload` must not go on after an interrupted export: 128 + the signal's number."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "megatrain.cli", "plan"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(0.3)  # importing torch
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err[-2000:]
