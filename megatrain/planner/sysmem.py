"""What this machine has: host RAM free (honouring cgroup limits, not only /proc/meminfo), disk free, memlock.

A container's limit is often far below the host's MemAvailable: the usable amount is the smallest of
MemAvailable and, for every cgroup from ours up to the root, limit - usage + reclaimable page cache.
Only the standard library is used, so `python3 -m megatrain.planner.probe` runs where pydantic is not installed.
"""

from __future__ import annotations

import os
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path

UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (9223372036854771712)


@dataclass
class HostMemory:
    total: int  # bytes this process may ever use: min(MemTotal, cgroup limits)
    available: int  # bytes it may allocate now
    source: str  # where the binding figure came from, for the report

    def to_dict(self) -> dict:
        return {"total_bytes": self.total, "available_bytes": self.available, "source": self.source}


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path) -> dict[str, int]:
    out = {}
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    try:
        for line in Path(path).read_text().splitlines():
            k, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def _cgroup_dirs(root: Path, rel: str) -> list[Path]:
    """Our cgroup directory and its ancestors up to the mount root (limits of ancestors apply too). Inside a
    cgroup namespace /proc/self/cgroup may name a path that is not under the mount: then the mount root is ours."""
    rel = rel.strip("/")
    here = root / rel if rel else root
    if not here.is_dir():
        return [root]
    dirs = [here]
    while here != root:
        here = here.parent
        dirs.append(here)
    return dirs


def cgroup_limits(proc_cgroup: str = "/proc/self/cgroup", mount: str = "/sys/fs/cgroup") -> list[tuple[str, int, int]]:
    """[(description, limit, usage minus reclaimable cache)] for each cgroup level with a memory limit."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return []
    root = Path(mount)
    v1 = next((l.split(":", 2)[2] for l in lines if l.split(":")[1:2] and "memory" in l.split(":")[1].split(",")),
              None)
    out = []
    if v1 is not None and (root / "memory").is_dir():  # cgroup v1
        for d in _cgroup_dirs(root / "memory", v1):
            limit = _read_int(d / "memory.limit_in_bytes")
            usage = _read_int(d / "memory.usage_in_bytes")
            if limit is None or usage is None or limit >= UNLIMITED:
                continue
            st = _stat(d / "memory.stat")
            reclaimable = st.get("total_inactive_file", st.get("inactive_file", 0))
            out.append((f"cgroup v1 {d}/memory.limit_in_bytes", limit, max(0, usage - reclaimable)))
        return out
    v2 = next((l.split(":", 2)[2] for l in lines if l.startswith("0::")), None)
    if v2 is not None:
        for d in _cgroup_dirs(root, v2):
            limit = _read_int(d / "memory.max")
            usage = _read_int(d / "memory.current")
            if limit is None or usage is None or limit >= UNLIMITED:
                continue
            reclaimable = _stat(d / "memory.stat").get("inactive_file", 0)
            out.append((f"cgroup v2 {d}/memory.max", limit, max(0, usage - reclaimable)))
    return out


def host_memory() -> HostMemory:
    info = meminfo()
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable", info.get("MemFree", total))
    source = "/proc/meminfo MemAvailable"
    for desc, limit, used in cgroup_limits():
        if limit < total:
            total = limit
        if limit - used < available:
            available, source = max(0, limit - used), desc
    return HostMemory(int(total), int(available), source)


def disk_free(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    p = Path(path).expanduser().absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK soft limit in bytes (None: unlimited)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def rss_bytes() -> int:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
