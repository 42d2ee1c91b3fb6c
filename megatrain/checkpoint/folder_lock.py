"""One run per output.dir, one export per target: an exclusive flock held for the writer's life.

A run takes `output.dir/.megatrain.lock` before its first write and holds it until the process ends (any exit path:
the kernel drops a flock with the process, kill -9 included); the file records who holds it, so that a second run
on the same folder is refused with the holder named instead of both running and one's checkpoints replacing the
other's. `holder` probes without writing, for the input checks that run before anything is written.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from ..errors import MegatrainError

LOCK_FILE = ".megatrain.lock"


def holder(folder: Path) -> str | None:
    """Who holds `folder`'s lock ("pid 123 on host h since 2026-...: megatrain train cfg.yaml"), or None when no
    live process does. Writes nothing."""
    lock = Path(folder) / LOCK_FILE
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
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
        fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
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


def _describe(lock: Path) -> str:
    try:
        info = json.loads(lock.read_text())
        return f"pid {info['pid']} on {info['host']} since {info['since']}: {info['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {lock} is held"
