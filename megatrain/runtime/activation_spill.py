"""Activation spill: layer-boundary activations (the engine's recompute checkpoints, not the run's saved
checkpoints of checkpoint/) kept in pinned host memory instead of on the GPU.

The schedule (schedule.py) says which layers' kept inputs spill (`Use.keep == "host"`: the lowest ones, because
backward reaches them last, so their copies have the longest time to land and to come back) and when each comes
back (`Use.fetch`, one block ahead of its backward). The host buffer holds one slot per spilled layer, each laid
out as the step's micro-batches one after another; a wave group saves and loads its own micro-batches' part.

Protocol (CUDA): `save` records an event on the compute stream after the layer input exists; the spill stream
waits on it and copies to host; the device tensor is `record_stream`-ed so its memory is not reused before the copy
ends. `prefetch` waits on the save's completion event on the H2D stream, allocates on that stream, copies, and
records a ready event; `load` makes the compute stream wait on it. On CPU the same calls copy host to host.
The host buffer is registered through the runtime's PinnedHost, which unregisters it when it grows or closes.
"""

from __future__ import annotations

import torch

from .pinned import PinnedHost


def spill_numel(num_layers: int, shapes: list[torch.Size]) -> int:
    """Elements of the host buffer for `num_layers` layers' inputs of micro-batches of these shapes."""
    return num_layers * sum(s.numel() for s in shapes)


class ActivationSpill:
    def __init__(self, device: torch.device, dtype: torch.dtype, h2d=None, compute=None,
                 pinned: PinnedHost | None = None):
        self.device, self.dtype = torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.h2d, self.compute = h2d, compute
        self.pinned = pinned or PinnedHost(cuda=False)
        self.d2h = None
        self.host = torch.empty(0, dtype=dtype)
        self._slot: dict[int, int] = {}  # spilled layer -> its slot in the host buffer
        self._saved: dict[tuple[int, int], tuple[list[torch.Tensor], object]] = {}  # (layer, first mb) -> views
        self._loaded: dict[tuple[int, int], tuple[list[torch.Tensor], object]] = {}

    def begin_step(self, layers: list[int], shapes: list[torch.Size]) -> None:
        """Lay out host space for these spilled layers and this step's micro-batch shapes (grown, and registered
        once, when needed)."""
        self._slot = {l: i for i, l in enumerate(layers)}
        need = spill_numel(len(layers), shapes)
        if need and self.cuda and self.pinned.cuda is False:
            raise ValueError("spilling activations on CUDA needs the runtime's PinnedHost")
        if need > self.host.numel():
            self.pinned.release(self.host)
            self.host = torch.empty(0, dtype=self.dtype)  # the old buffer is freed before the larger one exists
            self.host = self.pinned.empty(need, self.dtype, "activation spill")
        if need and self.cuda and self.d2h is None:
            self.d2h = torch.cuda.Stream(self.device)
        self._shapes = list(shapes)
        self._per_layer = spill_numel(1, shapes)
        self._starts = [0]
        for s in shapes:
            self._starts.append(self._starts[-1] + s.numel())

    def _views(self, layer: int, mbs: range) -> list[torch.Tensor]:
        base = self._slot[layer] * self._per_layer
        return [self.host[base + self._starts[m]: base + self._starts[m + 1]].view(self._shapes[m]) for m in mbs]

    def save(self, layer: int, mbs: range, hidden: list[torch.Tensor]) -> None:
        """Copy these micro-batches' inputs of `layer` to host (asynchronously on CUDA)."""
        views = self._views(layer, mbs)
        if not self.cuda:
            for v, h in zip(views, hidden):
                v.copy_(h)
            self._saved[(layer, mbs.start)] = (views, None)
            return
        ready = torch.cuda.Event()
        ready.record(self.compute)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)
            for v, h in zip(views, hidden):
                v.copy_(h, non_blocking=True)
                h.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        self._saved[(layer, mbs.start)] = (views, done)

    def prefetch(self, layer: int, mbs: range) -> None:
        """Start bringing them back to the device (no-op when already on their way)."""
        key = (layer, mbs.start)
        if key in self._loaded:
            return
        views, done = self._saved.pop(key)
        if not self.cuda:
            self._loaded[key] = (views, None)
            return
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(done)
            dev = [torch.empty(v.shape, dtype=self.dtype, device=self.device) for v in views]
            for d, v in zip(dev, views):
                d.copy_(v, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        self._loaded[key] = (dev, ready)

    def load(self, layer: int, mbs: range) -> list[torch.Tensor]:
        """These micro-batches' inputs of `layer`, on the device."""
        self.prefetch(layer, mbs)
        dev, ready = self._loaded.pop((layer, mbs.start))
        if self.cuda:
            self.compute.wait_event(ready)
            for d in dev:
                d.record_stream(self.compute)
        return list(dev)

    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()
