"""Files moved at the disk's rate: many requests in flight from a pool of threads, an integrity check per chunk.

Why: one thread writing and hashing a checkpoint moves at most what one core hashes (sha256 about 0.9 GB/s) and
keeps one request in the disk's queue: a quarter of a fast disk's rate or less. Here a file is cut
into CHUNK-byte chunks, and each chunk is one task of a pool of `threads` threads: gather its bytes (from the store's
memory, no copy of the state), hash them (sha256 of the chunk: hashlib releases the GIL on large buffers, so the
hashes of THREADS chunks are computed at once), write them at the chunk's offset. Reads are the same tasks
backwards: read a chunk (straight into the tensors it belongs to), hash it, compare with the manifest.

Writes go through O_DIRECT where the filesystem accepts it (as the SSD tier's do, runtime/disk_tier.py): no page
cache, so a 91 GB save neither evicts the page cache nor leaves the kernel 91 GB of dirty pages to flush at
fsync; each thread then owns one page-aligned buffer of CHUNK bytes (THREADS x 16 MiB of RAM during a save), the
last chunk is padded to a page and the file truncated to its size. A filesystem that refuses O_DIRECT gets the same
writes buffered. A resume's reads are O_DIRECT too, into the thread's buffer, hashed, then copied to the tensors;
buffered reads (`direct` off, or refused) go straight into the destination tensors, their pages dropped from the
cache once hashed (POSIX_FADV_DONTNEED).

Integrity: sha256 per chunk, not one per file, and not a CRC. One sha256 per file is a serial chain (one core,
0.9 GB/s): a file of one unit can only be checked as fast as one core hashes it, so large units (an embedding, a
layer of gpt-oss-120b: tens of GB) would pace the save. Per-chunk digests are independent, so the check scales with
the threads (calibration.IO_HASH_BPS) and stays a cryptographic hash: a flipped or zeroed
block is caught with certainty, and the error names the file and the byte range. zlib.crc32 (3.7 GB/s on one core)
would be fast enough too, but is a 32-bit check; the manifest grows by 65 bytes per 16 MiB (about 0.4 MB for a 7B
checkpoint), nothing beside the data. The files themselves are unchanged (standard safetensors, the same bytes as
a single writer's); only the manifest's entry for a unit file lists `sha256_chunks` instead of `sha256`.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import MegatrainError
from ..runtime.disk_files import probe_direct, transfer
from ..runtime.gil import short_switches
from ..runtime.pinned import PAGE, aligned_empty
from ..runtime.weights_load import serial_torch

CHUNK = 16 << 20  # bytes hashed as one sha256 and moved as one request (the SSD tier's request size)
SCRATCH = 1 << 20  # bytes a reader hashes but keeps nowhere (headers, states an export skips) pass through this
THREADS = 16  # I/O threads by default (at most the cores): twice the disk probe's and the SSD tier's requests in
#               flight, since a thread hashing, copying or casting its chunk has no request in flight meanwhile


def io_threads(threads: int | None = None) -> int:
    return max(1, threads or min(THREADS, len(os.sched_getaffinity(0))))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor's bytes as a flat uint8 tensor (no copy)."""
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous")
    return t.reshape(-1).view(torch.uint8)


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[:] = src for uint8 tensors, on the calling I/O thread alone (numpy's copy, the GIL released): torch's
    copy_ would start a parallel region over every core from each of the pool's threads at once."""
    np.copyto(dst.numpy(), src.numpy())


class Pool:
    """A pool of I/O threads, each with its own page-aligned CHUNK buffer (allocated on first use), and the first
    error of any task: once one failed, the tasks not yet started are skipped."""

    def __init__(self, threads: int | None = None):
        self.threads = io_threads(threads)
        self._ex = ThreadPoolExecutor(self.threads, thread_name_prefix="megatrain-io", initializer=serial_torch)
        self._switches = short_switches()  # the threads take the GIL back often: runtime/gil.py
        self._switches.__enter__()
        self._local = threading.local()
        self.error: BaseException | None = None
        self.cancelled = False

    def bounce(self) -> torch.Tensor:
        b = getattr(self._local, "buf", None)
        if b is None:
            b = self._local.buf = aligned_empty(CHUNK, torch.uint8, zero=True)
        return b

    def scratch(self) -> memoryview:
        b = getattr(self._local, "scratch", None)
        if b is None:
            b = self._local.scratch = memoryview(bytearray(SCRATCH))
        return b

    def submit(self, fn: Callable, *args) -> Future:
        def run():
            if self.error is not None or self.cancelled:
                return
            try:
                fn(*args)
            except BaseException as e:
                if self.error is None:
                    self.error = e
                raise
        return self._ex.submit(run)

    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.cancelled:
            raise RuntimeError("abandoned")

    def close(self) -> None:
        self._ex.shutdown(wait=True)
        self._local = threading.local()
        switches, self._switches = self._switches, None
        if switches is not None:
            switches.__exit__(None, None, None)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:  # leaving on an error: the tasks not yet started are skipped
            self.cancelled = True
        self.close()  # waits for those running: no file is closed under a task


class IOStats:
    """Seconds of a pool's tasks per phase, summed over its threads (where a save's time goes: gathering the bytes
    from the store, hashing them, the disk's writes, fsync)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.seconds: dict[str, float] = {}

    def add(self, **seconds: float) -> None:
        with self._lock:
            for k, v in seconds.items():
                self.seconds[k] = self.seconds.get(k, 0.0) + v


def direct_ok(folder: Path) -> bool:
    return probe_direct(folder) is None


class ChunkWriter:
    """One file made of `parts` (uint8 tensors, in order), written chunk by chunk on a Pool. `tasks()` are its
    chunks; when the last one is written the file is truncated to size, fsynced and closed, `info` holds its
    manifest entry and `on_done()` runs (on that pool thread). checksums=False: no sha256 (an export, whose files
    no manifest lists: the time goes to the disk)."""

    def __init__(self, path: Path, parts: list, direct: bool, on_done: Callable | None = None,
                 checksums: bool = True, source=None, stats: IOStats | None = None):
        """source: where each chunk's parts are taken at the time it is gathered (`enter()` -> parts, `leave(parts)`
        after: a checkpoint unit whose bytes move to a staged copy mid-write, checkpoint/saver.py), else `parts`.
        stats: an IOStats, told each chunk's seconds of gather, hash and write, and the file's fsync."""
        self.path, self.parts, self.on_done, self.checksums = Path(path), parts, on_done, checksums
        self.source, self.stats = source, stats
        self.size = sum(part_bytes(p) for p in parts)
        self.n = max(1, -(-self.size // CHUNK))
        self.hashes: list[str | None] = [None] * self.n
        self.direct = direct
        self._left, self._lock = self.n, threading.Lock()
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0), 0o644)
        self.info: dict | None = None
        try:  # the last chunk is written padded to a page (O_DIRECT), then the file truncated to its size
            preallocate(self.fd, -(-self.size // PAGE) * PAGE if direct else self.size)
        except BaseException:
            self.close()
            raise

    def submit(self, pool: Pool, chunks=None) -> list[Future]:
        """Queue the file's chunks (`chunks`: those indices, else all) on the pool."""
        return [pool.submit(self._chunk, pool, k) for k in (range(self.n) if chunks is None else chunks)]

    def _chunk(self, pool: Pool, k: int) -> None:
        a, b = k * CHUNK, min(self.size, (k + 1) * CHUNK)
        buf = pool.bounce()
        t0 = time.perf_counter()
        if self.source is None:
            gather(self.parts, a, b, buf)
        else:
            parts = self.source.enter()
            try:
                gather(parts, a, b, buf)
            finally:
                self.source.leave(parts)
        t1 = time.perf_counter()
        if self.checksums:
            self.hashes[k] = hashlib.sha256(_mv(buf[:b - a])).hexdigest()
        t2 = time.perf_counter()
        n = b - a
        if self.direct and n % PAGE:
            m = -(-n // PAGE) * PAGE
            buf[n:m].zero_()
            n = m
        transfer(self.fd, _mv(buf[:n]), a, True)
        t3 = time.perf_counter()
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if self.stats is not None:
            self.stats.add(gather_s=t1 - t0, hash_s=t2 - t1, write_s=t3 - t2)
        if last:
            if self.direct and self.size % PAGE:
                os.ftruncate(self.fd, self.size)
            os.fsync(self.fd)
            if self.stats is not None:
                self.stats.add(fsync_s=time.perf_counter() - t3)
            self.close()
            self.info = {"bytes": self.size, "chunk_bytes": CHUNK}
            if self.checksums:
                self.info["sha256_chunks"] = list(self.hashes)
            if self.on_done is not None:
                self.on_done()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def preallocate(fd: int, size: int) -> None:
    """Reserve a new file's blocks before its chunks are written (fallocate). Without it every O_DIRECT write of a
    fresh file extends it and allocates its blocks on the write's path: ext4 then takes the file's lock exclusively
    for the whole request, so the pool's requests to one file go one at a time (writes into allocated blocks inside
    the file's size share the lock, and a full disk fails here, before any chunk is written). A filesystem without
    fallocate is written as before."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS):
            raise


def gather(parts: list, a: int, b: int, out: torch.Tensor) -> None:
    """Bytes [a, b) of the concatenation of `parts` into out[:b - a]. A part is a uint8 tensor (its bytes), or
    (tensor, dtype): that flat tensor cast to dtype, cast here, straight into `out` (an export's fp32 -> bf16)."""
    pos = 0
    for p in parts:
        n = part_bytes(p)
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            if isinstance(p, tuple):  # every offset is a multiple of the element size: whole elements
                src, dtype = p
                e = dtype.itemsize
                out[lo - a: hi - a].view(dtype).copy_(src[(lo - pos) // e: (hi - pos) // e])
            else:
                copy_bytes(out[lo - a: hi - a], p[lo - pos: hi - pos])
        pos += n
        if pos >= b:
            break


def part_bytes(p) -> int:
    return p[0].numel() * p[1].itemsize if isinstance(p, tuple) else p.numel()


class ChunkReader:
    """One file read chunk by chunk on a Pool into `dest`: (file offset, uint8 tensor or None) covering the file in
    order (None: bytes that are read and hashed but kept nowhere). Chunks whose bytes all go nowhere are not read
    when `skip_unused` (an export reads only the masters). Every chunk read is checked against `info`
    (its manifest entry: bytes, chunk_bytes, sha256_chunks) before its task ends; a mismatch names the file."""

    def __init__(self, path: Path, info: dict, dest: list[tuple[int, torch.Tensor | None, int]],
                 skip_unused: bool = False, on_done: Callable | None = None, direct: bool = False):
        """dest: (offset, tensor or None, length) in file order, covering [0, info['bytes'])."""
        self.path, self.info, self.dest, self.on_done = Path(path), info, dest, on_done
        self.chunk = int(info["chunk_bytes"])
        self.size = int(info["bytes"])
        self.n = len(info["sha256_chunks"])
        if self.n != max(1, -(-self.size // self.chunk)) or self.chunk <= 0:
            raise MegatrainError(f"{self.path}: its manifest entry lists {self.n} chunk checksums for "
                                 f"{self.size} bytes")
        self.skip_unused = skip_unused
        self.direct = direct and self.chunk % PAGE == 0 and self.chunk <= CHUNK
        self._left, self._lock = 0, threading.Lock()
        self.fd = -1

    def submit(self, pool: Pool) -> list[Future]:
        ks = [k for k in range(self.n) if not (self.skip_unused and self._unused(k))]
        self._left = len(ks)
        if not ks:
            if self.on_done is not None:
                self.on_done()
            return []
        if self.direct:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:  # a filesystem without O_DIRECT: buffered reads
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(self.path, os.O_RDONLY)
        return [pool.submit(self._chunk, pool, k) for k in ks]

    def _span(self, k: int) -> tuple[int, int]:
        return k * self.chunk, min(self.size, (k + 1) * self.chunk)

    def _unused(self, k: int) -> bool:
        a, b = self._span(k)
        return all(t is None for off, t, n in self.dest if off < b and off + n > a)

    def _chunk(self, pool: Pool, k: int) -> None:
        a, b = self._span(k)
        if self.direct:
            self._direct(pool, k, a, b)
        else:
            self._buffered(pool, k, a, b)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.close()
            if self.on_done is not None:
                self.on_done()

    def _direct(self, pool: Pool, k: int, a: int, b: int) -> None:
        """O_DIRECT into the thread's aligned buffer, hashed, then copied to the tensors: nothing in the page cache."""
        buf = pool.bounce()
        m = -(-(b - a) // PAGE) * PAGE
        mv, done = _mv(buf[:m]), 0
        while done < b - a:
            got = os.preadv(self.fd, [mv[done:]], a + done)
            if got <= 0:
                raise MegatrainError(f"{self.path}: truncated (ends at byte {a + done})")
            done += got
        self._check(k, a, b, [_mv(buf[:b - a])])
        for off, t, n in self.dest:
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi and t is not None:
                copy_bytes(t[lo - off: hi - off], buf[lo - a: hi - a])

    def _check(self, k: int, a: int, b: int, views) -> None:
        h = hashlib.sha256()
        for v in views:
            h.update(v)
        if h.hexdigest() != self.info["sha256_chunks"][k]:
            raise MegatrainError(f"{self.path}: checksum mismatch in bytes {a}-{b} (chunk {k + 1} of {self.n}): the "
                                 f"file is corrupted")

    def _buffered(self, pool: Pool, k: int, a: int, b: int) -> None:
        h = hashlib.sha256()
        for off, t, n in self.dest:
            lo, hi = max(a, off), min(b, off + n)
            if lo >= hi:
                continue
            if t is not None:  # straight into the tensor it belongs to
                v = _mv(t[lo - off: hi - off])
                read_all(self.fd, [v], lo, self.path)
                h.update(v)
                continue
            scratch = pool.scratch()  # bytes kept nowhere: read through a small buffer, hashed in order
            for x in range(lo, hi, len(scratch)):
                v = scratch[: min(len(scratch), hi - x)]
                read_all(self.fd, [v], x, self.path)
                h.update(v)
        if h.hexdigest() != self.info["sha256_chunks"][k]:
            raise MegatrainError(f"{self.path}: checksum mismatch in bytes {a}-{b} (chunk {k + 1} of {self.n}): the "
                                 f"file is corrupted")
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, a, b - a, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def read_all(fd: int, views: list[memoryview], offset: int, path: Path) -> None:
    """preadv until every view is full; a short file is named (truncated)."""
    views = [v.cast("B") for v in views]
    while views:
        n = os.preadv(fd, views, offset)
        if n <= 0:
            raise MegatrainError(f"{path}: truncated (ends at byte {offset})")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def wait_all(pool: Pool, futures: list[Future]) -> None:
    """Wait for `futures`; raise the pool's first error (the others were skipped)."""
    for f in futures:
        try:
            f.result()
        except BaseException:
            pass
    pool.check()
