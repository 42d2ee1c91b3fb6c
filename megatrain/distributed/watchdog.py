"""No rank waits forever for a rank that is gone: failures are published, heartbeats are watched.

Every rank runs a `Watchdog` thread with its own connection to the rendezvous store (torchrun's). Each tick
(HEARTBEAT_S) it
    - bumps its heartbeat counter (hb/<rank>);
    - reads `failed`: the first failure any rank published (`publish_failure`, first writer wins). Another rank's
      failure ends this process at once: one line `megatrain: error: stopping: <that rank's message>` on stderr and
      exit status 1 (bad input, which its rank reported already: no line, exit status 2), whatever the main thread
      is blocked in (a collective, a wait for a shared-memory flag);
    - checks the processes of the ranks on its own node: one whose process is gone (kill -9, the OOM killer, a
      crash in native code) without having said it finished is published as dead, and this rank stops;
    - checks every rank's heartbeat: one that has not moved for `timeout` seconds (a stopped or hung process, a
      lost node) is published as not responding, and this rank stops.
A rank that finishes normally marks its heartbeat -1 first, so the others stop watching it. The store itself
unreachable for `timeout` seconds (node 0's torchrun is gone) also stops the rank.

The main thread publishes its own exceptions (`publish_failure`) before it exits; `Distributed.failed` turns a
communication error caused by another rank's failure into that rank's message. Collectives carry a timeout of
their own as well (the process groups'), for what none of this catches.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import NamedTuple

from .world import World

HEARTBEAT_S = 0.5
DONE = -1


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (torchrun reaps its workers, but not at once)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except PermissionError:
        return True
    return state not in ("Z", "X")


class Failure(NamedTuple):
    rank: int
    message: str  # "<rank description>: <what happened>"
    input_error: bool  # bad input (a MegatrainError): its rank printed it; the others leave without repeating it


def publish_failure(store, rank: int, message: str, input_error: bool = False) -> Failure:
    """Record this failure unless one is already recorded (first writer wins); returns the recorded one."""
    value = store.compare_set("failed", "", f"{rank}|{int(input_error)}|{message}").decode(errors="replace")
    return _parse(value)


def read_failure(store) -> Failure | None:
    """The run's recorded failure, or None."""
    if not store.check(["failed"]):
        return None
    return _parse(store.get("failed").decode(errors="replace"))


def _parse(value: str) -> Failure:
    rank, input_error, message = value.split("|", 2)
    return Failure(int(rank), message, input_error == "1")


def stop_process(message: str, quiet: bool = False) -> None:
    """Leave now, from any thread: the main thread may be blocked in a collective that will never return. quiet: a
    bad input that its rank has reported (exit status 2, as for bad input)."""
    try:
        if not quiet:
            os.write(2, f"megatrain: error: stopping: {message}\n".encode(errors="replace"))
    finally:
        os._exit(2 if quiet else 1)


class Watchdog:
    def __init__(self, store, world: World, timeout: float, interval: float = HEARTBEAT_S):
        """store: a connection of this thread's own (store clients are not shared between threads)."""
        self.store, self.world, self.timeout, self.interval = store, world, timeout, interval
        self.store.set(f"hb/{world.rank}", "0")
        self.store.set(f"pid/{world.rank}", f"{world.node}:{os.getpid()}:{socket.gethostname()}")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers: dict[int, int] = {}  # rank -> pid, the ranks of this node (read once every rank registered)
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (last counter seen, when it last moved)

    def start(self) -> None:
        """After every rank has registered (the process group's init is the rendezvous)."""
        for r in range(self.world.size):
            node, pid, host = self.store.get(f"pid/{r}").decode().split(":", 2)
            if int(node) == self.world.node and r != self.world.rank and host == socket.gethostname():
                self._peers[r] = int(pid)
        self._thread = threading.Thread(target=self._run, name="megatrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self, done: bool = False) -> None:
        """Stop the thread; done: this rank finished normally, and the others stop watching it."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            # until its store call returns: a daemon thread still inside one when the interpreter exits aborts the
            # process ("terminate called without an active exception"), and on a loaded machine a call can take
            # seconds
            self._thread.join(timeout=max(5 * self.interval + 1, self.timeout))
        if done:
            try:
                self.store.set(f"hb/{self.world.rank}", str(DONE))
            except Exception:  # the store may be gone at the very end of a run; nobody is watching then
                pass

    # ---- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        lost_since = None
        keys = [f"hb/{r}" for r in range(self.world.size)]
        while not self._stop.wait(self.interval):
            try:
                self.store.add(f"hb/{self.world.rank}", 1)
                beats = [int(v) for v in self.store.multi_get(keys)]
                failure = read_failure(self.store)
                lost_since = None
            except Exception as e:  # the store is unreachable
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > self.timeout:
                    stop_process(f"{self.world.describe()} lost the rendezvous store for {self.timeout:.0f} s "
                                 f"({type(e).__name__}: {e}); node 0's torchrun is gone?")
                continue
            if self._stop.is_set():
                return
            if failure is not None and failure.rank != self.world.rank:
                stop_process(failure.message, quiet=failure.input_error)
            self._check_peers(beats)
            self._check_beats(beats)

    def _check_peers(self, beats: list[int]) -> None:
        for r, pid in self._peers.items():
            if beats[r] != DONE and not _alive(pid):
                time.sleep(self.interval)  # it may have marked itself done (or published its error) as it exited
                if int(self.store.get(f"hb/{r}")) == DONE:
                    continue
                self._fail(f"rank {r} (process {pid} on {socket.gethostname()}) died without a word: killed by a "
                           f"signal, the out-of-memory killer, or a crash in native code")

    def _check_beats(self, beats: list[int]) -> None:
        now = time.monotonic()
        for r, b in enumerate(beats):
            if r == self.world.rank or b == DONE:
                continue
            last, since = self._beats.get(r, (None, now))
            if b != last:
                self._beats[r] = (b, now)
            elif now - since > self.timeout:
                self._fail(f"rank {r} has not responded for {now - since:.0f} s (its process is stopped, hung in "
                           f"native code, or its node is lost); MEGATRAIN_HEARTBEAT_TIMEOUT_S={self.timeout:.0f}")

    def _fail(self, message: str) -> None:
        first = publish_failure(self.store, self.world.rank, message)
        stop_process(first.message, quiet=first.input_error)


def heartbeat_timeout() -> float:
    try:
        return float(os.environ.get("MEGATRAIN_HEARTBEAT_TIMEOUT_S", "30"))
    except ValueError:
        print("megatrain: MEGATRAIN_HEARTBEAT_TIMEOUT_S is not a number; using 30", file=sys.stderr)
        return 30.0
