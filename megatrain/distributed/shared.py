"""One host store per node: memory that every rank of the node maps, and the flags the ranks share in it.

`NodeMemory.allocate` is the HostStore's allocator in a distributed run (runtime/store.py's `allocate` seam):
local rank 0 creates an anonymous shared-memory file (memfd) of the size asked, publishes "<pid>:<fd>" in the
rendezvous store, and every other rank of the node opens /proc/<pid>/fd/<fd> and maps the same pages. So the node
holds one copy of the fp32 master, Adam m and v and the streaming copy however many ranks it runs, each rank
registers the same pages for DMA (cudaHostRegister, runtime/pinned.py) and streams them to its own GPU. A memfd
is not limited by /dev/shm's size and leaves nothing behind: its pages are freed when the last rank unmaps them,
whatever way the run ends. Fresh pages read as zero. The files' descriptors are closed once every rank has mapped
them (`release_files`); the mappings stay.

Each rank faults in its own 1/local_size of every allocation's pages as it maps it (`populate`: madvise
MADV_POPULATE_WRITE, which allocates the pages without changing what they hold, so it cannot race with local rank
0 filling the store). Otherwise Adam m and v, which nothing writes before the first update, would be faulted in by
the optimizer during the first steps. Measured on an nvidia-h100-x4: in a 2-rank Qwen2.5-7B run each
rank's resident memory grew from 45 to 73 GiB during the first measured step, whose GPU was busy 51-64% of the time
against 89% in the next step; that machine wrote fresh pages at 16 GB/s, and 74 GB/s once they were there. The pages
are wanted from the start in any case (the plan counts them), and a node short of memory now fails while the store
is made, not in the middle of a step.

`NodeFlags` are small shared counters in the same kind of memory:
    done[u, r]    the number of optimizer steps whose update of local rank r's shard of unit u is written; a rank
                  streams unit u for step t+1 only once every rank's done[u, :] reaches t (`wait_updated`)
    saving        the step being saved by rank 0 (0: none yet), and written[u]: the step whose unit u the
                  checkpoint writer has written; a rank updates its shard of unit u only when written[u] has
                  reached `saving` (`wait_written`), so a background save reads one step's state, as with one rank
Each counter has one writer. Writes are plain aligned 8-byte stores made after the data they announce was written
(and after a lock release between threads); readers poll.
"""

from __future__ import annotations

import errno
import mmap
import os
import time

import torch

from ..errors import MegatrainError
from ..runtime.pinned import PAGE
from .world import World

POLL_S = 0.0002
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14; Python's constant from 3.13 only


def wait_key(store, key: str) -> bytes:
    """The value of `key`, waiting as long as it takes (the watchdog ends the wait if a rank fails)."""
    while not store.check([key]):
        time.sleep(0.01)
    return store.get(key)


class NodeMemory:
    def __init__(self, store, world: World):
        """store: the rendezvous store (keys under this run's prefix)."""
        self.store, self.world = store, world
        self._count = 0
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []  # kept alive as long as this object: tensors view them
        self.bytes = 0

    def allocate(self, numel: int, dtype: torch.dtype, zero: bool = False, what: str = "host store") -> torch.Tensor:
        """A flat tensor of `numel` elements in memory shared by the node's ranks; every local rank calls it with
        the same sizes in the same order. Fresh memory is zero (`zero` is satisfied by construction)."""
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(PAGE, -(-numel * esize // PAGE) * PAGE)
        key = f"shm/{self.world.node}/{self._count}"
        self._count += 1
        if self.world.fills_store:
            fd = os.memfd_create(f"megatrain-{what.replace(' ', '-')}", os.MFD_CLOEXEC)
            try:
                os.ftruncate(fd, nbytes)
            except OSError as e:
                os.close(fd)
                raise MegatrainError(f"shared host store: could not create {nbytes / 2**30:.2f} GiB of shared "
                                     f"memory for the {what} ({e})") from None
            self.store.set(key, f"{os.getpid()}:{fd}")
        else:
            pid, rfd = wait_key(self.store, key).decode().split(":")
            path = f"/proc/{pid}/fd/{rfd}"
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except OSError as e:
                raise MegatrainError(f"shared host store: {self.world.describe()} could not open local rank 0's "
                                     f"shared memory {path} ({e}); the ranks of a node must run as the same user "
                                     f"in the same process namespace") from None
        self._fds.append(fd)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(mm)
        self.populate(mm, nbytes, what)
        self.bytes += nbytes
        return torch.frombuffer(mm, dtype=dtype, count=numel)

    def populate(self, mm: mmap.mmap, nbytes: int, what: str) -> int:
        """Fault in this local rank's share of the mapping's pages (the other ranks fault in theirs at the same
        time); what they hold is unchanged. Returns the bytes populated (0 where the kernel lacks the advice, which
        leaves the pages to be faulted in on first use, as before)."""
        pages = nbytes // PAGE
        per = -(-pages // self.world.local_size)
        lo = min(pages, self.world.local_rank * per) * PAGE
        hi = min(pages, (self.world.local_rank + 1) * per) * PAGE
        if hi <= lo:
            return 0
        try:
            mm.madvise(MADV_POPULATE_WRITE, lo, hi - lo)
        except OSError as e:
            if e.errno in (errno.EINVAL, errno.ENOSYS):  # a kernel before 5.14
                return 0
            raise MegatrainError(f"shared host store: {self.world.describe()} could not allocate its share "
                                 f"({(hi - lo) / 2**30:.2f} GiB) of the {what} ({e}); the node's memory is short "
                                 f"of what the plan counted (`megatrain plan` with memory.host_budget_gb set to "
                                 f"what is free)") from None
        return hi - lo

    def release_files(self) -> None:
        """Close the descriptors once every local rank has mapped the memory (the mappings keep it)."""
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


class NodeFlags:
    def __init__(self, memory: NodeMemory, num_units: int, world: World):
        self.world = world
        self.done = memory.allocate(num_units * world.local_size, torch.int64, what="update flags") \
            .view(num_units, world.local_size).numpy()
        save = memory.allocate(1 + num_units, torch.int64, what="save flags").numpy()
        self.saving, self.written = save[:1], save[1:]

    # ---- updates --------------------------------------------------------------------------------------
    def publish(self, unit: int, steps: int) -> None:
        """This rank's shard of `unit` holds the update of step `steps` (1-based count of finished steps)."""
        self.done[unit, self.world.local_rank] = steps

    def wait_updated(self, unit: int, steps: int, timeout: float) -> None:
        """Until every local rank has written its shard of `unit` for `steps` steps."""
        row = self.done[unit]
        if row.min() >= steps:
            return
        t0 = time.monotonic()
        while row.min() < steps:
            if time.monotonic() - t0 > timeout:
                late = [r for r in range(self.world.local_size) if row[r] < steps]
                raise MegatrainError(f"{self.world.describe()}: local rank(s) {late} of node {self.world.node} have "
                                     f"not updated unit {unit} for step {steps} after {timeout:.0f} s")
            time.sleep(POLL_S)

    # ---- checkpoint saves (written by global rank 0's saver, read by its node's other ranks) ------------
    def begin_save(self, step: int) -> None:
        self.saving[0] = step

    def unit_written(self, step: int, unit: int) -> None:
        self.written[unit] = step

    def wait_written(self, unit: int) -> None:
        """Until the save in progress (if any) has written unit `unit`."""
        while self.written[unit] < self.saving[0]:
            time.sleep(POLL_S)
