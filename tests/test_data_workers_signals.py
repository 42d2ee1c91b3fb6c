"""Tokenising on several processes, stopped: a SIGTERM to the process group is the run's one line, no worker's
traceback, and no process left; a run killed with SIGKILL takes its workers with it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "megatrain" / "defaults"


def start(tmp_path) -> subprocess.Popen:
    words = " ".join(f"word{i}" for i in range(60))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"{k} {words}"}) + "\n" for k in range(60_000)))
    args = [sys.executable, "-m", "megatrain.cli", "data", f"model.path={DEMO / 'tiny-llama'}",
            f"data.path={tmp_path / 'd.jsonl'}", "data.num_proc=2", "data.max_seq_len=64", f"data.cache_dir={tmp_path / 'cache'}"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", HF_DATASETS_DISABLE_PROGRESS_BARS="0"))


def tokenising(proc: subprocess.Popen) -> str:
    """stderr up to the bar of the map's processes."""
    seen = ""
    t0 = time.time()
    while "num_proc=2" not in seen:
        ch = proc.stderr.read(1)
        assert ch and time.time() - t0 < 120, seen
        seen += ch
    time.sleep(0.5)
    return seen


def gone(pgid: int, timeout: float = 20.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_group_while_workers_tokenise(tmp_path, sig):
    proc = start(tmp_path)
    try:
        tokenising(proc)
        os.killpg(proc.pid, sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 128 + sig, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
        assert f"stopped by {signal.Signals(sig).name}" in err.strip().splitlines()[-1]
        assert gone(proc.pid)
    finally:
        if not gone(proc.pid, 0.1):
            os.killpg(proc.pid, signal.SIGKILL)


def test_workers_end_with_a_killed_run(tmp_path):
    proc = start(tmp_path)
    try:
        tokenising(proc)
        proc.kill()  # the run alone: its workers are left without it
        proc.wait()
        assert gone(proc.pid)
    finally:
        if not gone(proc.pid, 0.1):
            os.killpg(proc.pid, signal.SIGKILL)
