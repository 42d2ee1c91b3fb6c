"""Launching real torchrun runs from the distributed tests (no tests here): one node of N processes, or two
"nodes" on this machine (two torchrun processes with a static rendezvous on localhost), and finding their workers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra) -> dict:
    """The workers' environment: the repository first on PYTHONPATH, ahead of what was there (the GPU machines put
    the carried wheels there: replacing it hid pydantic from the workers)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    e = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    e.update({k: str(v) for k, v in extra.items()})
    return e


def torchrun(cfg: Path, *overrides: str, nproc: int = 2, nnodes: int = 1, extra_env: dict | None = None
             ) -> list[subprocess.Popen]:
    """Start `torchrun ... -m megatrain train cfg overrides` (one torchrun per node); returns the torchruns."""
    port = free_port()
    procs = []
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}",
               f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "megatrain",
               "train", str(cfg), *overrides]
        procs.append(subprocess.Popen(cmd, env=env(**(extra_env or {})), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, cwd=str(ROOT)))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 600) -> list[tuple[int, str]]:
    """Wait for every torchrun; (exit status, output) of each. Kills what is left on a timeout."""
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        kill_all(procs)
    return out


def run_ok(cfg: Path, *overrides: str, nproc: int = 2, nnodes: int = 1) -> str:
    results = finish(torchrun(cfg, *overrides, nproc=nproc, nnodes=nnodes))
    for rc, text in results:
        assert rc == 0, failure_text(text)
    return results[0][1]


def failure_text(text: str, tail: int = 4000) -> str:
    """A failed run's output for the assertion: its end, and where a rank crashed (faulthandler's "Fatal Python
    error" with the threads' stacks, which the module list it ends with pushes out of the tail)."""
    crash = text.find("Fatal Python error")
    if crash < 0 or crash >= len(text) - tail:
        return text[-tail:]
    return text[crash: crash + 3000] + "\n[...]\n" + text[-tail:]


class Worker:
    """A torchrun worker (not our child: signals and /proc, no exit status)."""

    def __init__(self, pid: int):
        self.pid = pid

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def terminate(self) -> None:
        os.kill(self.pid, signal.SIGTERM)

    def suspend(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def alive(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (FileNotFoundError, ProcessLookupError):
            return False

    def wait(self, timeout: float) -> None:
        t0 = time.monotonic()
        while self.alive():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"process {self.pid} still running after {timeout} s")
            time.sleep(0.05)


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def workers(procs: list[subprocess.Popen]) -> dict[int, Worker]:
    """Global rank -> worker process of these torchruns (their children running megatrain)."""
    found = {}
    for p in procs:
        for c in children(p.pid):
            try:
                env = dict(kv.split("=", 1) for kv in Path(f"/proc/{c}/environ").read_text().split("\0") if "=" in kv)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            if "RANK" in env:
                found[int(env["RANK"])] = Worker(c)
    return found


def wait_for(cond, procs, timeout: float = 120.0, what: str = "") -> None:
    t0 = time.time()
    while not cond():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a torchrun ended early ({what}): {dead[0].communicate()[0][-3000:]}")
        assert time.time() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.05)


def kill_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            for c in children(p.pid):
                try:
                    os.kill(c, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.kill()
            p.wait()
