"""How fast the SSD tier's disk moves data: the read and write rates the planner times memory.disk_path with.

Measured the way the tier moves the optimizer's states (disk_tier.py): O_DIRECT (buffered I/O where the filesystem
refuses it, as the tier then falls back to), requests of REQUEST bytes, THREADS of them in flight at once from a
pool of I/O threads (the system calls release the GIL). First `nbytes` of random bytes are written (not zeros: a
thin-provisioned or compressing disk stores zeros for nothing), then read back; each rate is the bytes over the
wall seconds of its phase, the rate a step sees while the tier keeps its queue full.

Why not `dd`: one request in flight, where the tier keeps THREADS. On the GPU hosts' virtual disks the two agree
within about 30% (nvidia-h100-x1: `dd` 1.1 read / 1.2 write GB/s, this measurement 1.46 / 1.81 over 8 GiB), but
nothing says a real NVMe drive is as forgiving: they need many requests in flight to reach their rate.

What the measurement must match is a steady step's disk, and reads of data the tier wrote a step earlier: on
nvidia-h200-x2's H100 host a steady step (the third: the first update pass reads only never-written regions, which
the tier no longer asks the disk for) read 1.35-1.50 GB/s and wrote 1.40-1.64,
while this measurement at the start of those runs gave 1.64 / 1.82 and, minutes later on the same machine,
1.38 / 1.17: over 2 GiB a virtual disk's burst and its background work show. START_BYTES is therefore 8 GiB: on
this project's CI machine's disk, 2 GiB runs read 3.80, 1.19, 1.53 and 1.54 GB/s in a row and 8 GiB runs 1.35 and
1.44 (writes 3.74, 2.45, 2.59, 2.64 against 2.46, 2.54). The file lives in a scratch folder of the tier's kind (its
lock held while it exists: a probe killed half-way leaves a folder the next tier removes) and is deleted.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import MegatrainError
from .disk_files import check_disk_path, open_scratch, probe_direct, transfer
from .disk_tier import REQUEST, THREADS
from .pinned import aligned_empty

START_BYTES = 8 << 30  # what `megatrain train` writes and reads at its start when memory.disk_path is set and the
#                        profile does not state the disk (about 10 s on the GPU hosts' disks; at most half the free
#                        space)


def measure_disk(path: str | Path, nbytes: int = START_BYTES, threads: int = THREADS, request: int = REQUEST,
                 key: str = "memory.disk_path") -> dict:
    """Write then read `nbytes` (rounded down to whole requests, at least one; at most half the free space) in a
    scratch folder of `path`. Returns read_bps, write_bps, bytes, request, threads, direct (O_DIRECT used), path.
    MegatrainError naming `key` when the folder is unusable or an I/O call fails; nothing is left behind."""
    root = check_disk_path(str(path), key)
    free = shutil.disk_usage(root).free
    n = min(max(1, nbytes // request), free // 2 // request)  # at least one request
    if n < 1:
        raise MegatrainError(f"{key}: {root} has {free / 2**20:.0f} MiB free, too little to measure the disk "
                             f"(one request is {request >> 20} MiB)")
    folder, lock_fd = open_scratch(root, "probe-")
    try:
        refused = probe_direct(folder)
        flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC | (0 if refused else os.O_DIRECT)
        # one page-aligned buffer per request in flight: the contents do not matter once written
        bufs = [aligned_empty(request, torch.uint8, zero=False).random_(0, 256) for _ in range(threads)]
        views = [memoryview(b.numpy()) for b in bufs]
        fd = os.open(folder / "probe.bin", flags, 0o600)
        try:
            rates = {}
            with ThreadPoolExecutor(threads, thread_name_prefix="megatrain-disk-probe") as pool:
                for op in ("write", "read"):
                    t0 = time.perf_counter()
                    for _ in pool.map(lambda i: transfer(fd, views[i % threads], i * request, op == "write"),
                                      range(n)):
                        pass
                    rates[op] = n * request / (time.perf_counter() - t0)
        finally:
            os.close(fd)
    except OSError as e:
        raise MegatrainError(f"{key}: measuring the disk at {root} failed: {e.strerror or e}") from None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock_fd)
    return {"read_bps": rates["read"], "write_bps": rates["write"], "bytes": n * request, "request": request,
            "threads": threads, "direct": refused is None, "path": str(root)}


def describe(d: dict) -> str:
    """One line for the start summary and the profile's log."""
    how = "O_DIRECT" if d["direct"] else "buffered (O_DIRECT refused)"
    return (f"disk at {d['path']}: read {d['read_bps'] / 1e9:.2f} GB/s, write {d['write_bps'] / 1e9:.2f} GB/s "
            f"({d['bytes'] / 2**30:.1f} GiB, {d['threads']} x {d['request'] >> 20} MiB requests in flight, {how})")
