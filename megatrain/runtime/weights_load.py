"""Pretrained safetensors into the host store on many cores: shards and tensors read in parallel, converted to the
fp32 master on the same threads, without a copy of the model beside the store.

Each checkpoint tensor (bf16, fp16 or fp32) is cut into pieces of PIECE bytes; a piece is one task of a pool of
`threads` threads: `preadv` its bytes (the call releases the GIL) into the thread's own PIECE buffer, then copy
them, cast, into the master's view (an fp32 piece is read straight into the master), and into the streaming copy's
view while the piece is in the core's cache (no pass over the store at the end): the buffer's bytes themselves when
the file holds the streaming dtype (bf16 -> fp32 -> bf16 returns every value: a copy of 2 B/param, not a cast that
reads the master's 4), else cast from the master. So the loader holds `threads` x PIECE bytes beyond the store
however large the model, reads many places of many shards at once (what a disk needs to reach its rate; a
page-cached file reads at memory speed on every thread), and casts on every core. F64 tensors and those a
checkpoint stores packed (gpt-oss's MXFP4 experts, `ModelAdapter.packed_source`) go through `safe_open`, one tensor
per task. Any other dtype (integers, bool, fp8 without its scales) is refused before a byte is read: cast to fp32 it
would train as weights. Every piece is checked finite as it lands in the master, on the same thread
(`nonfinite_at`): a NaN or an infinity (or an F64 value beyond fp32) is named by file, tensor and element now, not
as a NaN loss at step 1. A progress bar (tqdm, on a terminal) shows GB/s; the caller logs bytes and seconds.
"""

from __future__ import annotations

import ctypes
import functools
import json
import math
import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import MegatrainError
from .gil import short_switches

PIECE = 16 << 20  # bytes of a checkpoint tensor read by one task (fewer tasks: the GIL taken fewer times, gil.py)
THREADS = 32  # pieces in flight at most, one per core (reads and casts: a page-cached file is read at memory speed;
#               on 32 cores 32 threads loaded 4-9% faster than 16, beyond 32 not measured)
SOURCE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}  # read piece by piece
FLOATS = (*SOURCE, "F64")  # the checkpoint dtypes loaded (F64 through safe_open)


def serial_torch() -> None:
    """The I/O pools' thread initializer: torch's CPU ops (casts, copies) called on this thread run on it alone.
    Otherwise each pool thread's first parallel op opens an OpenMP team of its own over every core (libgomp keeps one
    per calling thread): 16 I/O threads casting at once would run 16 teams of 16 on 16 cores, their threads spinning
    between regions, beside the threads hashing. The pool gives the parallelism. No-op without libgomp."""
    torch.get_num_threads()  # torch's own set-up of this thread's OpenMP first (it would undo the setting below)
    for lib in _gomp():
        lib.omp_set_num_threads(1)  # this thread's OpenMP setting only: the process's other threads keep theirs


@functools.cache
def _gomp() -> list:
    """The OpenMP runtimes (libgomp) loaded in this process, as torch uses them."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    libs = []
    for path in sorted(set(re.findall(r"(/\S*/libgomp[^/\s]*\.so[.\d]*)", maps))):
        try:
            libs.append(ctypes.CDLL(path))
        except OSError:
            pass
    return libs


def shard_header(path: Path) -> tuple[int, dict]:
    """(offset of the data section, name -> {dtype, shape, data_offsets}) of a safetensors file."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return 8 + n, header


def load_units(store, model_dir: Path, weight_map: dict, packed: dict, open_shard, threads: int | None = None,
               progress: bool = True) -> dict:
    """Fill every tile's master (and streaming copy) from the safetensors files. Returns {"bytes", "seconds"}."""
    t0 = time.perf_counter()
    files = sorted(set(weight_map.values()))
    headers = {f: shard_header(model_dir / f) for f in files}
    fds = {f: os.open(model_dir / f, os.O_RDONLY) for f in files}
    n = max(1, threads or min(THREADS, len(os.sched_getaffinity(0))))
    local = threading.local()
    used = {nm for u in store.units for s in u.specs
            for nm in (packed[s.hf_name].names if s.hf_name in packed else s.checkpoint_names)}
    total = sum(_nbytes(headers[weight_map[nm]][1][nm]) for nm in used)
    unpacked = used - {nm for p in packed.values() for nm in p.names}  # (packed: their build checks their dtypes)
    for nm in sorted(unpacked):
        dtype = headers[weight_map[nm]][1][nm]["dtype"]
        if dtype not in FLOATS:
            raise MegatrainError(f"{model_dir / weight_map[nm]}: tensor '{nm}' is {dtype}; megatrain loads BF16, F16, "
                                 f"F32 or F64 weights (a quantized checkpoint other than gpt-oss's MXFP4 must be "
                                 f"dequantized first)")
    bar = _bar(total, progress)
    lock = threading.Lock()

    def moved(b: int) -> None:
        if bar is not None:
            with lock:
                bar.update(b)

    def piece(f: str, name: str, shape, start: int, part: torch.Tensor, src: torch.dtype, a: int, b: int,
              spart=None) -> None:
        """Elements [a, b) of `part` (flat) from the file's tensor `name` of `shape` starting at byte `start`;
        spart: the same elements of the streaming copy, cast from them here (while they are in this core's
        cache)."""
        es = src.itemsize
        if src == part.dtype:
            dest = part[a:b].view(torch.uint8)
        else:
            buf = getattr(local, "buf", None)
            if buf is None:
                buf = local.buf = torch.empty(PIECE, dtype=torch.uint8)
            dest = buf[: (b - a) * es]
        _read(fds[f], memoryview(dest.numpy()), start + a * es, model_dir / f)
        # checked in the file's dtype (a bf16 piece: half the bytes of its fp32 cast, which is exact: the same
        # elements are not finite)
        if (i := nonfinite_at(dest.view(src))) is not None:
            raise MegatrainError(f"{model_dir / f}: tensor '{name}' holds "
                                 f"{nonfinite(dest.view(src)[i].float(), a + i, shape)}")
        if src != part.dtype:
            part[a:b].copy_(dest.view(src))
        if spart is not None and src == spart.dtype != part.dtype:  # the file's bytes: what the cast back would give
            spart[a:b].view(torch.uint8).copy_(dest)
        elif spart is not None:
            spart[a:b].copy_(part[a:b])
        moved((b - a) * es)

    def whole(fn, *args) -> None:
        handles = {}
        try:
            fn(handles, *args)
        finally:
            handles.clear()

    def via_safe_open(handles, name: str, part: torch.Tensor, spart=None) -> None:
        f = weight_map[name]
        h = handles.setdefault(f, open_shard(model_dir / f))
        t = h.get_tensor(name).reshape(part.shape)
        part.copy_(t)
        if (i := nonfinite_at(part)) is not None:
            source = t.reshape(-1)[i]
            beyond = f" in fp32 (the file's {str(t.dtype).replace('torch.', '')} value {source.item():g} is beyond " \
                "fp32's range)" if bool(source.isfinite()) else ""
            raise MegatrainError(f"{model_dir / f}: tensor '{name}' holds "
                                 f"{nonfinite(part.reshape(-1)[i], i, part.shape, beyond)}")
        if spart is not None:
            spart.copy_(part)
        moved(_nbytes(headers[f][1][name]))

    def build(handles, s, view, sview=None) -> None:
        p = packed[s.hf_name]
        try:
            p.build(view, [handles.setdefault(weight_map[nm], open_shard(model_dir / weight_map[nm])).get_tensor(nm)
                           for nm in p.names])
        except ValueError as e:
            raise MegatrainError(f"{model_dir}: tensors {', '.join(p.names)}: {e}") from None
        if (i := nonfinite_at(view)) is not None:
            raise MegatrainError(f"{model_dir / weight_map[p.names[0]]}: tensors {', '.join(p.names)}: hold "
                                 f"{nonfinite(view.reshape(-1)[i], i, view.shape, f' of {s.hf_name} once unpacked')}")
        if sview is not None:
            sview.copy_(view)
        moved(sum(_nbytes(headers[weight_map[nm]][1][nm]) for nm in p.names))

    # the streaming copy filled piece by piece beside the master (not in a pass over the store at the end), unless
    # the master is staged through the SSD tier (a unit's copy once its buffer is complete) or is the stream itself
    inline = "master" not in store.on_disk and getattr(store, "separate_stream_copy", False)

    try:
        with short_switches(), ThreadPoolExecutor(n, thread_name_prefix="megatrain-load",
                                                  initializer=serial_torch) as pool:  # (gil.py: the GIL back often)
            futures = []
            for i, t in enumerate(store.tiles):
                with store.unit_state(i, ("master",), read=False, write=True) as st:
                    streams = t.views(t.stream).values() if inline else [None] * len(t.unit.specs)
                    for s, view, sview in zip(t.unit.specs, t.views(st["master"]).values(), streams):
                        if s.hf_name in packed:
                            futures.append(pool.submit(whole, build, s, view, sview))
                            continue
                        sparts = [p for _, p in s.split(sview)] if inline else [None] * len(s.checkpoint_names)
                        for (name, part), spart in zip(s.split(view), sparts):
                            futures += _submit_tensor(pool, piece, whole, via_safe_open, name, part, weight_map,
                                                      headers, model_dir, spart)
                    if "master" in store.on_disk:  # staged: this unit complete before its buffer is written
                        _wait(futures)
                        futures = []
                        store.refresh_stream_copy(t, st["master"])
            _wait(futures)
    finally:
        for fd in fds.values():
            os.close(fd)
        if bar is not None:
            bar.close()
    return {"bytes": total, "seconds": time.perf_counter() - t0}


def _submit_tensor(pool, piece, whole, via_safe_open, name, part, weight_map, headers, model_dir, spart) -> list:
    f = weight_map[name]
    start, header = headers[f]
    e = header[name]
    if tuple(e["shape"]) != tuple(part.shape):
        raise MegatrainError(f"{model_dir / f}: tensor '{name}' has shape {list(e['shape'])}, config.json implies "
                             f"{list(part.shape)}")
    src = SOURCE.get(e["dtype"])
    if src is None or not part.is_contiguous():
        return [pool.submit(whole, via_safe_open, name, part, spart)]
    lo, hi = e["data_offsets"]
    if hi - lo != part.numel() * src.itemsize:
        raise MegatrainError(f"{model_dir / f}: tensor '{name}' holds {hi - lo} bytes, its shape and dtype "
                             f"{e['dtype']} imply {part.numel() * src.itemsize}")
    flat, step = part.reshape(-1), max(1, PIECE // src.itemsize)
    sflat = None if spart is None else spart.reshape(-1)
    return [pool.submit(piece, f, name, part.shape, start + lo, flat, src, a, min(a + step, flat.numel()), sflat)
            for a in range(0, flat.numel(), step)]


def nonfinite_at(values: torch.Tensor) -> int | None:
    """The flat index of the first NaN or infinity in `values`, or None. The sum is finite only when every element
    is (a NaN or an infinity makes it NaN or infinite): one read of each element, nothing allocated, where
    isfinite().all() writes a mask and reads it again. The element is searched for only when the sum is not finite
    (finite values may also overflow it)."""
    if math.isfinite(float(values.sum())):
        return None
    bad = (~torch.isfinite(values.reshape(-1))).nonzero()
    return int(bad[0]) if len(bad) else None


def nonfinite(value: torch.Tensor, index: int, shape, note: str = "") -> str:
    """The non-finite `value` of a tensor of `shape` at flat `index`, for the error naming it: "nan at [3, 5]..."."""
    at = [int(x) for x in torch.unravel_index(torch.tensor(index), tuple(shape))]
    return f"{value.item()} at {at}{note}; training needs finite weights"


def _nbytes(entry: dict) -> int:
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def _read(fd: int, mv: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got <= 0:
            raise MegatrainError(f"{path}: truncated (ends at byte {offset + done})")
        done += got


def _wait(futures) -> None:
    first = None
    for fu in futures:
        try:
            fu.result()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


def _bar(total: int, progress: bool):
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc="loading weights", disable=None,
                dynamic_ncols=True)
