"""`megatrain export CHECKPOINT` as one pipeline: reads, checks, casts and writes of many chunks at once.

Reading a unit's masters, then casting and writing them, then reading the next unit leaves the disk idle half the
time (reads wait for writes and writes for reads). Here every 16 MiB chunk of the checkpoint that holds masters is
one task of the pool (fastio.Pool), and a task does all of its chunk's work: it reads the chunk in pieces with
O_DIRECT (no page cache, no copy), hashes each piece into the chunk's sha256, casts the masters of the piece to
the export's dtype and writes them at their offsets in the shards (whose layout is planned before anything is
read, export._Shards). The pool's threads are at different stages at any time, so reads of later chunks are in
flight while earlier ones are cast and written: the export runs at the pace of the disk's reads and writes
together, not of their sum. Chunks holding only Adam states are not read.

The chunk's checksum is compared once its last piece is read, after its pieces were written: a mismatch fails the
export, whose folder is then removed (export._export), so no file of an unverified chunk ever appears.

Memory: a piece buffer per thread (and its cast), PIECE bytes at most and never more than half of the largest
unit's masters over the threads: a few MiB per thread, not a unit, not the model. Shard writes are buffered (their
offsets are not page-aligned); each written range is handed to the kernel's writeback at once
(POSIX_FADV_DONTNEED), so the fsync at the end has little left to flush and the page cache does not fill up.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import torch

from ..errors import MegatrainError
from ..runtime.disk_files import transfer
from ..runtime.pinned import PAGE, aligned_empty
from .fastio import CHUNK, Pool, wait_all
from .tensorfile import read_header

PIECE = CHUNK  # bytes read at once by a thread (one request in flight per thread)
MIN_PIECE = 1 << 20


def piece_bytes(largest_master_bytes: int, threads: int) -> int:
    """The read size: PIECE, less when the pieces of all threads would exceed half of the largest unit's masters
    (a small model: memory stays within a unit), at least MIN_PIECE; a multiple of the page (O_DIRECT)."""
    n = min(PIECE, max(MIN_PIECE, largest_master_bytes // (2 * threads)))
    return max(PAGE, n // PAGE * PAGE)


def master_runs(path: Path, info: dict, unit, where: dict) -> list[tuple[int, int, str]]:
    """(file offset, bytes, export tensor name) of every export tensor's fp32 master in a unit file, in file order.
    Names a master of another dtype or shape than the unit's, or one that is missing."""
    head, entries, _ = read_header(path, int(info["bytes"]))
    found = {name: (start, end, dtype, shape) for start, end, name, dtype, shape in entries}
    runs = []
    for sp in unit.specs:
        key = f"master/{sp.hf_name}"
        if key not in found:
            raise MegatrainError(f"{path}: tensor '{key}' ({unit.name}) is missing")
        start, end, dtype, shape = found[key]
        if dtype != torch.float32 or tuple(shape) != tuple(sp.shape) or end - start != 4 * sp.numel:
            raise MegatrainError(f"{path}: tensor '{key}' is {dtype}{list(shape)}, not what {unit.name} of this "
                                 f"model holds (float32{list(sp.shape)})")
        part = 4 * sp.numel // len(sp.checkpoint_names)
        for j, name in enumerate(sp.checkpoint_names):
            if name not in where:
                raise MegatrainError(f"export: {unit.name} holds '{name}', not part of this model")
            runs.append((len(head) + start + j * part, part, name))
    known = {f"{k}/{sp.hf_name}" for k in ("master", "exp_avg", "exp_avg_sq") for sp in unit.specs} | {"step"}
    if stray := next((n for n in found if n not in known), None):
        raise MegatrainError(f"{path}: tensor '{stray}' is not part of {unit.name} of this model")
    return sorted(runs)


class _UnitFile:
    """One unit file's chunks that hold masters, read as tasks of the pool; its descriptor closes with its last."""

    def __init__(self, path: Path, info: dict, runs: list, stream, piece: int):
        self.path, self.info, self.runs, self.stream, self.piece = Path(path), info, runs, stream, piece
        self.size, self.chunk = int(info["bytes"]), int(info["chunk_bytes"])
        self.n = len(info["sha256_chunks"])
        if self.chunk <= 0 or self.n != max(1, -(-self.size // self.chunk)):
            raise MegatrainError(f"{self.path}: its manifest entry lists {self.n} chunk checksums for "
                                 f"{self.size} bytes")
        lo, hi = runs[0][0], max(off + n for off, n, _ in runs)
        self.chunks = list(range(lo // self.chunk, -(-hi // self.chunk)))
        self.fd, self.direct, self._left, self._lock = -1, False, len(self.chunks), threading.Lock()

    def open(self) -> None:
        if self.chunk % PAGE == 0 and self.piece % PAGE == 0:
            try:
                self.fd, self.direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT), True
                return
            except OSError:  # a filesystem without O_DIRECT: buffered reads (dropped from the cache once used)
                pass
        self.fd = os.open(self.path, os.O_RDONLY)

    def task(self, bufs, k: int) -> None:
        a, b = k * self.chunk, min(self.size, (k + 1) * self.chunk)
        h = hashlib.sha256()
        for x in range(a, b, self.piece):
            y = min(b, x + self.piece)
            view = bufs.read(self, x, y)
            h.update(memoryview(view.numpy()))
            self._write(bufs, view, x, y)
        if not self.direct and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, a, b - a, os.POSIX_FADV_DONTNEED)
        if h.hexdigest() != self.info["sha256_chunks"][k]:
            raise MegatrainError(f"{self.path}: checksum mismatch in bytes {a}-{b} (chunk {k + 1} of {self.n}): the "
                                 f"file is corrupted")
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.close()

    def _write(self, bufs, view: torch.Tensor, x: int, y: int) -> None:
        """The masters within file bytes [x, y) (in `view`), cast, at their places in the shards."""
        st = self.stream
        e = st.dtype.itemsize
        for off, n, name in self.runs:
            lo, hi = max(x, off), min(y, off + n)
            if lo >= hi:
                continue
            src = view[lo - x: hi - x]
            if (lo - x) % 4:  # never with this layout (offsets are multiples of 8); kept correct anyway
                src = src.clone()
            src = src.view(torch.float32)
            out = src if st.dtype == torch.float32 else bufs.cast(src, st.dtype)
            k, base, _ = st.where[name]
            pos = base + (lo - off) // 4 * e
            transfer(st.fds[k], memoryview(out.view(torch.uint8).numpy()), pos, True)
            if hasattr(os, "posix_fadvise"):  # start its writeback now (the pages are dropped once clean)
                os.posix_fadvise(st.fds[k], pos, out.numel() * e, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class _Buffers:
    """Each thread's page-aligned piece buffer and its cast, allocated on first use."""

    def __init__(self, piece: int):
        self.piece, self._local = piece, threading.local()

    def read(self, f: _UnitFile, x: int, y: int) -> torch.Tensor:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = self._local.buf = aligned_empty(self.piece, torch.uint8, zero=False)
        need = y - x
        m = -(-need // PAGE) * PAGE if f.direct else need
        mv, done = memoryview(buf[:m].numpy()), 0
        while done < need:
            got = os.preadv(f.fd, [mv[done:m]], x + done)
            if got <= 0:
                raise MegatrainError(f"{f.path}: truncated (ends at byte {x + done})")
            done += got
        return buf[:need]

    def cast(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        out = getattr(self._local, "out", None)
        if out is None or out.dtype != dtype:
            out = self._local.out = torch.empty(self.piece // 4, dtype=dtype)
        o = out[:src.numel()]
        o.copy_(src)
        return o


def write_from_checkpoint(ckpt: Path, manifest: dict, units: list, stream, threads: int | None) -> None:
    """Every export tensor of `stream` (export._Shards: shards opened, headers written) from the checkpoint's unit
    files (manifest format_version 2: a sha256 per chunk), on a pool of `threads`; fsyncs the shards."""
    files = []
    for unit, u in zip(units, manifest["units"]):
        info = manifest["files"].get(u["file"])
        if info is None:
            raise MegatrainError(f"{ckpt / 'manifest.json'}: does not list {u['file']}")
        files.append((ckpt / u["file"], info, unit))
    opened: list[_UnitFile] = []
    try:
        with Pool(threads) as pool:
            bufs = _Buffers(piece_bytes(max(4 * u.numel for u in units), pool.threads))
            futures = []
            for path, info, unit in files:
                f = _UnitFile(path, info, master_runs(path, info, unit, stream.where), stream, bufs.piece)
                stream.written.update(name for _, _, name in f.runs)
                f.open()
                opened.append(f)
                futures += [pool.submit(f.task, bufs, k) for k in f.chunks]
            wait_all(pool, futures)
            stream.finish(pool)
    finally:
        for f in opened:  # those a failed chunk left open (the pool has stopped)
            f.close()
