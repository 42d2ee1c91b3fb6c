"""Saving step N's state from the live store, in the background, while step N+1 trains.

No copy of the host state is made: each unit file's 16 MiB chunks (fp32 master, Adam m and v, Adam step, in
forward order) are gathered from the store, hashed and written with O_DIRECT by a pool of I/O threads
(fastio.py: several requests in flight, a sha256 per chunk). A state kind on the SSD tier is read from it into a
buffer of one unit and one kind first and written by this thread (the same bytes and checksums). The pipeline calls
`before_update(u)` right before the optimizer modifies unit u: that call waits until unit u's file is complete. So
the files hold exactly step N's state. The units are written in the order the optimizer updated them in the last
step (`before_update` records it): forward order with clipping (all updates after backward), head first without
(each update as its gradient is complete, during backward). So step N+1's first update waits only for its own
unit's bytes, and each later one for the bytes not yet written before it: never for the whole save. The save is
started at a step boundary after `pipeline.drain()` (every update of step N written), with the run state (data
position, RNG, ...) captured at that same boundary.

Crash safety: everything goes into `.step-N.tmp/`; each file is fsynced, the manifest (sha256 and size of every
file) is written last, the directory is fsynced and then atomically renamed to `step-N/`. A killed save leaves
only a `.tmp` directory, which is never read and is removed by the next save. Old checkpoints are renamed away
before they are deleted, so a half-deleted one is never taken for a checkpoint either.

Test-only: the environment variable MEGATRAIN_TEST_SAVE_DELAY_S (seconds) makes the writer sleep after each
unit, so tests can catch a save in the middle (kill -9, SIGTERM, the optimizer waiting on the writer).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import MegatrainError
from .layout import FORMAT, MANIFEST, RUN_STATE, complete_checkpoints, unit_file_name
from .fastio import ChunkWriter, Pool, byte_view, direct_ok, wait_all
from .tensorfile import TensorFileWriter, fsync_dir, header_bytes, sha256_file

KINDS = ("master", "exp_avg", "exp_avg_sq")  # the tile buffers saved, all fp32; the streaming copy is derived


@dataclass
class _Job:
    step: int
    tmp: Path
    final: Path
    written: list[threading.Event]
    started: float = field(default_factory=time.perf_counter)
    error: BaseException | None = None
    cancelled: bool = False
    pool: Pool | None = None
    seconds: float = 0.0
    bytes: int = 0
    order: list[int] = field(default_factory=list)  # the units in the order they are written


def unit_plan(tile) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    plan = [(f"{k}/{s.hf_name}", torch.float32, s.shape) for k in KINDS for s in tile.unit.specs]
    return plan + [("step", torch.float32, ())]


class CheckpointSaver:
    """Owns output.dir/checkpoints: decides when to save (`step_done`), starts background saves, waits for them,
    keeps the newest `keep` (0: all)."""

    def __init__(self, root: Path, store, pipeline=None, keep: int = 0, every: int = 0,
                 final_step: int | None = None, world: dict | None = None, listener=None, threads: int | None = None):
        """every: save every N steps (0: never periodically); final_step: also save when that step is done
        (the run's last, when checkpoint.at_end or export.at_end asks for it). world: the ranks of the run, named in
        the manifest (default one process). listener: told `begin_save(step)` before a save's writer starts and
        `unit_written(step, unit)` as each unit is written (or abandoned): the other ranks of a distributed run
        sharing this store wait on it before they update a unit (megatrain/distributed/saves.py)."""
        self.root, self.store, self.pipeline, self.keep = Path(root), store, pipeline, keep
        self.every, self.final_step = every, final_step
        self.world = world or {"world_size": 1, "nodes": 1, "ranks_per_node": 1}
        self.listener = listener
        self.threads = threads  # I/O threads (default fastio.THREADS, at most the cores)
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        self.last: Path | None = None  # the newest checkpoint this saver completed
        self.last_seconds = 0.0
        self._updated: deque[int] = deque(maxlen=len(store.tiles))  # the optimizer's latest updates, in order
        if pipeline is not None:
            pipeline.add_before_update(self.before_update)

    # ---- called by the optimizer (any thread) ------------------------------------------------------
    def before_update(self, unit_index: int) -> None:
        self._updated.append(unit_index)
        job = self._job
        if job is not None:
            job.written[unit_index].wait()

    def write_order(self) -> list[int]:
        """The units in the order the optimizer last updated them (one whole step's updates), else forward order."""
        seen, n = list(self._updated), len(self.store.tiles)
        return seen if sorted(seen) == list(range(n)) else list(range(n))

    # ---- called by the training loop ---------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def step_done(self, step: int, run_state: Callable[[], dict], write_files: Callable[[Path], None] | None = None,
                  stopping: bool = False) -> bool:
        """Called after each step: save now if the schedule (every N, the final step) or a stop asks for it.
        `run_state()` is captured only then, at this step boundary. Returns whether a save started."""
        if not (stopping or (self.every and step % self.every == 0) or step == self.final_step):
            return False
        self.save(step, run_state(), write_files)
        return True

    def save(self, step: int, run_state: dict, write_files: Callable[[Path], None] | None = None) -> None:
        """Start saving the store as step `step`; returns once the writer runs. A save still running is
        finished first. `write_files(dir)` adds small files (model config, tokenizer) synchronously."""
        self.wait()
        if self.pipeline is not None:
            self.pipeline.drain()  # every update of this step written: the store is exactly step `step`
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        tmp = self.root / f".step-{step}.tmp"
        tmp.mkdir()
        (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
        if write_files is not None:
            write_files(tmp)
        job = _Job(step, tmp, self.root / f"step-{step}", [threading.Event() for _ in self.store.tiles],
                   order=self.write_order())
        self._job = job
        if self.listener is not None:
            self.listener.begin_save(step)
        self._thread = threading.Thread(target=self._write, args=(job,), name="megatrain-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the running save (if any) is complete; raise its error. Returns the newest checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            job, self._job = self._job, None
            if job.error is not None:
                raise MegatrainError(f"checkpoint: saving step {job.step} to {job.final} failed: "
                                     f"{type(job.error).__name__}: {job.error}") from job.error
            self.last, self.last_seconds = job.final, job.seconds
        return self.last

    def clear(self) -> int:
        """Remove every checkpoint under root (a fresh run in a reused output.dir); returns how many."""
        found = complete_checkpoints(self.root)
        for _, p in found:
            self._discard(p)
        return len(found)

    def abandon(self) -> None:
        """Stop waiting for a running save (a second Ctrl-C): it stays a .tmp directory, never a checkpoint."""
        job = self._job
        if job is not None:
            job.cancelled = True  # the writer stops at the next unit and removes its .tmp directory
            if job.pool is not None:
                job.pool.cancelled = True  # and its chunks not yet written are skipped
            self._all_written(job)
        self._job = self._thread = None

    # ---- the writer thread ---------------------------------------------------------------------------
    def _write(self, job: _Job) -> None:
        writers: list[ChunkWriter] = []
        try:
            delay = float(os.environ.get("MEGATRAIN_TEST_SAVE_DELAY_S", "0") or 0)
            files, units = {}, [None] * len(self.store.tiles)
            staged = any(k in self.store.on_disk for k in KINDS)
            direct = direct_ok(job.tmp)
            with Pool(self.threads) as pool:
                job.pool, futures = pool, []
                for i in job.order or range(len(self.store.tiles)):
                    tile = self.store.tiles[i]
                    if job.cancelled:
                        raise RuntimeError("abandoned")
                    name = unit_file_name(i, tile.unit)
                    meta = {"format": "pt", "unit": tile.unit.name, "step": job.step}
                    if staged:  # a kind on the SSD tier is staged one unit of one kind at a time: one stream
                        files[name] = self._write_staged(job.tmp / name, i, tile, meta)
                        self._unit_done(job, i)
                    else:
                        head = torch.frombuffer(bytearray(header_bytes(unit_plan(tile), meta)), dtype=torch.uint8)
                        parts = [head] + [byte_view(v) for k in KINDS for v in tile.views(getattr(tile, k)).values()]
                        w = ChunkWriter(job.tmp / name, parts + [byte_view(tile.step)], direct,
                                        on_done=lambda i=i: self._unit_done(job, i))
                        writers.append(w)
                        futures += w.submit(pool)
                        if delay:  # test-only: the unit complete, then the pause
                            wait_all(pool, futures)
                    units[i] = {"file": name, "name": tile.unit.name, "numel": tile.numel}
                    if delay:
                        time.sleep(delay)
                wait_all(pool, futures)
            files.update({w.path.name: w.info for w in writers})
            files = dict(sorted(files.items()))  # the unit files in unit order, whatever the order written
            job.pool = None
            for p in sorted(job.tmp.rglob("*")):
                rel = p.relative_to(job.tmp).as_posix()
                if p.is_file() and rel not in files:
                    sha, size = sha256_file(p)
                    files[rel] = {"sha256": sha, "bytes": size}
                    _fsync(p)
            manifest = {"format": FORMAT, "format_version": 2, "step": job.step, "world": self.world, "units": units,
                        "files": files}
            with open(job.tmp / MANIFEST, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            for d in sorted({p.parent for p in job.tmp.rglob("*")} | {job.tmp}, reverse=True):
                fsync_dir(d)
            if job.cancelled:
                raise RuntimeError("abandoned")
            if job.final.exists():  # a checkpoint of the same step (a resumed run saving it again)
                self._discard(job.final)
            os.rename(job.tmp, job.final)
            fsync_dir(self.root)
            job.bytes = sum(v["bytes"] for v in files.values())
            self._prune(job.final)
        except BaseException as e:  # reported on the training thread by wait()
            job.error = e
            for w in writers:
                w.close()
            shutil.rmtree(job.tmp, ignore_errors=True)
        finally:
            job.seconds = time.perf_counter() - job.started
            self._all_written(job)  # never leave the optimizer waiting on a dead writer

    def _write_staged(self, path: Path, i: int, tile, meta: dict) -> dict:
        w = TensorFileWriter(path, unit_plan(tile), metadata=meta)
        try:
            for k in KINDS:
                with self.store.unit_state(i, (k,)) as st:
                    for view in tile.views(st[k]).values():
                        w.write(view)
            w.write(tile.step)
        except BaseException:
            w.abort()
            raise
        return w.close()

    def _unit_done(self, job: _Job, i: int) -> None:
        job.written[i].set()  # the optimizer may now update this unit
        if self.listener is not None:
            self.listener.unit_written(job.step, i)

    def _all_written(self, job: _Job) -> None:
        for i, e in enumerate(job.written):
            e.set()
            if self.listener is not None:
                self.listener.unit_written(job.step, i)

    def _prune(self, newest: Path) -> None:
        if self.keep <= 0:
            return
        found = complete_checkpoints(self.root)
        for _, p in found[:-self.keep]:
            if p != newest:
                self._discard(p)

    def _discard(self, path: Path) -> None:
        gone = path.parent / f".{path.name}.deleting"
        shutil.rmtree(gone, ignore_errors=True)
        os.rename(path, gone)  # atomic: a crash while deleting never leaves a partial step-N behind
        shutil.rmtree(gone, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        for p in self.root.iterdir():
            if p.name.startswith(".step-") and (p.name.endswith(".tmp") or p.name.endswith(".deleting")):
                shutil.rmtree(p, ignore_errors=True)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
