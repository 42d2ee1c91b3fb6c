"""One run per output.dir, one export per target: an exclusive flock held for the writer's life.

A run takes `output.dir/.megatrain.lock` before its first write and holds it until the process ends (any exit path:
the kernel drops a flock with the process, kill -9 included); the file records who holds it, so that a second run
on the same folder is refused with the holder named instead of both running and one's checkpoints replacing the
other's. `holder` probes without writing, for the input checks that run before anything is written.

The run's own files in output.dir (this lock, config.json, plan.json, metrics.jsonl) are never written through a
symbolic link: a link there would have the run truncate or create a file outside output.dir. `check_run_files`
refuses one before anything is written (and an output.dir/checkpoints the run cannot write, before a step trains);
`open_own` opens with O_NOFOLLOW, so a link made after the check is refused too. checkpoints/ itself may be a link
(to another disk): it is followed.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import socket
import sys
import time
from pathlib import Path

from ..errors import MegatrainError

LOCK_FILE = ".megatrain.lock"
OWN_FILES = (LOCK_FILE, "config.json", "plan.json", "metrics.jsonl")  # the files a run writes in output.dir itself
CHECKPOINTS = "checkpoints"


def check_run_files(out_dir: Path, key: str = "output.dir") -> None:
    """Before a run writes into `out_dir`: none of its own files there is a symbolic link or anything but a file,
    and an existing checkpoints/ folder (or link to one) can be written, so that a save cannot fail after minutes of
    training. One MegatrainError line naming the path; nothing is left behind."""
    out_dir = Path(out_dir)
    for name in OWN_FILES:
        p = out_dir / name
        if p.is_symlink():
            raise MegatrainError(_link_message(p, key))
        if p.exists() and not p.is_file():
            raise MegatrainError(f"{key}: {p} is not a file; megatrain writes its own file there: move it away")
    root = out_dir / CHECKPOINTS
    if root.is_symlink() or root.exists():
        probe = root / f".step-probe-{secrets.token_hex(4)}.tmp"  # a name the next save removes, were it left
        try:
            os.mkdir(probe)  # what a save does first (its .step-N.tmp), so every cause shows: permissions, an
            os.rmdir(probe)  # immutable folder, a read-only filesystem, a dangling link
        except OSError as e:
            raise MegatrainError(f"{key}: {root} cannot be written ({e.strerror or e}); the run saves its "
                                 f"checkpoints there: make it writable or choose another {key}") from None


def open_own(path: Path, flags: int, key: str = "output.dir") -> int:
    """os.open of one of the run's own files with O_NOFOLLOW: a symbolic link in its place is refused (one line
    naming it), as is any other failure to open it; never a file elsewhere written through the link."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MegatrainError(_link_message(Path(path), key)) from None
        raise MegatrainError(f"{key}: cannot write {path}: {e.strerror or e}") from None


def write_own(path: Path, text: str, key: str = "output.dir") -> None:
    """Replace the contents of one of the run's own files (open_own: never through a link)."""
    with os.fdopen(open_own(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, key), "w") as f:
        f.write(text)


def holder(folder: Path) -> str | None:
    """Who holds `folder`'s lock ("pid 123 on host h since 2026-...: megatrain train cfg.yaml"), or None when no
    live process does. Writes nothing."""
    lock = Path(folder) / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # none, or a link (check_run_files names it)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _describe(lock)
    except OSError:
        return None  # a filesystem without flock: nothing to go by
    finally:
        os.close(fd)
    return None


class FolderLock:
    """The exclusive lock of one folder, held until `release` (or the process's end)."""

    def __init__(self, folder: Path, key: str):
        self.folder, self.key, self._fd = Path(folder), key, None

    def acquire(self) -> "FolderLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = open_own(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, self.key)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise MegatrainError(f"{self.key}: {self.folder} is in use by another run "
                                 f"({_describe(self.folder / LOCK_FILE)}); wait for it to end or choose another "
                                 f"{self.key}") from None
        except OSError:
            pass  # a filesystem without flock (some network mounts): the run goes on unlocked
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime()), "command": " ".join(sys.argv)}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # the lock file stays: it holds nothing once unlocked
            self._fd = None

    def __enter__(self) -> "FolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def removed_while_read(ckpt: Path, what: str, again: str) -> MegatrainError:
    """The error for a checkpoint that went while `what` (export, resume) read it: most likely the clean-up of the
    run still saving into its checkpoints folder, named when it holds the folder. again: what to do instead."""
    run = Path(ckpt).parent.parent
    who = holder(run) if Path(ckpt).parent.name == "checkpoints" else None
    return MegatrainError(f"{what}: {ckpt} was removed while it was read"
                          + (f", by the run that holds {run} ({who}): it keeps only its newest checkpoints "
                             f"(checkpoint.keep); {again}, or wait for the run to end" if who else f"; {again}"))


def _link_message(p: Path, key: str) -> str:
    return f"{key}: {p} is a symbolic link; megatrain writes its own file there: remove the link"


def _describe(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {lock} is held"
