"""Busy shares of the CUDA streams over a window (a step): CUDA events around each piece of work.

`span(name, stream)` brackets work queued on `stream`; `shares(start, end)` returns, per name, the fraction of
the window [start, end] (two events on the compute stream) during which that stream was busy. Work on one
stream is serial, so a stream's busy time is the sum of its spans clipped to the window. Spans whose events
have not completed yet (the next step's gradient copies, say) are kept for the next window. With `gaps=N` it also
returns the N longest stretches in the window where the compute stream ran none of its labelled spans (the engine
labels each use of a slot: "forward (3,)"), each with the spans before and after it: where the GPU sat idle.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch


class Timeline:
    def __init__(self):
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event, str]] = []
        self._lock = threading.Lock()  # the optimizer thread records d2h spans

    @contextmanager
    def span(self, name: str, stream: torch.cuda.Stream):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        yield
        end.record(stream)
        with self._lock:
            self._spans.append((name, start, end, ""))

    def add(self, name: str, start: torch.cuda.Event, end: torch.cuda.Event, label: str = "") -> None:
        with self._lock:
            self._spans.append((name, start, end, label))

    @staticmethod
    def marker(stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    def shares(self, start: torch.cuda.Event, end: torch.cuda.Event, gaps: int = 0) -> dict:
        """Call after `end` has completed. Returns {name: busy fraction} for the window, its length ("window_ms")
        and, with gaps > 0, "gaps": the longest idle stretches of the compute spans, [{"ms", "after", "before"}]."""
        end.synchronize()
        window = start.elapsed_time(end)
        busy: dict[str, float] = {}
        keep, compute = [], []
        with self._lock:
            spans, self._spans = self._spans, []
        for span in spans:
            name, a, b, label = span
            if not b.query():
                keep.append(span)
                continue
            t0 = max(0.0, start.elapsed_time(a))
            t1 = min(window, start.elapsed_time(b))
            if t1 > t0:
                busy[name] = busy.get(name, 0.0) + (t1 - t0)
                if name == "compute":
                    compute.append((t0, t1, label))
            if start.elapsed_time(b) > window:  # also belongs to the next window
                keep.append(span)
        with self._lock:
            self._spans = keep + self._spans
        out = {k: v / window for k, v in busy.items()} | {"window_ms": window}
        if gaps:
            out["gaps"] = idle_gaps(compute, window)[:gaps]
        return out


def idle_gaps(spans: list[tuple[float, float, str]], window: float) -> list[dict]:
    """The stretches of [0, window] (ms) that no (start, end, label) span covers, longest first, each with the label
    of the span that ended last before it and of the one that starts it ("" at the window's edges)."""
    out, edge, last = [], 0.0, ""
    for t0, t1, label in sorted(spans):
        if t0 > edge:
            out.append({"ms": t0 - edge, "after": last, "before": label})
        if t1 >= edge:
            edge, last = t1, label
    if window > edge:
        out.append({"ms": window - edge, "after": last, "before": ""})
    return sorted(out, key=lambda g: -g["ms"])
