"""fp32 gradient accumulators that outlive a wave group (schedule.py: `wave_groups` > 1).

A unit's accumulator gathers every micro-batch's gradient of the step. With several wave groups it is touched once
per group, and between two groups it waits either on the GPU or, parked in pinned host memory, off it: copied out
(D2H, after the group's last touch) and back (H2D, ahead of the next group's first touch, when the engine fetches
that use's weights). Accumulation continues into the same numbers in the same order, so a step in groups is the
same step, bit for bit. The host buffers (4 B per parameter of the units parked) are registered once through the
runtime's PinnedHost and reused every step; a unit whose finished gradient goes to host memory anyway
(`grads_to_host`) waits between groups in that very buffer (the sink's `host_buffer`), so parking it costs no
more host memory. The buffer is free for it: the optimizer has read the last step's gradient out of it before the
unit's forward of this step (wait_for_update), and the final copy into it comes after the backward that consumed
the last group's copy back. On CPU the same calls copy host to host.
"""

from __future__ import annotations

import torch

from .pinned import PinnedHost


class GroupAccumulators:
    def __init__(self, device: torch.device, pinned: PinnedHost, h2d=None, compute=None, borrow=None):
        """borrow(unit): a pinned host buffer of the unit's size to wait in, or None (one is allocated)."""
        self.device = torch.device(device)
        self.borrow = borrow
        self.cuda = self.device.type == "cuda"
        self.pinned, self.h2d, self.compute = pinned, h2d, compute
        self.d2h = None
        self._host: dict[int, torch.Tensor] = {}  # unit -> its pinned host buffer (kept across steps)
        self._waiting: dict[int, tuple[torch.Tensor, object, bool]] = {}  # unit -> (tensor, event, on host)
        self._back: dict[int, tuple[torch.Tensor, object]] = {}  # unit -> (device tensor, ready event)

    def __contains__(self, unit: int) -> bool:
        return unit in self._waiting or unit in self._back

    def park(self, unit: int, grad: torch.Tensor, where: str) -> None:
        """Keep this partial gradient for the next group: on the GPU ("gpu") or in host memory ("host")."""
        if where == "gpu":
            self._waiting[unit] = (grad, None, False)
            return
        host = self._host.get(unit)
        if host is None and self.borrow is not None:
            lent = self.borrow(unit)
            if lent is not None and lent.numel() == grad.numel():
                host = lent
        if host is None or host.numel() != grad.numel():
            host = self._host[unit] = self.pinned.empty(grad.numel(), torch.float32, "gradient accumulator "
                                                                                     f"of unit {unit}")
        if not self.cuda:
            host.copy_(grad)
            self._waiting[unit] = (host, None, True)
            return
        if self.d2h is None:
            self.d2h = torch.cuda.Stream(self.device)
        ready = torch.cuda.Event()
        ready.record(self.compute)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)
            host.copy_(grad, non_blocking=True)
            grad.record_stream(self.d2h)  # the device copy is freed now, its memory reused once copied
            done = torch.cuda.Event()
            done.record(self.d2h)
        self._waiting[unit] = (host, done, True)

    def prefetch(self, unit: int) -> None:
        """Start bringing a parked accumulator back to the device (no-op if it waits on the GPU, or is not here)."""
        if unit not in self._waiting or not self._waiting[unit][2]:
            return
        host, done, _ = self._waiting.pop(unit)
        if not self.cuda:
            self._back[unit] = (host.clone(), None)
            return
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(done)
            dev = torch.empty(host.numel(), dtype=torch.float32, device=self.device)
            dev.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        self._back[unit] = (dev, ready)

    def take(self, unit: int) -> torch.Tensor | None:
        """This unit's accumulator on the device, to continue into; None if nothing was parked (the first group)."""
        if unit in self._waiting and not self._waiting[unit][2]:
            return self._waiting.pop(unit)[0]
        if unit not in self._waiting and unit not in self._back:
            return None
        self.prefetch(unit)
        dev, ready = self._back.pop(unit)
        if self.cuda:
            self.compute.wait_event(ready)
            dev.record_stream(self.compute)
        return dev

    def host_bytes(self) -> int:
        """Host memory allocated here (borrowed buffers not counted)."""
        return sum(b.numel() * 4 for b in self._host.values())
