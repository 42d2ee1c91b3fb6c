"""A graceful stop: on SIGTERM or SIGINT the step loop finishes its step, saves, and the run exits 0.

The handler only records the request (the loop checks it at each step boundary), because a step cannot be cut
in half without losing it. A second signal raises KeyboardInterrupt: stop now, abandoning a save in progress
(it stays a .tmp directory, never a checkpoint).
"""

from __future__ import annotations

import os
import signal
import threading


class StopOnSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested: str | None = None  # the signal's name once one arrived
        self._old = {}

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"second {name}")
        self.requested = name
        # os.write: safe inside a signal handler even when the interrupted code was printing
        os.write(2, f"\nmegatrain: {name}: finishing this step, then saving a checkpoint "
                    f"(send it again to stop at once, without saving)\n".encode())
