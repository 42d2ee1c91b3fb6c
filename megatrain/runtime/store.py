"""HostStore: the authoritative copy of every persistent tensor, in host RAM, as one tile per unit.

Each kind of state (fp32 master, Adam m, Adam v, the streaming copy) is one large page-aligned allocation; a
unit's tile is a contiguous, page-aligned slice of each, laid out in the unit's spec order. The streaming copy is
bf16 in bf16 mode and *is* the master in fp32 mode (12 B/param instead of 14). On CUDA machines the runtime
registers the streaming allocation as pinned once (`PinnedHost`, runtime/pinned.py).

With an SSD tier (memory.disk_path, runtime/disk_tier.py) the kinds placed on disk (disk_states: Adam v, m, the
master) get no host allocation: their tile fields are None, their bytes live in per-unit files, and the optimizer
reads and writes them piece by piece through the tier's bounded cache. The streaming copy always stays in RAM (the
GPU reads it every step): so the master can go to disk only beside a separate bf16 copy; with fp32 streaming the
master *is* what the GPU reads, and a disk copy of it would save no RAM. Whole-unit access for initialisation,
checkpoints and resume goes through `unit_state`, which stages a disk kind in a buffer of one unit.

A preference objective's reference model can live here too (`freeze_reference`: the step-0 weights;
`load_reference`: another model folder): a frozen copy in the compute dtype (bf16: +2 B/param), laid out like the
streaming copy, which the engine's forward-only wave streams instead of the policy's (Engine.sequence_logps with
weights="reference"). It always stays in RAM and is never updated.

The store does not schedule: it only holds, loads and exposes views.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch

from ..errors import MegatrainError, inside
from ..models import ModelAdapter
from .adamw import landing_piece
from .disk_tier import KIND_NAMES, DiskTier
from .pinned import PAGE, aligned_empty
from .tile import LayerTile

ALIGN_ELEMS = PAGE // 2  # tile starts aligned to 2048 elements: page-aligned in bf16 and in fp32 buffers
IGNORED_CHECKPOINT_TENSORS = ("rotary_emb.inv_freq",)


def padded_numel(numel: int) -> int:
    """Elements a unit of `numel` parameters takes in each store allocation (its tile, padded to ALIGN_ELEMS)."""
    return -(-numel // ALIGN_ELEMS) * ALIGN_ELEMS


def store_dtypes(precision: str, stream: str = "bf16") -> tuple[torch.dtype, torch.dtype]:
    """(streaming, compute) dtypes of a run: `precision` ('bf16' or 'fp32') and the placement's stream_dtype."""
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    return (torch.float32 if stream == "fp32" else compute), compute


class HostStore:
    def __init__(self, adapter: ModelAdapter, stream_dtype: torch.dtype, compute_dtype: torch.dtype | None = None,
                 allocate: Callable[..., torch.Tensor] | None = None, disk_path: str | None = None,
                 disk_states: tuple[str, ...] = (), adam_states: bool = True):
        """stream_dtype: what is sent to the device (bf16: a copy the optimizer rewrites; fp32: the master itself).
        compute_dtype: the weights' dtype in the slots (default stream_dtype); bf16 compute from an fp32 stream is
        cast on the device, with the same rounding as the host copy (memory.stream_dtype=fp32: 12 B/param).
        allocate(numel, dtype, zero, what): the large allocations, page-aligned (default `aligned_empty`; a
        distributed run passes memory shared by the node's ranks, megatrain/distributed/shared.py).
        disk_path, disk_states: the SSD tier's folder and the states it holds ('v', 'm', 'master')."""
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
        alloc = self._alloc = allocate or (lambda numel, dtype, zero, what: aligned_empty(numel, dtype, zero=zero))
        self.separate_stream_copy = stream_dtype != torch.float32
        unknown = sorted(set(disk_states) - set(KIND_NAMES))
        if unknown or (disk_states and not disk_path):
            raise ValueError(f"disk_states {list(disk_states)}: needs a disk_path and names among {list(KIND_NAMES)}")
        if "master" in disk_states and not self.separate_stream_copy:
            raise ValueError("the fp32 master is the streaming copy (fp32 streaming): it cannot move to disk")
        self.on_disk = tuple(KIND_NAMES[k] for k in KIND_NAMES if k in disk_states)  # attribute names
        self.disk: DiskTier | None = None
        if self.on_disk:  # the update's pieces are the tier's pieces
            self.disk = DiskTier(disk_path, self.on_disk, [u.numel for u in self.units],
                                 landing_piece(max(u.numel for u in self.units)))
        none = torch.empty(0, dtype=torch.float32)
        self.master = none if "master" in self.on_disk else alloc(total, torch.float32, False, "fp32 master")
        kept = {k for k in ("exp_avg", "exp_avg_sq") if adam_states and k not in self.on_disk}
        self.exp_avg = alloc(total, torch.float32, True, "Adam m") if "exp_avg" in kept else none
        self.exp_avg_sq = alloc(total, torch.float32, True, "Adam v") if "exp_avg_sq" in kept else none
        self.stream = alloc(total, stream_dtype, False, "streaming copy") if self.separate_stream_copy \
            else self.master
        self.tiles: list[LayerTile] = []
        self.reference: torch.Tensor | None = None  # the frozen reference copy (freeze_reference, load_reference)
        self.reference_tiles: list[torch.Tensor] = []  # each unit's flat slice of it
        ends = [s + u.numel for u, s in zip(self.units, starts)]
        for a, b in zip(ends, starts[1:] + [total]):  # alignment padding: zero, so whole buffers are deterministic
            if "master" not in self.on_disk:
                self.master[a:b].zero_()
            if self.separate_stream_copy:
                self.stream[a:b].zero_()
        # the states in RAM (an empty buffer: on the SSD tier, or no Adam states): None in the tiles
        in_ram = [b if b.numel() else None for b in (self.master, self.exp_avg, self.exp_avg_sq)]
        for u, s in zip(self.units, starts):
            sl = slice(s, s + u.numel)
            self.tiles.append(LayerTile(u, *(None if b is None else b[sl] for b in in_ram), self.stream[sl]))

    # ---- sizes ------------------------------------------------------------------------------------
    @property
    def num_params(self) -> int:
        return sum(u.numel for u in self.units)

    def host_bytes(self) -> int:
        """The store's host RAM: the states kept there, the streaming copy, the SSD tier's cache."""
        states = sum(getattr(self, k).numel() > 0 for k in ("master", "exp_avg", "exp_avg_sq"))  # those in RAM
        per = 4 * states + (self.stream.element_size() if self.separate_stream_copy else 0)
        ref = self.reference.numel() * self.reference.element_size() if self.reference is not None else 0
        return self.total_elems * per + ref + (self.disk.cache_bytes if self.disk else 0)

    # ---- the reference model of a preference objective -------------------------------------------------
    def _reference_buffer(self) -> torch.Tensor:
        if self.reference is None:
            self.reference = self._alloc(self.total_elems, self.compute_dtype, True, "reference weights")
            self.reference_tiles = [self.reference[s: s + t.numel]
                                    for t, s in zip(self.tiles, self._tile_starts())]
        return self.reference

    def _tile_starts(self) -> list[int]:
        return [t.stream.storage_offset() - self.stream.storage_offset() for t in self.tiles]

    def freeze_reference(self) -> None:
        """Keep a frozen copy of the weights as they are now (the step-0 policy) as the reference model: the
        streaming copy, cast to the compute dtype where it is fp32 (the same rounding as the slots' cast)."""
        self._reference_buffer().copy_(self.stream)

    def load_reference(self, model_dir: str | Path, threads: int | None = None, progress: bool = True) -> dict:
        """Fill the reference copy from another model folder of the same architecture (the checks and the parallel
        loader of `load_safetensors`), one unit staged in fp32 at a time."""
        self._reference_buffer()
        return self.load_safetensors(model_dir, threads, progress, into=_ReferenceTarget(self))

    def init_reference_random(self, seed: int, std: float) -> None:
        """Fill the reference copy with what init_random(seed, std) gives the policy (the step-0 weights of a
        randomly initialised run, on resume), one unit staged in fp32 at a time."""
        self._reference_buffer()
        self.init_random(seed, std, into=_ReferenceTarget(self))

    def close(self) -> None:
        """Remove the SSD tier's scratch files (its writes finished first); the RAM is freed with the store."""
        if self.disk is not None:
            self.disk.close()

    # ---- whole units, wherever their states live -----------------------------------------------------
    @contextmanager
    def unit_state(self, index: int, kinds: tuple[str, ...] = ("master", "exp_avg", "exp_avg_sq"),
                   read: bool = True, write: bool = False):
        """kind -> the unit's flat fp32 state of that kind ('master', 'exp_avg', 'exp_avg_sq'): the tile's view when
        it lives in RAM; for a kind on the SSD tier, a staging buffer of one unit, read from the tier (read) and
        written back when the block ends without an error (write). Only one unit's staging buffers at a time."""
        tile = self.tiles[index]
        out, staged = {}, []
        for k in kinds:
            if k in self.on_disk:
                buf = aligned_empty(self.disk.file_bytes(index) // 4, torch.float32, zero=True)
                if read:
                    self.disk.read_unit(index, k, buf)
                out[k] = buf[:tile.numel]
                staged.append((k, buf))
            else:
                out[k] = getattr(tile, k)
        yield out
        if write:
            for k, buf in staged:
                self.disk.write_unit(index, k, buf)

    @property
    def max_unit_numel(self) -> int:
        return max(u.numel for u in self.units)

    # ---- initialisation -----------------------------------------------------------------------------
    def init_random(self, seed: int, std: float, threads: int | None = None, into=None) -> None:
        """Deterministic per unit (its own generator, seeded by seed and unit position): the values do not depend
        on the loading order nor on `threads`. torch's CPU normal_ is serial (one generator's stream), 7 ns a
        parameter on the x4 host: 102 s for Qwen2.5-14B one unit after another. So the units' masters are filled
        by `threads` threads at once (default: the cores this process may use; the calls release the GIL), and
        the streaming copies are then cast on this thread with torch's own parallelism. A master on the SSD
        tier is filled unit by unit through its staging buffer (one at a time, as unit_state allows). into: as for
        load_safetensors."""
        def fill(i: int, master: torch.Tensor) -> None:
            t = self.tiles[i]
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            for s, view in zip(t.unit.specs, t.views(master).values()):
                if s.init == "normal":
                    view.normal_(0.0, std, generator=g)
                elif s.init == "ones":
                    view.fill_(1.0)
                else:
                    view.zero_()

        target = into or self
        if "master" in target.on_disk:
            for i, t in enumerate(self.tiles):
                with target.unit_state(i, ("master",), read=False, write=True) as st:
                    fill(i, st["master"])
                    target.refresh_stream_copy(t, st["master"])
            return
        n = min(len(self.tiles), threads or len(os.sched_getaffinity(0)))
        with ThreadPoolExecutor(n, thread_name_prefix="megatrain-init") as pool:
            for _ in pool.map(lambda i: fill(i, self.tiles[i].master), range(len(self.tiles))):
                pass
        for t in self.tiles:
            self.refresh_stream_copy(t)

    def load_safetensors(self, model_dir: str | Path, threads: int | None = None, progress: bool = True,
                         into=None) -> dict:
        """Load every tensor in parallel (runtime/weights_load.py: shards, tensors and pieces of them on `threads`
        threads, a few MiB per thread beyond the store). Returns (and keeps as `load_stats`) bytes and seconds.
        into: where the tensors go (default the store itself; load_reference: the reference copy)."""
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
        from .weights_load import load_units

        stats = load_units(into or self, model_dir, weight_map, packed, _open_shard, threads, progress)
        if into is None:
            self.load_stats = stats
        return stats

    def refresh_stream_copy(self, tile: LayerTile, master: torch.Tensor | None = None) -> None:
        """Rewrite the tile's streaming copy from its master (`master`: where it is staged, when on disk)."""
        if self.separate_stream_copy:
            tile.stream.copy_(tile.master if master is None else master)


class _ReferenceTarget:
    """What weights_load.load_units fills, standing for the store when loading the reference copy: each unit's
    master staged in one fp32 buffer, then cast into the unit's slice of the reference copy."""

    def __init__(self, store: HostStore):
        self.units, self.tiles, self.on_disk = store.units, store.tiles, ("master",)
        self.staging = torch.empty(store.max_unit_numel, dtype=torch.float32)
        self.reference_of = {id(t): r for t, r in zip(store.tiles, store.reference_tiles)}

    @contextmanager
    def unit_state(self, index: int, kinds=("master",), read: bool = True, write: bool = False):
        yield {"master": self.staging[: self.tiles[index].numel]}

    def refresh_stream_copy(self, tile: LayerTile, master: torch.Tensor | None = None) -> None:
        self.reference_of[id(tile)].copy_(master)


def _weight_map(model_dir: Path) -> dict[str, str]:
    """HF tensor name -> safetensors file name, from the index or from the shards themselves. Every shard's header
    is read here, before anything is loaded or written: a truncated or foreign file is named now, not mid-load."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise KeyError("weight_map must map tensor names to shard file names")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise MegatrainError(f"{index}: malformed safetensors index ({e})") from None
        listed: dict[str, list[str]] = {}
        for name, f in wm.items():
            listed.setdefault(f, []).append(name)
        for f in sorted(listed):
            shard = inside(model_dir, f, f"{index}: shard")
            if not shard.is_file():
                raise MegatrainError(f"{index}: shard {f} is listed but missing from {model_dir}")
            keys = _shard_keys(shard)
            absent = next((n for n in listed[f] if n not in keys), None)
            if absent is not None:
                raise MegatrainError(f"{index}: lists tensor '{absent}' in {f}, which does not hold it")
        return wm
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise MegatrainError(
            f"model.path: no *.safetensors in {model_dir}; use model.init=random to train from config.json alone"
        )
    found: dict[str, str] = {}
    for f in files:
        for k in sorted(_shard_keys(model_dir / f)):
            if k in found:  # which copy to train is the user's to say (an index), not the file names' order
                raise MegatrainError(f"{model_dir}: tensor '{k}' is in both {found[k]} and {f}, and no "
                                     f"model.safetensors.index.json says which to load")
            found[k] = f
    return found


def _shard_keys(path: Path) -> set[str]:
    """The tensor names of one safetensors file; safetensors checks that the header's tensors lie within the file,
    which is how a truncated download shows."""
    return set(_open_shard(path).keys())


def _open_shard(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # SafetensorError, OSError: a library's error on the user's file
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MegatrainError(f"{path}: truncated or not a safetensors file ({detail})") from None
