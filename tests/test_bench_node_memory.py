"""bench_cli's host-memory sampler reads kernel counters only: reading a training process's smaps walks its page
tables under its memory-map lock and stalls its page faults (bench/results/stall-smaps-sampler-...). It still sees
a child's anonymous memory, and a shared-memory file counted once however many processes map it."""

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_cli import NodeMemory  # noqa: E402

MiB = 2**20

# a child that maps 160 MiB of a memfd (shared memory, as the ranks' store) and, in its own child, maps and touches
# the same file again; and touches 96 MiB of anonymous memory itself
CHILD = """
import mmap, os, subprocess, sys, time
fd = os.memfd_create("store")
os.ftruncate(fd, 160 << 20)
shared = mmap.mmap(fd, 160 << 20, mmap.MAP_SHARED)
shared.write(b"x" * (160 << 20))
anon = bytearray(b"y" * (96 << 20))
grand = subprocess.Popen([sys.executable, "-c",
    "import mmap, sys, time; m = mmap.mmap(int(sys.argv[1]), 160 << 20, mmap.MAP_SHARED); m.read(); "
    "print('ready', flush=True); time.sleep(60)", str(fd)], pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
grand.stdout.readline()
print("ready", flush=True)
time.sleep(60)
"""


def test_the_sampler_reads_counters_not_smaps_and_counts_shared_memory_once(monkeypatch):
    read = []
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (read.append(self.name), real(self, *a, **k))[1])
    mem = NodeMemory()
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        mem.sample(child.pid)
    finally:
        for pid in reversed(NodeMemory._tree(child.pid)):
            os.kill(pid, 9)
        child.wait()
    out = mem.stop()
    assert not [n for n in read if "smaps" in n], read
    parts = out["host_rss_parts_gib"]
    assert parts["anon"] * 2**30 >= 96 * MiB and parts["shmem"] * 2**30 >= 160 * MiB
    node = out["host_node_rss_gib"] * 2**30
    # the shared file once (both processes map all of it: their RSS counts it twice), the child's anonymous memory
    # and the two interpreters' few MiB: below what counting the file twice would give
    assert 160 * MiB + 96 * MiB <= node < 2 * 160 * MiB + 96 * MiB, node / MiB
    assert out["host_children_rss_gib"] * 2**30 >= 160 * MiB  # the grandchild's RSS holds the file it touched
