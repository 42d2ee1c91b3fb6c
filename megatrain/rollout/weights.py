"""Where the sampler reads its weights: one flat host buffer per unit (the embedding, each decoder layer, the head),
each tensor named as transformers' model names its parameter (TensorSpec.hf_name).

`StoreWeights` hands out the store's streaming copy (runtime/store.py: the compute-dtype tile the engine streams,
so a rollout sees the weights the next training step starts from); `DictWeights` packs a {hf_name: tensor} dict the
same way (tests, or a model loaded elsewhere). A unit is one contiguous buffer so that streaming it to the device is
one copy. The store holds a MoE layer's experts stacked ([E, 2, I, H] for gate and up, models/moe.py), which is
transformers' own `gate_up_proj` [E, 2I, H] in the same row-major order: the sampler views each tensor in the shape
of the module's parameter (`as_param`), no copy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_LAYER = re.compile(r"^(?:.*\.)?layers\.(\d+)\.")


@dataclass
class UnitWeights:
    key: str | int  # "embed", a layer number, or "head"
    flat: torch.Tensor  # host, 1-D, every tensor of the unit back to back
    entries: tuple[tuple[str, tuple[int, ...], int], ...]  # (hf_name, shape, offset into flat)

    def views(self, flat: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """{hf_name: view} into `flat` (default: the host buffer), a buffer laid out like this unit."""
        f = self.flat if flat is None else flat
        out = {}
        for name, shape, off in self.entries:
            n = 1
            for s in shape:
                n *= s
            out[name] = f[off: off + n].view(shape)
        return out

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class WeightSource:
    """The weights of one model as units in forward order: `embed`, `layers[i]` (one per decoder layer), `head`
    (the final norm and the LM head; no LM head tensor when the embedding is tied)."""

    embed: UnitWeights
    layers: list[UnitWeights]
    head: UnitWeights

    def units(self) -> list[UnitWeights]:
        return [self.embed, *self.layers, self.head]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.flat.dtype

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units())


class StoreWeights(WeightSource):
    """The store's streaming copy, unit by unit (no copy: views of the store's tiles, pinned where the store's
    allocation is). `adapter` is the store's (its units name the tensors)."""

    def __init__(self, store, adapter=None):
        adapter = adapter or store.adapter
        units = []
        for tile in store.tiles:
            u, off, entries = tile.unit, 0, []
            for s in u.specs:
                entries.append((s.hf_name, tuple(s.shape), off))
                off += s.numel
            key = u.index if u.kind == "layer" else u.kind
            units.append(UnitWeights(key, tile.stream[:off], tuple(entries)))
        self.embed, self.layers, self.head = units[0], units[1:-1], units[-1]
        if self.embed.key != "embed" or self.head.key != "head" or \
                [u.key for u in self.layers] != list(range(adapter.num_layers)):
            raise ValueError("the store's units are not embed, layers 0..L-1, head")


def unit_key(hf_name: str) -> str | int:
    """The unit a tensor belongs to: `...layers.{i}.` is layer i, the input embedding "embed", the rest "head"."""
    m = _LAYER.match(hf_name)
    return int(m.group(1)) if m else ("embed" if "embed_tokens" in hf_name else "head")


class DictWeights(WeightSource):
    """{hf_name: tensor} packed into one flat buffer per unit (in `dtype`, default the tensors'), grouped by name:
    `...layers.{i}.` is layer i, the input embedding is `embed`, everything else `head`. pin: page-lock the buffers
    (CUDA hosts, so streaming copies run asynchronously)."""

    def __init__(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None, pin: bool = False):
        groups: dict = {}
        for name, t in tensors.items():
            groups.setdefault(unit_key(name), []).append((name, t))
        dtype = dtype or next(iter(tensors.values())).dtype
        layers = sorted(k for k in groups if isinstance(k, int))
        if layers != list(range(len(layers))) or "embed" not in groups:
            raise ValueError(f"weights: need the embedding and layers 0..L-1, got layers {layers[:8]}...")

        def pack(key):
            items = groups.get(key, [])
            flat = torch.empty(sum(t.numel() for _, t in items), dtype=dtype, pin_memory=pin)
            entries, off = [], 0
            for name, t in items:
                flat[off: off + t.numel()].copy_(t.detach().reshape(-1))
                entries.append((name, tuple(t.shape), off))
                off += t.numel()
            return UnitWeights(key, flat, tuple(entries))

        self.embed, self.layers, self.head = pack("embed"), [pack(i) for i in layers], pack("head")


def as_param(t: torch.Tensor, shape: torch.Size, name: str) -> torch.Tensor:
    """`t` viewed in the shape of transformers' parameter `name` (the store's stacked experts [E, 2, I, H] are
    gate_up_proj [E, 2I, H] in the same order); a tensor with another number of elements is an error."""
    if t.shape == shape:
        return t
    if t.numel() != torch.Size(shape).numel():
        raise ValueError(f"weights: {name} has shape {tuple(t.shape)}, the model's parameter {tuple(shape)}")
    return t.view(shape)

