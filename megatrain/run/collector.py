"""Python's cyclic garbage collector, kept out of the steps.

An automatic collection runs whenever enough objects were allocated, on whichever thread allocated them, and holds
the interpreter (every thread: the one that queues the GPU's work and the optimizer's) until it is done. A full one
walks every tracked object, and after the first step compiled the layers a run holds millions of them (Inductor's
graphs and code, the model's modules, the store's views): a collection in the middle of a step then leaves the GPU
idle for as long as it takes. So a run collects between steps instead: automatic collection is off while it trains,
the objects alive before the first step and after it (which stay for the run) are frozen out of every later scan
(`gc.freeze`), and after each step one full collection over what is left (small) frees any cycles the step made.
The first, large collection runs before step 1, while no update is in flight: the optimizer's worker needs the
interpreter between its kernel calls, and step 1's updates run behind step 2's first forward wave.
"""

from __future__ import annotations

import gc
import time


class StepCollector:
    """`between_steps()` after each step (outside its time); `close()` at the end unfreezes what was frozen (a
    process that trains again, or a test suite, collects it as usual) and restores automatic collection.
    `enabled=False` leaves the interpreter's collector alone."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.frozen = False
        self.steps = 0  # between_steps calls so far
        self._was_enabled = gc.isenabled()
        if enabled:
            gc.disable()

    def before_first_step(self) -> float:
        """Collect and freeze what start-up left (the compiled layers' graphs, the data, the libraries) before any
        update is in flight. The first collection walks every object of the process on the training thread, holding
        the GIL the optimizer's worker needs between its kernel calls: after step 1 it would stall step 1's updates,
        which run behind step 2's first forward wave. Returns the seconds it took."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.frozen = True
        return time.perf_counter() - t0

    def between_steps(self) -> float:
        """Collect what the last step left; after the first step, freeze its survivors too (what it compiled, when
        start-up did not): later collections walk only what was made since. Returns the seconds it took."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        gc.collect()
        if self.steps == 0:
            gc.freeze()
            self.frozen = True
        self.steps += 1
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.enabled:
            if self.frozen:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()
        self.enabled = False
