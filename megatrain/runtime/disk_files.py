"""The SSD tier's files, for disk_tier.py and the disk probe: the scratch folders, the O_DIRECT probe, the check
of memory.disk_path, and the request loop.

Scratch folders: each run's files live in its own `megatrain-ssd-*` folder, which holds a lock (flock on its
`.lock` file) for as long as the tier is open. A run that died without closing it (kill -9, the OOM killer, a lost
machine) leaves its folder, unlocked: the next tier on the same disk_path removes such folders first and says so,
and the planner counts their bytes as free (`stale_folders`). A folder whose lock is held belongs to a live run and
is left alone, as is one without a lock file (not this code's).

Every read and write goes through `transfer`, which continues after a partial transfer and counts the bytes as
they move, so a failed request still reports what it moved.
"""

from __future__ import annotations

import fcntl
import errno
import os
import tempfile
from pathlib import Path

import torch

from ..errors import MegatrainError
from .pinned import PAGE, aligned_empty


def probe_direct(folder: Path) -> str | None:
    """None when `folder`'s filesystem accepts O_DIRECT reads and writes of a page; else the reason it does not. A
    full disk (ENOSPC, EDQUOT) is raised: it says nothing of O_DIRECT."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return "this platform has no O_DIRECT"
    path = Path(folder) / ".megatrain-odirect-probe"
    buf = aligned_empty(PAGE, torch.uint8, zero=True)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            os.pwritev(fd, [memoryview(buf.numpy())], 0)
            os.preadv(fd, [memoryview(buf.numpy())], 0)
        finally:
            os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):  # not a matter of O_DIRECT: nothing can be written there
            raise
        return e.strerror or str(e)
    finally:
        path.unlink(missing_ok=True)
    return None


SCRATCH_PREFIX = "megatrain-ssd-"
LOCK_NAME = ".lock"


def _held(lock: Path) -> bool:
    """Whether a live process holds the flock of a scratch folder's lock file (read-only probe)."""
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return True  # gone or unreadable: not ours to judge
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (EWOULDBLOCK), or a filesystem without flock: never judged stale
        return True
    finally:
        os.close(fd)  # (releases the probe's own lock, if it took it)
    return False


def open_scratch(root: Path, tag: str = "") -> tuple[Path, int]:
    """A new scratch folder under `root` and the descriptor of its lock file, whose flock is held until the
    descriptor is closed (after the folder is removed): a folder whose lock nobody holds is a dead run's."""
    folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX + tag, dir=root))
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass  # a filesystem without flock: its folders are never judged stale, so nothing is removed wrongly
    return folder, fd


def stale_folders(root: str | Path) -> list[tuple[Path, int]]:
    """(folder, bytes on disk) of every scratch folder under `root` left by a run that is no longer running."""
    out = []
    for d in sorted(Path(root).glob(SCRATCH_PREFIX + "*")):
        lock = d / LOCK_NAME
        if d.is_dir() and lock.is_file() and not _held(lock):
            out.append((d, sum(f.stat().st_blocks * 512 for f in d.iterdir() if f.is_file())))
    return out


def check_disk_path(path: str, key: str = "memory.disk_path") -> Path:
    """The folder the SSD tier writes into: it must exist, be a folder and be writable (MegatrainError naming the
    key otherwise). Nothing is left behind."""
    p = Path(path).expanduser()
    if not p.exists():
        unset = f" or unset {key}" if key.startswith("memory.") else ""
        raise MegatrainError(f"{key}: {p} does not exist; create the folder (on a local SSD){unset}")
    if not p.is_dir():
        raise MegatrainError(f"{key}: {p} is not a folder")
    if not os.access(p, os.W_OK | os.X_OK):
        raise MegatrainError(f"{key}: {p} is not writable by this user")
    return p


def transfer(fd: int, mv: memoryview, offset: int, write: bool, moved: list[int] | None = None) -> None:
    """Write `mv` to (or read it from) `fd` at `offset`, continuing after partial transfers; `moved[0]` counts the
    bytes as they go (what a failed request had moved included). OSError when a call fails or moves nothing."""
    done = 0
    while done < len(mv):
        n = (os.pwritev if write else os.preadv)(fd, [mv[done:]], offset + done)
        if n <= 0:
            raise OSError(0, f"{'write' if write else 'read'} of {len(mv) - done} bytes at offset {offset + done} "
                             f"returned {n}")
        done += n
        if moved is not None:
            moved[0] = done
