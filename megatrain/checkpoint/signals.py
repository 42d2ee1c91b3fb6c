"""A graceful stop: on SIGTERM, SIGINT or SIGHUP (the terminal or SSH session closed) the run stops where nothing
is lost, says what it did on one line, and exits 0.

The handler is installed for the whole run (`megatrain.run.trainer.train`), and what the first signal does
depends on the phase:
- a step, or a save: the handler only records the request (the loop checks it at each step boundary), because a
  step cannot be cut in half without losing it; the step finishes, a checkpoint is saved, the run ends;
- an `interruptible` phase (start-up, before anything is written; an export, once its checkpoint is complete): it
  raises Stopped at once, as nothing is lost by leaving;
- an evaluation checks `requested` between its batches and ends early (its numbers are not logged).
A second signal raises KeyboardInterrupt: stop now, abandoning a save in progress (it stays a .tmp directory,
never a checkpoint); `forced` says that it came, so that whatever it interrupted is reported as the stop it is.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager


class Stopped(BaseException):
    """A signal during an interruptible phase. A BaseException, so that no `except Exception` on the way takes it
    for a failure."""

    def __init__(self, name: str, phase: str):
        super().__init__(f"{name} during {phase}")
        self.name, self.phase = name, phase


class StopOnSignal:
    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal or SSH session closed

    def __init__(self):
        self.requested: str | None = None  # the signal's name once one arrived
        self.forced = False  # a second signal arrived
        self._phase: str | None = None  # the interruptible phase running, if any
        self._pid = os.getpid()  # the run's process (a forked child inherits the handler)
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

    @contextmanager
    def interruptible(self, phase: str):
        """Within: a signal raises Stopped(name, phase) at once (one that came before raises it on entry)."""
        if self.requested:
            raise Stopped(self.requested, phase)
        self._phase = phase
        try:
            yield
        finally:
            self._phase = None

    def _handle(self, signum, frame) -> None:
        if os.getpid() != self._pid:  # a forked child that inherited the handler (a pool's worker): it ends,
            raise SystemExit(128 + signum)  # quietly, unwinding (a lock it holds, its pool's queue's, is released)
        name = signal.Signals(signum).name
        if self.requested:
            self.forced = True
            raise KeyboardInterrupt(f"second {name}")
        self.requested = name
        if self._phase is not None:
            phase, self._phase = self._phase, None
            raise Stopped(name, phase)
        # os.write: safe inside a signal handler even when the interrupted code was printing; a reader gone with
        # the same Ctrl-C (`| tee`) or a closed terminal must not end the stop that saves
        try:
            os.write(2, f"\nmegatrain: {name}: finishing this step, then saving a checkpoint "
                        f"(send it again to stop at once, without saving)\n".encode())
        except OSError:
            pass
