"""Saving step N's state from the live store, in the background, while step N+1 trains.

No copy of the host state is made up front: each unit file's 16 MiB chunks (fp32 master, Adam m and v, Adam step, in
forward order) are gathered from the store, hashed and written with O_DIRECT by a pool of I/O threads
(fastio.py: several requests in flight, a sha256 per chunk). A state kind on the SSD tier is read from it into a
buffer of one unit and one kind first and written by this thread (the same bytes and checksums). The pipeline calls
`before_update(u)` right before the optimizer modifies unit u: if the writer has not written unit u yet, the unit's
state (master, m and v as saved, its step) is copied into a staging pool of at most `staging_bytes` bytes of host
RAM (the plan's headroom, planner/io_time.py) and the update goes on; the writer takes the unit's chunks not yet
gathered from that copy (chunks being gathered from the store finish first) and frees it once the file is written.
Without room (no headroom, or the pool full of units not yet written) the call waits until unit u's file is
complete, or until the unit fits. Either way the files hold exactly step N's state, byte for byte the same. The
units are written in the order the optimizer updated them in the last step (`before_update` records it): forward
order with clipping (all updates after backward), head first without (each update as its gradient is complete,
during backward). So step N+1's first update waits only for its own unit's bytes, and each later one for the bytes
not yet written before it: never for the whole save. The save is started at a step boundary after `pipeline.drain()`
(every update of step N written), with the run state (data position, RNG, ...) captured at that same boundary.

Crash safety: everything goes into `.step-N.tmp/`; each file is fsynced, the manifest (sha256 and size of every
file) is written last, the directory is fsynced and then atomically renamed to `step-N/`. A killed save leaves
only a `.tmp` directory, which is never read and is removed by the next save. Old checkpoints are renamed away
before they are deleted, so a half-deleted one is never taken for a checkpoint either.

Each save's statistics (`stats`, and a JSON line appended to the file MEGATRAIN_SAVE_STATS names, for
bench/bench_io.py): the writer's seconds and its threads' seconds per phase, the optimizer's waits on the writer
(count, seconds, seconds per step), the units and bytes staged, the pool's peak and limit.

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
from .fastio import ChunkWriter, IOStats, Pool, byte_view, direct_ok, wait_all
from .tensorfile import TensorFileWriter, fsync_dir, header_bytes, sha256_file
from ..runtime.gil import short_switches

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
    sources: list = field(default_factory=list)  # per unit: its _Source (None: a kind on the SSD tier)
    io: IOStats = field(default_factory=IOStats)
    lock: threading.Condition = field(default_factory=threading.Condition)  # the staging pool's room
    staging_bytes: int = 0  # the pool's limit
    staged_now: int = 0
    staged_peak: int = 0
    staged_bytes: int = 0
    staged_units: int = 0
    stage_s: float = 0.0  # the optimizer's seconds copying units into the pool
    waits: int = 0  # updates that waited on the writer
    wait_s: float = 0.0
    wait_by_step: dict = field(default_factory=dict)  # step running -> seconds its optimizer waited on the writer


class _Source:
    """A unit file's parts as its chunks are gathered: the store's tensors, or once staged the header and the copy.
    `live` counts the chunks being gathered from the store, which a staging waits out before the update starts."""

    def __init__(self, head: torch.Tensor, state: list[torch.Tensor], step: torch.Tensor):
        self.head, self.state = head, state + [step]
        self.store_parts = self.parts = [head] + self.state
        self.nbytes = sum(p.numel() for p in self.state)
        self.pooled = self.nbytes - step.numel()  # what it takes of the pool: the plan bounds the pool by the
        #                                           checkpoint's master, m and v (12 B/param), not the units' steps
        self.staged: torch.Tensor | None = None
        self.reserved = self.done = False  # room taken in the pool (the saver's lock); the file written
        self.live = 0
        self.cond = threading.Condition()

    def enter(self) -> list:
        with self.cond:
            if self.parts is self.store_parts:
                self.live += 1
            return self.parts

    def leave(self, parts: list) -> None:
        if parts is self.store_parts:
            with self.cond:
                self.live -= 1
                self.cond.notify_all()

    def stage(self) -> None:
        """Copy the unit's state (the store's bytes, unchanged until this returns) and switch to the copy."""
        buf, pos = torch.empty(self.nbytes, dtype=torch.uint8), 0
        for p in self.state:
            buf[pos: pos + p.numel()].copy_(p)
            pos += p.numel()
        with self.cond:
            if self.done:  # written meanwhile, from the store: the copy is not needed
                return
            self.staged, self.parts = buf, [self.head, buf]
            while self.live:
                self.cond.wait()

    def free(self) -> None:
        with self.cond:
            self.done, self.staged, self.parts = True, None, []


def unit_plan(tile) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    plan = [(f"{k}/{s.hf_name}", torch.float32, s.shape) for k in KINDS for s in tile.unit.specs]
    return plan + [("step", torch.float32, ())]


class CheckpointSaver:
    """Owns output.dir/checkpoints: decides when to save (`step_done`), starts background saves, waits for them,
    keeps the newest `keep` (0: all)."""

    def __init__(self, root: Path, store, pipeline=None, keep: int = 0, every: int = 0,
                 final_step: int | None = None, world: dict | None = None, listener=None, threads: int | None = None,
                 staging_bytes: int = 0):
        """every: save every N steps (0: never periodically); final_step: also save when that step is done
        (the run's last, when checkpoint.at_end or export.at_end asks for it). world: the ranks of the run, named in
        the manifest (default one process). listener: told `begin_save(step)` before a save's writer starts and
        `unit_written(step, unit)` as each unit is written (or abandoned): the other ranks of a distributed run
        sharing this store wait on it before they update a unit (megatrain/distributed/saves.py); a unit staged
        counts as written for them. staging_bytes: host RAM the optimizer may copy units not yet written into
        (0: it waits for the writer)."""
        self.root, self.store, self.pipeline, self.keep = Path(root), store, pipeline, keep
        self.every, self.final_step = every, final_step
        self.world = world or {"world_size": 1, "nodes": 1, "ranks_per_node": 1}
        self.listener = listener
        self.threads = threads  # I/O threads (default fastio.THREADS, at most the cores)
        self.staging_bytes = max(0, int(staging_bytes))
        self.stats: dict | None = None  # the last completed save's (see the module's docstring)
        self._running = 1  # the step in progress (its optimizer's waits are counted under it)
        self._job: _Job | None = None
        self._thread: threading.Thread | None = None
        self.last: Path | None = None  # the newest checkpoint this saver completed
        self.last_seconds = 0.0
        self._updated: deque[int] = deque(maxlen=len(store.tiles))  # the optimizer's latest updates, in order
        if pipeline is not None:
            pipeline.add_before_update(self.before_update)

    # ---- called by the optimizer (any thread) ------------------------------------------------------
    def before_update(self, unit_index: int) -> None:
        """Unit `unit_index` is about to be updated: its state is written, or staged, before this returns."""
        self._updated.append(unit_index)
        job = self._job
        if job is None or job.written[unit_index].is_set():
            return
        src = job.sources[unit_index] if job.sources else None
        t0, waited = time.perf_counter(), False
        with job.lock:
            while not job.written[unit_index].is_set():
                if src is not None and src.reserved:  # staged by an earlier update in this save (no clipping)
                    src = None
                    break
                if src is not None and src.pooled <= job.staging_bytes - job.staged_now:
                    job.staged_now += src.pooled  # reserved: the copy is made outside the lock
                    src.reserved = True
                    job.staged_peak = max(job.staged_peak, job.staged_now)
                    break
                waited = True  # no room: until the writer writes this unit or frees a staged one
                job.lock.wait(timeout=0.5)
            else:
                src = None
        t1 = time.perf_counter()
        if waited:
            job.waits += 1
            job.wait_s += t1 - t0
            job.wait_by_step[self._running] = job.wait_by_step.get(self._running, 0.0) + t1 - t0
        if src is None:
            return
        src.stage()
        job.stage_s += time.perf_counter() - t1
        job.staged_bytes += src.nbytes
        job.staged_units += 1
        if self.listener is not None:  # the other ranks sharing the store may update it now
            self.listener.unit_written(job.step, unit_index)

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
        self._running = step + 1
        if not (stopping or (self.every and step % self.every == 0) or step == self.final_step):
            return False
        self.save(step, run_state(), write_files)
        return True

    def save(self, step: int, run_state: dict, write_files: Callable[[Path], None] | None = None) -> None:
        """Start saving the store as step `step`; returns once the writer runs. A save still running is
        finished first. `write_files(dir)` adds small files (model config, tokenizer) synchronously."""
        self.wait()
        with short_switches():  # the job's views are many torch calls, each taking the GIL back (runtime/gil.py)
            self._start(step, run_state, write_files)

    def _start(self, step: int, run_state: dict, write_files) -> None:
        if self.pipeline is not None:
            self.pipeline.drain()  # every update of this step written: the store is exactly step `step`
        tmp = self.root / f".step-{step}.tmp"
        try:  # the folder, the run state and the small files, here: a folder that cannot be written (permissions, a
            #   read-only filesystem, a full disk) fails as a failed background write does (wait)
            self.root.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()
            tmp.mkdir()
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
            if write_files is not None:
                write_files(tmp)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)  # the previous checkpoints are untouched
            raise _save_failed(step, self.root / f"step-{step}", e) from e
        job = _Job(step, tmp, self.root / f"step-{step}", [threading.Event() for _ in self.store.tiles],
                   order=self.write_order(), staging_bytes=self.staging_bytes)
        if not any(k in self.store.on_disk for k in KINDS):  # a kind on the SSD tier: its units are never staged
            job.sources = [_Source(torch.frombuffer(bytearray(header_bytes(unit_plan(t), {
                "format": "pt", "unit": t.unit.name, "step": step})), dtype=torch.uint8),
                [byte_view(v) for k in KINDS for v in t.views(getattr(t, k)).values()], byte_view(t.step))
                for t in self.store.tiles]
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
            if isinstance(job.error, MegatrainError):
                raise job.error
            if job.error is not None:
                raise _save_failed(job.step, job.final, job.error) from job.error
            self.last, self.last_seconds = job.final, job.seconds
            self._record(job)
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
        with short_switches():  # the manifest's and folders' syncs too take the GIL back often (runtime/gil.py)
            self._write_files(job)

    def _write_files(self, job: _Job) -> None:
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
                    if staged:  # a kind on the SSD tier is read one unit of one kind at a time: one stream
                        meta = {"format": "pt", "unit": tile.unit.name, "step": job.step}
                        files[name] = self._write_staged(job.tmp / name, i, tile, meta)
                        self._unit_done(job, i)
                    else:  # the unit's header and state (the store's bytes, or its staged copy)
                        src = job.sources[i]
                        w = ChunkWriter(job.tmp / name, src.store_parts, direct, source=src, stats=job.io,
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
            try:
                self._prune(job.final)
            except OSError as e:  # the new checkpoint is complete: said as such, not as a failed save
                raise MegatrainError(f"checkpoint: step {job.step} is saved in {job.final}, but an older checkpoint "
                                     f"could not be removed ({e.strerror or e}: {e.filename}); remove it, then "
                                     f"resume=auto continues from step {job.step}") from e
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
        with job.lock:
            job.written[i].set()  # the optimizer may now update this unit
            src = job.sources[i] if job.sources else None
            if src is not None and src.reserved:
                src.reserved = False
                job.staged_now -= src.pooled  # its copy is freed: room for the next unit the optimizer reaches
            if src is not None:
                src.free()
            job.lock.notify_all()
        if self.listener is not None:
            self.listener.unit_written(job.step, i)

    def _all_written(self, job: _Job) -> None:
        for i in range(len(job.written)):
            if not job.written[i].is_set():
                self._unit_done(job, i)
            elif self.listener is not None:
                self.listener.unit_written(job.step, i)

    def _record(self, job: _Job) -> None:
        """A completed save's statistics (on the training thread, once the writer ended: no update waits on it any
        more): `stats`, and a JSON line in the file MEGATRAIN_SAVE_STATS names."""
        self.stats = {"step": job.step, "bytes": job.bytes, "seconds": job.seconds,
                      "io_threads_s": {k: round(v, 4) for k, v in job.io.seconds.items()},
                      "waits": job.waits, "wait_s": job.wait_s,
                      "wait_s_by_step": {str(k): v for k, v in sorted(job.wait_by_step.items())},
                      "staged_units": job.staged_units, "staged_bytes": job.staged_bytes,
                      "staged_peak_bytes": job.staged_peak, "staging_limit_bytes": job.staging_bytes,
                      "stage_copy_s": job.stage_s, "order": job.order}
        path = os.environ.get("MEGATRAIN_SAVE_STATS")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(self.stats) + "\n")

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


def _save_failed(step: int, final: Path, error: BaseException) -> MegatrainError:
    """One line for a save that failed, in the writer thread or before it started: the checkpoint's folder and the
    cause (the earlier checkpoints stay as they were)."""
    return MegatrainError(f"checkpoint: saving step {step} to {final} failed: {type(error).__name__}: {error}")


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
