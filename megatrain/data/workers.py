"""The processes datasets' `map` forks to tokenise (its pool's workers, its manager) leave signals to the run and
end with it.

A SIGTERM or Ctrl-C reaches the whole process group: the run stops with one line (cli.py), while the workers, forked
with the run's handlers, raised them as well, each printing a traceback; a run killed with SIGKILL left its workers
tokenising on for minutes and their manager for good. So a process forked by the thread that runs the map (and by
no other: a child of another thread, a compiler's pool, must not end with the map) ends quietly on SIGTERM and
SIGHUP, ignores SIGINT (the run's Ctrl-C ends the pool) and asks the kernel for SIGTERM when the run dies (prctl
PR_SET_PDEATHSIG, Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
from contextlib import contextmanager

PR_SET_PDEATHSIG = 1
_MAP = [None, 0]  # while a map runs: the thread running it, and the run's pid


def _end(signum, frame):
    """A worker's SIGTERM: it ends quietly, unwinding, so that a lock it holds (the pool's queue's) is released: a
    worker killed holding it would hang the pool's clean-up (terminate waits for that lock)."""
    raise SystemExit(128 + signum)


def _forked() -> None:
    thread, run = _MAP
    if thread is None or thread != threading.get_ident():  # (the child's one thread is the one that forked)
        return
    _MAP[0] = None  # (this child's own children are not the map's)
    signal.signal(signal.SIGTERM, _end)
    signal.signal(signal.SIGHUP, _end)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
    except (OSError, AttributeError):  # not Linux: the pool's own clean-up only
        return
    if os.getppid() != run:  # the run died before the request was made
        os._exit(1)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


@contextmanager
def forking_map():
    """Around a `map` on several processes: what it forks from this thread ends with this process."""
    _MAP[:] = [threading.get_ident(), os.getpid()]
    try:
        yield
    finally:
        _MAP[:] = [None, 0]
