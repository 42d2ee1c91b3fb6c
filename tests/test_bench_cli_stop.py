"""bench/bench_cli.py stopped from outside (a call script's `timeout` sends SIGTERM) kills the run it launched and
every process under it at once: torchrun's ranks run in sessions of their own, out of reach of a process-group
signal, and a `megatrain train` given SIGTERM saves a checkpoint first, holding its GPU meanwhile (2026-11-27: a
Qwen2.5-32B run started after a timed-out 14B run found 16.6 of its H100's 80 GB free)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_cli import NodeMemory  # noqa: E402


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_stopped_benchmark_kills_the_whole_run(tmp_path):
    make_model_dir(tmp_path / "model", "llama")
    cmd = [sys.executable, "bench/bench_cli.py", "--model", str(tmp_path / "model"), "--device", "cpu", "--seq", "32",
           "--seqs", "4", "--micro", "2", "--steps", "1000", "--warmup", "1", "--nproc-per-node", "2",
           "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "r.json")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "work" / "cli.log"
    deadline = time.monotonic() + 240
    while not (log.is_file() and re.search(r"^step \d+/", log.read_text(), re.M)):  # the ranks train
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.5)
    tree = NodeMemory._tree(proc.pid)
    assert len(tree) >= 4, tree  # bench_cli, torchrun, two ranks (and maybe their helpers)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 124, out
    assert "the run (pid" in out and "were killed" in out
    time.sleep(1)
    assert not [p for p in tree if alive(p)], [Path(f"/proc/{p}/cmdline").read_text() for p in tree if alive(p)]
    assert not (tmp_path / "r.json").exists()  # no result for a run that was stopped
    assert os.path.isdir(tmp_path / "work")
