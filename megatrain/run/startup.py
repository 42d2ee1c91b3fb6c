"""Start-up phases that run at once (run/prepare.py): the host store's allocation and fill beside the compiling and
tuning of the layers' kernels on a copy of the model (`engine.tune_first`, run/tune_first.py).

The two need nothing of each other: the store needs the model's config and the plan's placement; the copy compiles
on the GPU and its own small store. The copy's phase was put before the store so that the autotuner's page-locked
copies never sit on top of the whole store (run/tune_first.py); they do here, so it runs beside the store only when
the plan says host RAM holds both: the store's states and the copy's phase (planner/tune_copy.py) within what
is available (overlap_fits). Otherwise the phases run one after the other, as before.

The store's work is torch's (allocation, page faults, normal_, casts: the GIL is released); the compiling holds the
GIL most of the time. A run of several processes never tunes first (planner/workload.py, tunes_first): its start-up
is unchanged.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

GiB = 2**30


def overlap_fits(plan, adapter) -> bool:
    """The plan says host RAM holds the store and the copy's phase at once (planner/tune_copy.py, beside_store: the
    plan counts that peak). None plan: no."""
    if plan is None:
        return False
    from ..planner.tune_copy import beside_store, copy_host

    return beside_store(plan.host, copy_host(adapter, plan.workload)[1], plan.host_available)


def beside_threads() -> int:
    """Threads of a random init beside the compiling (half the cores): the compiling's thread and its compile workers
    keep the other half, and the fill, bound by memory bandwidth, is barely slower on half the cores
    (docs/memory-and-placement.md)."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


class Beside:
    """`work` on a thread of its own, its phases timed there: `laps` (name, seconds) in order. `result()` waits for
    it and returns its value or raises what it raised. A thread, not a process: the store is this process's memory."""

    def __init__(self, work: Callable[[Callable[[str], None]], Any], name: str = "megatrain-startup"):
        self.laps: list[tuple[str, float]] = []
        self._t = time.perf_counter()
        self._value, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(work,), name=name, daemon=True)
        self._thread.start()

    def _lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps.append((phase, now - self._t))
        self._t = now

    def _run(self, work) -> None:
        try:
            self._value = work(self._lap)
        except BaseException as e:  # raised again on the caller's thread by result()
            self._error = e

    def result(self) -> Any:
        """Wait for the work (a signal's Stopped, raised on the main thread meanwhile, waits here too: the caller
        then closes what it built)."""
        while self._thread.is_alive():
            self._thread.join(0.1)  # (short joins: a signal handler runs on the main thread between them)
        if self._error is not None:
            raise self._error
        return self._value

    def wait_quietly(self) -> None:
        """Wait for the work and drop its outcome (the main thread is failing or stopped for another reason)."""
        self._thread.join()


def overlapped_phases(main: tuple[str, float], beside: list[tuple[str, float]], wall: float) -> dict[str, float]:
    """The start summary's entries of phases that ran at once: each under its usual name with its own seconds,
    then one entry naming them as overlapped with the wall time they took together (their sum is not wall time)."""
    out = dict([main, *beside])
    out[f"wall time of the {len(out)} phases above, which ran at once"] = wall
    return out
