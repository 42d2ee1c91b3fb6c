"""HostStore: the authoritative copy of every persistent tensor, in host RAM, as one tile per unit.

Each kind of state (fp32 master, Adam m, Adam v, the streaming copy) is one large page-aligned allocation; a
unit's tile is a contiguous, page-aligned slice of each, laid out in the unit's spec order. The streaming copy is
bf16 in bf16 mode and *is* the master in fp32 mode (12 B/param instead of 14). On CUDA machines the runtime
registers the streaming allocation as pinned once (`PinnedHost`, runtime/pinned.py).

The store does not schedule: it only holds, loads and exposes views.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import MegatrainError
from ..models import ModelAdapter, Unit
from .pinned import PAGE, aligned_empty

ALIGN_ELEMS = PAGE // 2  # tile starts aligned to 2048 elements: page-aligned in bf16 and in fp32 buffers
IGNORED_CHECKPOINT_TENSORS = ("rotary_emb.inv_freq",)


def padded_numel(numel: int) -> int:
    """Elements a unit of `numel` parameters takes in each store allocation (its tile, padded to ALIGN_ELEMS)."""
    return -(-numel // ALIGN_ELEMS) * ALIGN_ELEMS


@dataclass
class LayerTile:
    """One unit's slice of each host allocation, plus its layout."""

    unit: Unit
    master: torch.Tensor  # fp32, flat
    exp_avg: torch.Tensor  # Adam m, fp32
    exp_avg_sq: torch.Tensor  # Adam v, fp32
    stream: torch.Tensor  # what is sent to the GPU: bf16 copy, or the master itself in fp32 mode
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))  # Adam step count

    @property
    def numel(self) -> int:
        return self.master.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into any flat buffer laid out like this tile (host tile, GPU slot, gradient)."""
        return self.unit.views(flat)


def store_dtypes(precision: str, stream: str = "bf16") -> tuple[torch.dtype, torch.dtype]:
    """(streaming, compute) dtypes of a run: `precision` ('bf16' or 'fp32') and the placement's stream_dtype."""
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    return (torch.float32 if stream == "fp32" else compute), compute


class HostStore:
    def __init__(self, adapter: ModelAdapter, stream_dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                 allocate: Callable[..., torch.Tensor] | None = None):
        """stream_dtype: what is sent to the device (bf16: a copy the optimizer rewrites; fp32: the master itself).
        compute_dtype: the weights' dtype in the slots (default stream_dtype); bf16 compute from an fp32 stream is
        cast on the device, with the same rounding as the host copy (memory.stream_dtype=fp32: 12 B/param).
        allocate(numel, dtype, zero, what): the large allocations, page-aligned (default `aligned_empty`; a
        distributed run passes memory shared by the node's ranks, megatrain/distributed/shared.py)."""
        self.adapter = adapter
        self.units = adapter.units()
        self.stream_dtype = stream_dtype
        self.compute_dtype = compute_dtype or stream_dtype
        if self.compute_dtype != stream_dtype and stream_dtype != torch.float32:
            raise ValueError(f"streaming {stream_dtype} cannot feed {self.compute_dtype} compute")
        starts, total = [], 0
        for u in self.units:
            starts.append(total)
            total += padded_numel(u.numel)
        self.total_elems = total
        alloc = allocate or (lambda numel, dtype, zero, what: aligned_empty(numel, dtype, zero=zero))
        self.master = alloc(total, torch.float32, False, "fp32 master")
        self.exp_avg = alloc(total, torch.float32, True, "Adam m")
        self.exp_avg_sq = alloc(total, torch.float32, True, "Adam v")
        self.separate_stream_copy = stream_dtype != torch.float32
        self.stream = alloc(total, stream_dtype, False, "streaming copy") if self.separate_stream_copy \
            else self.master
        self.tiles: list[LayerTile] = []
        ends = [s + u.numel for u, s in zip(self.units, starts)]
        for a, b in zip(ends, starts[1:] + [total]):  # alignment padding: zero, so whole buffers are deterministic
            self.master[a:b].zero_()
            if self.separate_stream_copy:
                self.stream[a:b].zero_()
        for u, s in zip(self.units, starts):
            sl = slice(s, s + u.numel)
            self.tiles.append(LayerTile(u, self.master[sl], self.exp_avg[sl], self.exp_avg_sq[sl], self.stream[sl]))

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def host_bytes(self) -> int:
        per = 12 + (self.stream.element_size() if self.separate_stream_copy else 0)
        return self.total_elems * per

    @property
    def max_unit_numel(self) -> int:
        return max(u.numel for u in self.units)

    # ---- initialisation -----------------------------------------------------------------------------
    def init_random(self, seed: int, std: float) -> None:
        """Deterministic per unit (seeded by seed and unit position), independent of loading order."""
        for i, t in enumerate(self.tiles):
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            for s, view in zip(t.unit.specs, t.views(t.master).values()):
                if s.init == "normal":
                    view.normal_(0.0, std, generator=g)
                elif s.init == "ones":
                    view.fill_(1.0)
                else:
                    view.zero_()
            self.refresh_stream_copy(t)

    def load_safetensors(self, model_dir: str | Path) -> None:
        """Load unit by unit: at most one unit's tensors are read beyond the store at any time."""
        from safetensors import safe_open

        model_dir = Path(model_dir)
        weight_map = _weight_map(model_dir)
        # a tensor the checkpoint stores otherwise (quantized) is built from other tensors: the adapter says how
        packed = {s.hf_name: p for u in self.units for s in u.specs
                  if (p := self.adapter.packed_source(s, weight_map)) is not None}

        def names(s):
            return packed[s.hf_name].names if s.hf_name in packed else s.checkpoint_names

        expected = {n for u in self.units for s in u.specs for n in names(s)}
        ignorable = {"lm_head.weight"} if self.adapter.tied else set()
        unexpected = sorted(
            n for n in weight_map
            if n not in expected and n not in ignorable and not n.endswith(IGNORED_CHECKPOINT_TENSORS)
        )
        if unexpected:
            more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
            raise MegatrainError(
                f"{model_dir}: checkpoint tensor '{unexpected[0]}' in {weight_map[unexpected[0]]} is not part of a "
                f"{self.adapter.model_type} model with this config.json{more}: {', '.join(unexpected[:3])}"
            )
        for t in self.tiles:
            missing = [n for s in t.unit.specs for n in names(s) if n not in weight_map]
            if missing:
                raise MegatrainError(f"{model_dir}: tensor '{missing[0]}' ({t.unit.name}) is missing from the checkpoint")
            files = sorted({weight_map[n] for s in t.unit.specs for n in names(s)})
            handles = {f: safe_open(str(model_dir / f), framework="pt") for f in files}
            try:
                for s, view in zip(t.unit.specs, t.views(t.master).values()):
                    if s.hf_name in packed:
                        p = packed[s.hf_name]
                        try:
                            p.build(view, [handles[weight_map[n]].get_tensor(n) for n in p.names])
                        except ValueError as e:
                            raise MegatrainError(f"{model_dir}: tensors {', '.join(p.names)}: {e}") from None
                        continue
                    for name, part in s.split(view):
                        fname = weight_map[name]
                        shape = tuple(handles[fname].get_slice(name).get_shape())
                        if shape != tuple(part.shape):
                            raise MegatrainError(
                                f"{model_dir / fname}: tensor '{name}' has shape {list(shape)}, config.json implies "
                                f"{list(part.shape)}"
                            )
                        part.copy_(handles[fname].get_tensor(name))
            finally:
                handles.clear()  # closes the files and their mappings before the next unit
            self.refresh_stream_copy(t)

    def refresh_stream_copy(self, tile: LayerTile) -> None:
        if self.separate_stream_copy:
            tile.stream.copy_(tile.master)


def _weight_map(model_dir: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file name, from the index or from the shards themselves."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise MegatrainError(f"{index}: malformed safetensors index ({e})") from None
        for f in sorted(set(wm.values())):
            if not (model_dir / f).is_file():
                raise MegatrainError(f"{index}: shard {f} is listed but missing from {model_dir}")
        return wm
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise MegatrainError(
            f"model.path: no *.safetensors in {model_dir}; use model.init=random to train from config.json alone"
        )
    wm = {}
    for f in files:
        try:
            with safe_open(str(model_dir / f), framework="pt") as h:
                for k in h.keys():
                    wm[k] = f
        except Exception as e:
            raise MegatrainError(f"{model_dir / f}: not a readable safetensors file ({e})") from None
    return wm
