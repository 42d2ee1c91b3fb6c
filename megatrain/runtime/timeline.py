"""Busy shares of the CUDA streams over a window (a step): CUDA events around each piece of work.

`span(name, stream)` brackets work queued on `stream`; `shares(start, end)` returns, per name, the fraction of
the window [start, end] (two events on the compute stream) during which that stream was busy. Work on one
stream is serial, so a stream's busy time is the sum of its spans clipped to the window. Spans whose events
have not completed yet (the next step's gradient copies, say) are kept for the next window.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch


class Timeline:
    def __init__(self):
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # the optimizer thread records d2h spans

    @contextmanager
    def span(self, name: str, stream: torch.cuda.Stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        with self._lock:
            self._spans.append((name, start, end))

    def add(self, name: str, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        with self._lock:
            self._spans.append((name, start, end))

    @staticmethod
    def marker(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def shares(self, start: torch.cuda.Event, end: torch.cuda.Event) -> dict[str, float]:
        """Call after `end` has completed. Returns {name: busy fraction} for the window."""
        end.synchronize()
        window = start.elapsed_time(end)
        busy: dict[str, float] = {}
        keep = []
        with self._lock:
            spans, self._spans = self._spans, []
        for name, a, b in spans:
            if not b.query():
                keep.append((name, a, b))
                continue
            t0 = max(0.0, start.elapsed_time(a))
            t1 = min(window, start.elapsed_time(b))
            if t1 > t0:
                busy[name] = busy.get(name, 0.0) + (t1 - t0)
            if start.elapsed_time(b) > window:  # also belongs to the next window
                keep.append((name, a, b))
        with self._lock:
            self._spans = keep + self._spans
        return {k: v / window for k, v in busy.items()} | {"window_ms": window}
