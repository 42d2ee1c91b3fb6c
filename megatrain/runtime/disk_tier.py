"""The SSD tier: optimizer states that host RAM cannot hold, in per-unit files on a local disk (memory.disk_path).

When the planner places a state kind on disk (Adam v first, then m, then the fp32 master: memory.disk_states), the
host store keeps no RAM for it. Each unit's state of that kind is one file under a scratch folder of disk_path,
page-aligned (its size rounded up to a page). The optimizer updates a unit piece by piece (pieces of `piece`
elements, a multiple of adamw.CHUNK, so a piecewise update is bit-identical to a whole-tile one); for each piece it
`acquire`s the piece's states (every disk kind of it, in one cache slot), updates them, and `release`s it. Around
that:

    read-ahead    `acquire(u, a)` issues the reads of the next `depth` pieces in the update order (`set_order`:
                  forward order with clipping, gradient order without), wrapping round to the next step's first
                  units, so the disk works while the CPU updates and the next step's first reads start at once;
    write-behind  `release` issues the piece's writes and returns: the next piece's update does not wait for them;
    bounded cache a fixed ring of depth + 2 slots (one in use, `depth` read ahead, one being written), each one
                  page-aligned buffer of `piece` fp32 elements per disk kind, reused: the RAM the tier takes does
                  not grow with the model;
    consistency   a piece is read from its file only after its last write has completed (a piece still in the cache
                  is used from there; a slot is reused only once its write is done), and `read_unit` /
                  `write_unit` (checkpoints, resume, initialisation) go through the cache for pieces it holds;
    never written a piece not written since the tier opened (Adam m, v before the first update: holes) is zero-filled
                  in RAM, not read, and counted as no read: holes "read" at 8-11 GB/s on the GPU hosts' disks and
                  made the first optimizer pass look like a fast disk.

I/O: every piece's transfer is split into requests of `request` bytes (16 MiB: the GPU hosts' local disk measured
1.6 GB/s write, 1.2 GB/s read at that size with O_DIRECT) issued to a pool of `threads` worker threads, so many
requests are in flight at once. The files are opened with O_DIRECT (no page cache: the data would otherwise also
sit in the RAM the tier exists to save, and the kernel's copy would cost memory bandwidth the CPU AdamW needs);
a filesystem that refuses O_DIRECT (tmpfs, some network filesystems) gets buffered I/O and a one-line notice.

Why threads and not io_uring/libaio: `os.preadv`/`os.pwritev` release the GIL for the whole system call, so N
threads keep N requests in the device's queue, which is what an NVMe drive needs to reach its bandwidth at 16 MiB
requests; the per-request overhead of a thread hand-off (microseconds) is nothing beside a 16 MiB transfer (about
10 ms at 1.6 GB/s). io_uring would save those hand-offs and the threads, but Python has no io_uring in its
standard library and the maintained bindings (liburing wrappers) are thin, need a recent kernel and are often
disabled in containers (seccomp), and libaio needs a C extension: a dependency and a failure mode for no
measurable gain at this request size. The standard library's threads work everywhere Linux and O_DIRECT do.

Errors: a failed read or write (a full disk, an I/O error) makes the tier fail for good: the first error is kept
(`DiskTierError`, a MegatrainError naming memory.disk_path, the unit, the state and the cause) and raised by every
later call, whichever request or thread saw it first, since the files no longer hold the state once a write-behind
is lost; the run stops there and its last complete checkpoint is the state to resume from.

Scratch folders: each run's files live in its own `megatrain-ssd-*` folder, locked while the tier is open; a dead
run's folder is removed by the next tier on the same disk_path (disk_files.py: the folders, the O_DIRECT probe,
the check of memory.disk_path, the request loop).

Counters: bytes read and written, the seconds any read (write) was in flight and those any request was (reads and
writes overlap), for the step's metrics (`take_stats`). The scratch folder is removed by `close()` (or at exit):
the checkpoint, not these files, is the durable copy of the state.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MegatrainError
from .disk_files import check_disk_path, open_scratch, probe_direct, stale_folders, transfer
from .pinned import PAGE, aligned_empty

__all__ = ["DiskTier", "DiskTierError", "check_disk_path", "open_scratch", "probe_direct", "stale_folders",
           "transfer"]

REQUEST = 16 << 20  # bytes per read/write request
THREADS = 8  # requests in flight at most
DEPTH = 2  # pieces read ahead of the one being updated
KIND_NAMES = {"v": "exp_avg_sq", "m": "exp_avg", "master": "master"}  # memory.disk_states -> HostStore attribute
DISK_ORDER = ("v", "m", "master")  # cheapest to move first: v and m are read and written once per step, as the
#                                    master is, but the master also feeds the streaming copy (kept in RAM anyway)


STATE_NAMES = {"exp_avg_sq": "Adam v", "exp_avg": "Adam m", "master": "fp32 master"}


class DiskTierError(MegatrainError):
    """A read or write of the SSD tier failed: the run cannot go on from its files."""


def _round_page(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.view(torch.uint8).numpy())


@dataclass
class _Slot:
    bufs: dict[str, torch.Tensor]  # kind -> fp32 buffer of `piece` elements
    key: tuple[int, int] | None = None  # (unit, offset) whose states the buffers hold
    pending: list[Future] = field(default_factory=list)  # the read or write of `key` in flight
    users: int = 0  # acquired and not released (the optimizer), or being copied (read_unit)
    stamp: int = 0  # when last released: the oldest clean slot is reused first


class DiskTier:
    def __init__(self, path: str | Path, kinds: tuple[str, ...], unit_numels: list[int], piece: int,
                 depth: int = DEPTH, threads: int = THREADS, request: int = REQUEST, notice=None):
        """kinds: the HostStore attributes placed on disk ('exp_avg_sq', 'exp_avg', 'master'). unit_numels: each
        unit's parameters. piece: elements per cache slot and per update piece (a multiple of adamw.CHUNK)."""
        if piece * 4 % PAGE or request % PAGE:
            raise ValueError("pieces and requests must be whole pages")
        self.kinds, self.numels, self.piece, self.depth, self.request = tuple(kinds), list(unit_numels), piece, \
            depth, request
        root = check_disk_path(str(path))
        self.root, self._error = root, None  # _error: the first failed request's DiskTierError, raised from then on
        say = notice or (lambda m: print(m, file=sys.stderr, flush=True))
        if stale := stale_folders(root):
            for d, _ in stale:
                shutil.rmtree(d, ignore_errors=True)
            say(f"megatrain: memory.disk_path {root}: removed the SSD tier's files of {len(stale)} earlier run(s) "
                f"that did not end ({sum(b for _, b in stale) / 2**30:.2f} GiB)")
        self.dir, self._lock_fd = open_scratch(root)
        try:
            self.refused = probe_direct(self.dir)  # None: O_DIRECT
        except OSError as e:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._lock_fd)
            raise MegatrainError(f"memory.disk_path {root}: the disk is full ({e.strerror}); make room on it or set "
                                 f"memory.disk_path to another") from None
        if self.refused is not None:
            say(
                f"megatrain: memory.disk_path {root}: O_DIRECT refused ({self.refused}); the SSD tier uses buffered "
                f"I/O (the page cache may hold what the tier moves out of RAM)")
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (0 if self.refused else os.O_DIRECT)
        self.fds: dict[tuple[int, str], int] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="megatrain-ssd")
        self._finalizer = weakref.finalize(self, _cleanup, self._pool, self.fds, self.dir, self._lock_fd)
        for i, n in enumerate(self.numels):
            for k in self.kinds:
                fd = os.open(self.dir / f"unit-{i:05d}.{k}.bin", flags, 0o600)
                self.fds[(i, k)] = fd
                os.ftruncate(fd, self.file_bytes(i))  # reads as zeros until written: Adam m, v start there
        self.slots = [_Slot({k: aligned_empty(piece, torch.float32, zero=True) for k in self.kinds})
                      for _ in range(depth + 2)]
        # (unit, kind) -> one flag per piece: 1 once a write of it was issued (until then the file holds a hole)
        self._written = {(i, k): bytearray(-(-n // piece)) for i, n in enumerate(self.numels) for k in self.kinds}
        self._lock = threading.Condition()  # guards the slots; notified when a slot's users drop
        self._clock = 0
        self.set_order(list(range(len(self.numels))))
        self._stats_lock = threading.Lock()
        self._inflight = {"read": 0, "write": 0, "any": 0}  # requests in flight; "any": either kind
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}
        self.stats = self._no_stats()

    # ---- sizes --------------------------------------------------------------------------------------
    def file_bytes(self, unit: int) -> int:
        return _round_page(4 * self.numels[unit])

    @property
    def disk_bytes(self) -> int:
        """Bytes the tier's files take on the disk."""
        return sum(self.file_bytes(i) for i in range(len(self.numels))) * len(self.kinds)

    @property
    def cache_bytes(self) -> int:
        return len(self.slots) * len(self.kinds) * self.piece * 4

    def pieces(self, unit: int) -> list[tuple[int, int]]:
        """(offset, elements) of each piece of a unit."""
        n = self.numels[unit]
        return [(a, min(self.piece, n - a)) for a in range(0, n, self.piece)]

    # ---- the optimizer's side ----------------------------------------------------------------------------
    def set_order(self, order: list[int]) -> None:
        """The order in which the coming updates take the units (read-ahead follows it, cyclically)."""
        seq = [(u, a) for u in order for a, _ in self.pieces(u)]
        with self._lock:
            if getattr(self, "_seq", None) != seq:
                self._seq, self._pos = seq, {k: p for p, k in enumerate(seq)}

    def acquire(self, unit: int, offset: int) -> dict[str, torch.Tensor]:
        """The states of piece (unit, offset), read from disk if the cache does not hold them (waits for that
        read); the next pieces in the update order are read ahead. Returns kind -> fp32 tensor of the piece."""
        self._raise_if_failed()
        key = (unit, offset)
        n = self._piece_len(key)
        with self._lock:
            slot = self._slot_of(key)
            if slot is None:
                slot = self._victim(self._window(key))
                self._read_into(slot, key)
            slot.users += 1
            pending = list(slot.pending)
            self._read_ahead(key)
        self._wait(pending)
        return {k: b[:n] for k, b in slot.bufs.items()}

    def release(self, unit: int, offset: int, dirty: bool = True) -> None:
        """Done with the piece: its states are written behind (dirty), the slot kept as a cache entry."""
        self._raise_if_failed()
        key = (unit, offset)
        with self._lock:
            slot = self._slot_of(key)
            if slot is None or slot.users <= 0:
                raise RuntimeError(f"release of piece {key}, which was not acquired")
            slot.users -= 1
            self._lock.notify_all()
            self._clock += 1
            slot.stamp = self._clock
            if dirty:
                slot.pending = self._transfer(slot, key, write=True)
            self._read_ahead(key)

    def flush(self) -> None:
        """Wait for every write issued (a write error is raised here, or any earlier one)."""
        with self._lock:
            pending = [f for s in self.slots for f in s.pending]
        self._wait(pending)
        self._raise_if_failed()

    # ---- whole units: checkpoints, resume, initialisation ------------------------------------------
    def read_unit(self, unit: int, kind: str, out: torch.Tensor) -> None:
        """Copy a unit's state of `kind` into `out` (flat fp32, page-aligned, at least file_bytes(unit) / 4
        elements): from the cache for the pieces it holds (after their write or read completes), else the file."""
        self._raise_if_failed()
        for a, n in self.pieces(unit):
            key = (unit, a)
            with self._lock:
                slot = self._slot_of(key)
                if slot is not None:
                    slot.users += 1
                    pending = list(slot.pending)
            if slot is not None:
                try:
                    self._wait(pending)
                    out[a:a + n].copy_(slot.bufs[kind][:n])
                finally:
                    with self._lock:
                        slot.users -= 1
                        self._lock.notify_all()
            elif not self._written[(unit, kind)][a // self.piece]:
                out[a:a + n].zero_()  # a hole: zeros, no read
            else:
                self._wait(self._io(self.fds[(unit, kind)], _bytes(out[a:a + self._io_elems(key)]), 4 * a, False))

    def write_unit(self, unit: int, kind: str, src: torch.Tensor) -> None:
        """Store `src` (flat fp32, page-aligned, at least file_bytes(unit) / 4 elements) as the unit's state of
        `kind`. Only while no piece of the unit is acquired (before training, or between steps)."""
        self._raise_if_failed()
        for a, n in self.pieces(unit):
            key = (unit, a)
            with self._lock:
                slot = self._slot_of(key)
                if slot is not None:
                    if slot.users:
                        raise RuntimeError(f"write_unit: piece {key} is in use")
                    self._wait(slot.pending)
                    slot.bufs[kind][:n].copy_(src[a:a + n])  # the cached copy stays valid (other kinds unchanged)
            self._written[(unit, kind)][a // self.piece] = 1
            self._wait(self._io(self.fds[(unit, kind)], _bytes(src[a:a + self._io_elems(key)]), 4 * a, True))

    # ---- counters ------------------------------------------------------------------------------------
    @staticmethod
    def _no_stats() -> dict:
        return {"read_bytes": 0, "write_bytes": 0, "read_busy_s": 0.0, "write_busy_s": 0.0, "any_busy_s": 0.0}

    def take_stats(self) -> dict:
        """Bytes read and written since the last call, the seconds any read (write) was in flight, and the seconds
        any request of either kind was (any_busy_s: reads and writes overlap, so it is at most the sum); a reset."""
        with self._stats_lock:
            now = time.perf_counter()
            for op in ("read", "write", "any"):  # close the busy interval in progress, and reopen it
                if self._inflight[op]:
                    self.stats[f"{op}_busy_s"] += now - self._since[op]
                    self._since[op] = now
            stats, self.stats = self.stats, self._no_stats()
        return stats

    def close(self) -> None:
        """Wait for the writes, stop the I/O threads, remove the scratch folder."""
        try:
            self.flush()
        finally:
            self._finalizer()

    # ---- internals (the caller holds self._lock where noted) -----------------------------------------
    def _piece_len(self, key) -> int:
        unit, a = key
        return min(self.piece, self.numels[unit] - a)

    def _io_elems(self, key) -> int:
        """Elements a piece's transfer covers: its length rounded up to a page (O_DIRECT), within the file."""
        return _round_page(4 * self._piece_len(key)) // 4

    def _slot_of(self, key):  # lock held
        for s in self.slots:
            if s.key == key:
                return s
        return None

    def _window(self, key) -> set:  # lock held: the piece and those read ahead of it
        p = self._pos.get(key)
        if p is None:
            return {key}
        return {key} | {self._seq[(p + d) % len(self._seq)] for d in range(1, self.depth + 1)}

    def _victim(self, keep: set) -> _Slot:
        """A slot to load another piece into (lock held): unused, not holding a piece of the window; an idle one
        first, then the least recently released; waits for its write if one is in flight, and for a user to let
        go of one if every other slot is in use (a checkpoint's copy out of the cache)."""
        while not (free := [s for s in self.slots if s.users == 0 and s.key not in keep]):
            self._lock.wait(timeout=1.0)
        idle = [s for s in free if all(f.done() for f in s.pending)]
        slot = min(idle or free, key=lambda s: (s.key is not None, s.stamp))
        self._wait(slot.pending)
        slot.key, slot.pending = None, []
        return slot

    def _read_into(self, slot: _Slot, key) -> None:  # lock held
        slot.key = key
        slot.pending = self._transfer(slot, key, write=False)

    def _read_ahead(self, key) -> None:  # lock held: issue the reads of the window's pieces not cached yet
        p = self._pos.get(key)
        if p is None:
            return
        window = self._window(key)
        for d in range(1, self.depth + 1):
            nxt = self._seq[(p + d) % len(self._seq)]
            if self._slot_of(nxt) is not None:
                continue
            idle = [s for s in self.slots if s.users == 0 and s.key not in window and all(f.done() for f in s.pending)]
            if not idle:
                return  # every other slot is busy: the next acquire or release tries again
            slot = min(idle, key=lambda s: (s.key is not None, s.stamp))
            self._read_into(slot, nxt)

    def _transfer(self, slot: _Slot, key, write: bool) -> list[Future]:
        """The piece's reads (writes) of every disk kind, issued; a read of a piece never written zero-fills the
        slot's buffer on an I/O thread instead (lock held for the flags)."""
        unit, a = key
        m = self._io_elems(key)
        out = []
        for k in self.kinds:
            flags, p = self._written[(unit, k)], a // self.piece
            if write:
                flags[p] = 1
            elif not flags[p]:
                out.append(self._pool.submit(slot.bufs[k][:m].zero_))
                continue
            out += self._io(self.fds[(unit, k)], _bytes(slot.bufs[k][:m]), 4 * a, write)
        return out

    def _io(self, fd: int, mv: memoryview, offset: int, write: bool) -> list[Future]:
        return [self._pool.submit(self._request, fd, mv[b: b + self.request], offset + b, write)
                for b in range(0, len(mv), self.request)]

    def _request(self, fd: int, mv: memoryview, offset: int, write: bool) -> None:
        """One request, on an I/O thread (the system call releases the GIL); partial transfers are continued."""
        op = "write" if write else "read"
        with self._stats_lock:
            now = time.perf_counter()  # one clock reading for both counters: "any" spans at least `op`
            for o in (op, "any"):
                if not self._inflight[o]:
                    self._since[o] = now
                self._inflight[o] += 1
        moved = [0]
        try:
            transfer(fd, mv, offset, write, moved)
        except OSError as e:
            self._failed(op, fd, e)
            raise
        finally:
            with self._stats_lock:
                self.stats[f"{op}_bytes"] += moved[0]
                now = time.perf_counter()
                for o in (op, "any"):
                    self._inflight[o] -= 1
                    if not self._inflight[o]:
                        self.stats[f"{o}_busy_s"] += now - self._since[o]

    def _wait(self, futures: list[Future]) -> None:
        if futures:
            wait(futures)
            self._raise_if_failed()  # the tier's error, whichever request failed first
            for f in futures:
                f.result()  # anything else a request raised

    def _failed(self, op: str, fd: int, e: OSError) -> None:
        """Keep the first failure (on an I/O thread): every later call raises it."""
        unit, kind = next((k for k, v in self.fds.items() if v == fd), (None, None))
        what = f"unit {unit}'s {STATE_NAMES.get(kind, kind)} ({self.dir / f'unit-{unit:05d}.{kind}.bin'})" \
            if unit is not None else "a file"
        cause = e.strerror or str(e)
        err = DiskTierError(f"memory.disk_path {self.root}: the SSD tier's {op} of {what} failed: {cause}. The run "
                            f"stops (the tier's files no longer hold the optimizer's state); the checkpoints it saved "
                            f"are intact: make room on the disk, or set memory.disk_path to another, and resume "
                            f"(resume=auto; with no checkpoint yet the run starts again)")
        with self._stats_lock:
            if self._error is None:
                self._error = err

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


def _cleanup(pool: ThreadPoolExecutor, fds: dict, folder: Path, lock_fd: int) -> None:
    pool.shutdown(wait=True)
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()
    shutil.rmtree(folder, ignore_errors=True)
    os.close(lock_fd)  # the lock last: the folder is gone before another run could take it for stale
