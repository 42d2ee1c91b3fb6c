"""Python's cyclic garbage collector, kept out of the steps.

An automatic collection runs whenever enough objects were allocated, on whichever thread allocated them, and holds
the interpreter (every thread: the one that queues the GPU's work and the optimizer's) until it is done. A full one
walks every tracked object, and after the first step compiled the layers a run holds millions of them (Inductor's
graphs and code, the model's modules, the store's views): a collection in the middle of a step then leaves the GPU
idle for as long as it takes. So a run collects between steps instead: automatic collection is off while it trains,
the objects alive after the first step (which stay for the run) are frozen out of every later scan (`gc.freeze`),
and after each step one full collection over what is left (small) frees any cycles the step made.
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
        self._was_enabled = gc.isenabled()
        if enabled:
            gc.disable()

    def between_steps(self) -> float:
        """Collect what the last step left: the first time everything, then freezing the survivors; later only
        what was made since. Returns the seconds it took."""
        if not self.enabled:
            return 0.0
        t0 = time.perf_counter()
        gc.collect()
        if not self.frozen:
            gc.freeze()
            self.frozen = True
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.enabled:
            if self.frozen:
                gc.unfreeze()
            if self._was_enabled:
                gc.enable()
        self.enabled = False
