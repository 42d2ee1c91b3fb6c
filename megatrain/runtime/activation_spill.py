"""Activation spill: layer-boundary activations (the engine's recompute checkpoints, not the run's saved
checkpoints of checkpoint/) kept in pinned host memory instead of on the GPU.

The lowest `num_layers` layers' checkpoints (the inputs of layers 0 .. num_layers-1, for every micro-batch) are
copied to host during the forward wave and brought back during the backward wave, one layer ahead of use, so
GPU memory for checkpoints stops growing with depth. The lowest layers are spilled because backward reaches them
last: their copies have the longest time to land and to come back.

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
    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype, h2d=None, compute=None,
                 pinned: PinnedHost | None = None):
        self.num_layers, self.device, self.dtype = num_layers, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        if self.cuda and num_layers and pinned is None:
            raise ValueError("spilling activations on CUDA needs the runtime's PinnedHost")
        self.h2d, self.compute = h2d, compute
        self.pinned = pinned or PinnedHost(cuda=False)
        self.d2h = torch.cuda.Stream(self.device) if self.cuda and num_layers else None
        self.host = torch.empty(0, dtype=dtype)
        self._saved: dict[int, tuple[list[torch.Tensor], object]] = {}
        self._loaded: dict[int, tuple[list[torch.Tensor], object]] = {}
        self._offsets: list[int] = []

    def spills(self, layer: int) -> bool:
        return layer < self.num_layers

    def begin_step(self, shapes: list[torch.Size]) -> None:
        """Lay out host space for this step's micro-batch shapes (grown, and registered once, when needed)."""
        per_layer = spill_numel(1, shapes)
        need = spill_numel(self.num_layers, shapes)
        if need > self.host.numel():
            self.pinned.release(self.host)
            self.host = torch.empty(0, dtype=self.dtype)  # the old buffer is freed before the larger one exists
            self.host = self.pinned.empty(need, self.dtype, "activation spill")
        self._shapes, self._per_layer = list(shapes), per_layer

    def _views(self, layer: int) -> list[torch.Tensor]:
        out, off = [], layer * self._per_layer
        for s in self._shapes:
            out.append(self.host[off: off + s.numel()].view(s))
            off += s.numel()
        return out

    def save(self, layer: int, hidden: list[torch.Tensor]) -> None:
        views = self._views(layer)
        if not self.cuda:
            for v, h in zip(views, hidden):
                v.copy_(h)
            self._saved[layer] = (views, None)
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
        self._saved[layer] = (views, done)

    def prefetch(self, layer: int) -> None:
        if layer < 0 or not self.spills(layer) or layer in self._loaded:
            return
        views, done = self._saved.pop(layer)
        if not self.cuda:
            self._loaded[layer] = (views, None)
            return
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(done)
            dev = [torch.empty(v.shape, dtype=self.dtype, device=self.device) for v in views]
            for d, v in zip(dev, views):
                d.copy_(v, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        self._loaded[layer] = (dev, ready)

    def load(self, layer: int) -> list[torch.Tensor]:
        """This layer's checkpoints on the device; issues the copy of the next one (layer-1) behind it."""
        self.prefetch(layer)
        dev, ready = self._loaded.pop(layer)
        if self.cuda:
            self.compute.wait_event(ready)
            for d in dev:
                d.record_stream(self.compute)
        self.prefetch(layer - 1)
        return list(dev)

    def host_bytes(self) -> int:
        return self.host.numel() * self.host.element_size()
