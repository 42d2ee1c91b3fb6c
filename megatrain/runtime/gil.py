"""A short GIL switch interval while I/O threads move data (loads, saves, resumes, exports).

An I/O thread releases the GIL for each read, hash, copy or write and must take it back before its next step. While
another thread runs Python (the run's main thread tracing and compiling kernels at start-up, or launching a step's
kernels), taking it back waits until that thread is made to drop it: Python's switch interval, 5 ms by default. A
16 MiB chunk needs the GIL a few times, so at 5 ms the pool moves a few hundred MB/s however fast the disk is: the
weights' load beside torch.compile, and a save beside training, ran at a fraction of the rate they reach alone.
At 0.5 ms the waits are ten times shorter; threads that do not contend for the GIL are unaffected, and the
compiling or launching thread gives it up more often for a few microseconds each time.

Process-wide (sys.setswitchinterval), so counted: the interval is short while any pool is open and restored when
the last closes (a save overlapping an export, say). Only then: 0.5 ms for a whole training run made its steps 4%
slower, the CPU AdamW thread and the main thread handing the GIL back and forth more often (bench/bench_cli.py with
the interval set at the process's start).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager

SWITCH_S = 0.0005

_lock = threading.Lock()
_users = 0
_saved = 0.005


@contextmanager
def short_switches():
    """Within: the switch interval at most SWITCH_S (for every thread of the process); restored after the last."""
    global _users, _saved
    with _lock:
        if _users == 0:
            _saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_saved, SWITCH_S))
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                sys.setswitchinterval(_saved)
