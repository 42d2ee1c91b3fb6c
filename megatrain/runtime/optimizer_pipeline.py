"""Gradients out, updates in: the CPU optimizer overlapped with the GPU.

`OptimizerPipeline` is the engine's gradient sink. Each unit's update is a job for a worker thread, which, job after
job, piece by piece:

    1. copies the unit's gradient to a pinned landing buffer on the d2h stream (after the event recorded when it was
       complete), the next piece's copy already in flight while the current one is updated;
    2. runs AdamW on the unit's tile (a global-norm clip coefficient folded in), rewriting its streaming copy;
    3. marks the unit ready: the engine's `wait_for_update(u)`, called before it streams unit u for a forward, returns.

When the jobs are queued depends on clipping, which the trainer states per step (`begin_step`):

    clipping      the global norm needs every gradient first. During backward `put` only remembers each unit's
                  finished gradient (still on the device) and its event; `finish_step(lr, clip_coef)` queues every
                  update in forward order (embed, layer 0, ..., head), so layer l of step t+1 waits only for the
                  update of layer l of step t: the optimizer overlaps the next step's forward.
    no clipping   `begin_step(lr=...)`: `put` queues the unit's update at once, so updates run in backward order
                  (head, last layer, ..., embedding) during the same step's backward, overlapping the backward of
                  the layers below, and the next forward waits only for the units not yet updated. No gradient waits
                  for a norm: at most DEVICE_GRADS finished gradients wait on the device for the worker (`put`
                  blocks the engine's thread beyond that), so their GPU memory is bounded whatever the CPU's pace.

Either way a unit's update is the same AdamW, bit for bit, as updating everything after backward (tested on CPU).
Landing buffers are a bounded pool (two buffers of adamw.landing_piece elements); units pass through them in pieces.

With an SSD tier (the store's `disk`, runtime/disk_tier.py) the states placed on disk are fetched piece by piece
right before the piece's update (`acquire`: the tier has read them ahead, following the update order this step
takes, which the pipeline tells it) and written behind right after (`release`). The tier's pieces are the landing
pieces, so the update is the same kernel calls over the same ranges: bit-identical to the all-RAM run.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import MegatrainError
from .adamw import CpuAdamW, landing_piece
from .pinned import PinnedHost
from .schedule import gradient_order
from .store import HostStore

NUM_LANDING = 2  # landing buffers: the copy of piece k+1 overlaps the update of piece k
DEVICE_GRADS = 2  # no clipping: finished gradients handed over and not yet landed, at most (a threaded worker)
_STOP = object()


def update_order(num_units: int, clipping: bool = True) -> list[int]:
    """The order in which a step's updates run: with clipping forward order (the order the next forward needs
    them); without, the order the gradients are complete (head, last layer, ..., embedding). What a tier that reads
    a unit's state ahead of its update would follow."""
    return list(range(num_units)) if clipping else gradient_order(num_units)


class OptimizerThreadError(RuntimeError):
    """The optimizer worker failed; its exception is the cause."""


@dataclass
class _Update:
    """One unit's update: a job for the worker."""

    unit: int
    grad: torch.Tensor | None  # on the device; the pinned host copy for units sent to host; the gradient on CPU
    ready: torch.cuda.Event | None  # after which `grad` is complete (None on CPU)
    lr: float
    coef: float  # clip coefficient
    held: bool = False  # counted against DEVICE_GRADS until its gradient has landed


class OptimizerPipeline:
    def __init__(self, store: HostStore, optimizer: CpuAdamW, device: torch.device, pinned: PinnedHost,
                 num_landing: int = NUM_LANDING, threaded: bool | None = None, to_host: tuple[int, ...] = (),
                 threads: int | None = None, timeline=None):
        """pinned: registers the landing buffers and offloaded gradients' host copies. to_host: the units whose
        gradients the schedule sends to host memory as soon as they are complete (schedule.grads_to_host).
        threaded: run updates on a worker thread (default on CUDA). On a CPU-only machine the optimizer and the
        engine share the same cores, so by default updates run inline (in `finish_step`, or in `put` without
        clipping: the same result).
        threads: intra-op threads of the worker's AdamW (default: torch's, one per core). timeline: measures the
        d2h stream's busy share."""
        self.store, self.optimizer, self.device = store, optimizer, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.threaded = self.cuda if threaded is None else threaded
        self.order = update_order(len(store.tiles))
        self.disk = getattr(store, "disk", None)  # the SSD tier (None: every state in RAM; a distributed run)
        # Offloaded units' gradients go straight to host buffers: GPU memory for gradients stops growing with
        # depth, at 4 B/param of host memory for those units.
        self.offload = set(to_host)
        self.offload_host = {i: pinned.empty(store.tiles[i].numel, torch.float32, f"offloaded gradient of "
                                             f"{store.tiles[i].unit.name}") for i in sorted(self.offload)}
        self._grads: dict[int, tuple[torch.Tensor, object]] = {}  # clipping: gradients waiting for finish_step
        self._step_lr: float | None = None  # no clipping this step: the lr of the updates `put` queues
        self._queued: set[int] = set()  # no clipping: the units whose update this step has queued
        self._room = threading.Semaphore(DEVICE_GRADS)  # no clipping: device gradients the worker may hold
        self._ready = [threading.Event() for _ in self.order]
        for e in self._ready:
            e.set()  # the initial weights are ready
        self._jobs: queue.Queue = queue.Queue()  # lists of _Update; None stops the worker
        self._in_hand: deque = deque()  # the worker's: updates taken from a job, not yet started
        self._unit: tuple[_Update, int] | None = None  # the worker's: the update in progress, next offset
        self._error: BaseException | None = None
        if self.cuda:
            self.piece = landing_piece(store.max_unit_numel)
            if self.disk is not None and self.disk.piece != self.piece:
                raise ValueError(f"the SSD tier's pieces ({self.disk.piece}) must be the landing pieces ({self.piece})")
            self.landing = [pinned.empty(self.piece, torch.float32, "gradient landing buffer")
                            for _ in range(num_landing)]
            self.d2h = torch.cuda.Stream(self.device)
            self.compute = torch.cuda.current_stream(self.device)
        self.timeline = timeline
        self._before_update: list[Callable[[int], None]] = []
        # Where the worker's time went since the last take_stats(): in AdamW, waiting for gradient copies,
        # parameters updated (the bench reports the in-step AdamW rate from these).
        self.stats = self._no_stats()
        self.threads = threads
        self._worker = None
        if self.threaded:
            self._worker = threading.Thread(target=self._run, name="megatrain-optimizer", daemon=True)
            self._worker.start()

    # ---- engine side ------------------------------------------------------------------------------
    def put(self, unit_index: int, grad: torch.Tensor, to_host: bool) -> None:
        """Called on the compute stream's timeline when a unit's gradient is complete (no synchronisation).
        to_host: copy it to its pinned host buffer now (one of the units given as `to_host`). Without clipping the
        unit's update is queued now; this blocks while DEVICE_GRADS earlier gradients have not landed."""
        event = None
        if to_host != (unit_index in self.offload):
            raise ValueError(f"unit {unit_index}: the schedule sends its gradient to {'host' if to_host else 'GPU'}, "
                             f"the pipeline was built for the other")
        if to_host:
            host = self.offload_host[unit_index]
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record(self.compute)
                with torch.cuda.stream(self.d2h):
                    self.d2h.wait_event(ready)
                    host.copy_(grad, non_blocking=True)
                    grad.record_stream(self.d2h)  # the device gradient is freed now, reused once copied
                    event = torch.cuda.Event()
                    event.record(self.d2h)
            else:
                host.copy_(grad)
            grad = host
        elif self.cuda:
            event = torch.cuda.Event()
            event.record(self.compute)
        if self._step_lr is None:
            self._grads[unit_index] = (grad, event)
        else:
            self._queue_now(unit_index, grad, event)

    def host_buffer(self, unit_index: int) -> torch.Tensor | None:
        """The pinned buffer a to_host unit's finished gradient is copied into (None for the others): a wave
        group's accumulator of that unit waits in it between groups."""
        return self.offload_host.get(unit_index)

    def add_before_update(self, hook: Callable[[int], None]) -> None:
        """`hook(u)` is called (on the worker) right before unit u's tile is modified. A background checkpoint
        writer uses it to finish writing the unit's step-t state before step t+1 overwrites it, so a save needs no
        copy of the host state."""
        self._before_update.append(hook)

    def _notify_before_update(self, unit_index: int) -> None:
        for hook in self._before_update:
            hook(unit_index)

    def gradient(self, unit_index: int) -> torch.Tensor:
        """This step's finished fp32 gradient of a unit, where it waits for `finish_step` (the device, or host
        memory for offloaded units): for inspection, e.g. by equivalence tests. Clipping steps only: without
        clipping a gradient is handed to the optimizer at once."""
        if unit_index not in self._grads:
            raise KeyError(f"unit {unit_index}: no gradient waiting (none yet, or a step without clipping, whose "
                           f"gradients go to the optimizer as they are complete)")
        return self._grads[unit_index][0]

    def wait_for_update(self, unit_index: int) -> None:
        """Blocks the scheduling thread until the last step's update of this unit has been written."""
        while not self._ready[unit_index].wait(timeout=1.0):
            self._raise_if_failed()
        self._raise_if_failed()

    # ---- trainer side -----------------------------------------------------------------------------
    def begin_step(self, *, lr: float | None) -> None:
        """Before the engine's step. lr: this step does not clip, and each unit's update, at this lr, is queued as
        soon as its gradient is complete (`put`), during backward. None: the updates wait for `finish_step`'s clip
        coefficient (the default for a step that does not call this)."""
        if self._grads or self._queued:
            raise RuntimeError("begin_step: the last step's gradients were never finished (finish_step)")
        self._step_lr = lr
        if self.disk is not None:  # the SSD tier reads ahead in the order this step's updates take
            self.disk.set_order(update_order(len(self.order), clipping=lr is None))

    def finish_step(self, *, lr: float, clip_coef: float) -> None:
        """End the step: with clipping, queue the update of every unit, in forward order; without (`begin_step`
        with an lr), check that every unit's update was queued during backward. Returns at once."""
        self._raise_if_failed()
        if self._step_lr is not None:
            queued, step_lr = self._queued, self._step_lr
            self._queued, self._step_lr = set(), None
            if lr != step_lr or clip_coef != 1.0:
                raise ValueError(f"finish_step(lr={lr}, clip_coef={clip_coef}): this step's updates ran during "
                                 f"backward at lr={step_lr}, without clipping")
            if missing := [i for i in self.order if i not in queued]:
                raise RuntimeError(f"no gradient for units {missing}")
            return
        missing = [i for i in self.order if i not in self._grads]
        if missing:
            raise RuntimeError(f"no gradient for units {missing}")
        grads, self._grads = self._grads, {}
        if self.disk is not None:
            self.disk.set_order(self.order)
        for e in self._ready:
            e.clear()
        self._submit([_Update(i, *grads.pop(i), lr, clip_coef) for i in self.order])

    def drain(self) -> None:
        """Wait until every queued update has been written (before evaluation, checkpoints, exit)."""
        for i in self.order:
            self.wait_for_update(i)
        if self.disk is not None:
            self.disk.flush()  # the SSD tier's writes behind them too (an I/O error surfaces here)

    def close(self) -> None:
        """Stop the worker (its buffers are unregistered by the runtime's PinnedHost)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None

    @staticmethod
    def _no_stats() -> dict:
        """update_s, copy_wait_s, params: the worker's AdamW seconds, seconds waiting for gradient copies, parameters
        updated. longest_s, longest_params: its longest single piece of work that should take milliseconds (a
        piece's update, or issuing the next piece's copy) and the parameters of that piece: a worker held outside
        its work (page faults waiting on another process that reads this one's memory map, reclaim) shows there."""
        return {"update_s": 0.0, "copy_wait_s": 0.0, "params": 0, "longest_s": 0.0, "longest_params": 0}

    def _held(self, seconds: float, params: int) -> None:
        if seconds > self.stats["longest_s"]:
            self.stats["longest_s"], self.stats["longest_params"] = seconds, params

    def take_stats(self) -> dict:
        """The worker's time since the last call (AdamW seconds, copy-wait seconds, parameters), and a reset."""
        stats, self.stats = self.stats, self._no_stats()
        return stats

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, MegatrainError):  # the user's to act on (the SSD tier's disk failed): as it is
            raise self._error
        if self._error is not None:
            raise OptimizerThreadError(f"the optimizer thread failed: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error

    def _queue_now(self, unit_index: int, grad: torch.Tensor, event) -> None:
        """No clipping: the unit's update goes to the worker now (after at most DEVICE_GRADS - 1 others whose
        gradients are still on the device)."""
        self._raise_if_failed()
        if unit_index in self._queued:
            raise RuntimeError(f"unit {unit_index}: a second finished gradient in one step")
        self.wait_for_update(unit_index)  # the last step's update of it (its forward waited for it already)
        held = self.threaded and unit_index not in self.offload
        if held:
            while not self._room.acquire(timeout=1.0):
                self._raise_if_failed()
        self._queued.add(unit_index)
        self._ready[unit_index].clear()
        self._submit([_Update(unit_index, grad, event, self._step_lr, 1.0, held)])

    def _submit(self, updates: list[_Update]) -> None:
        self._jobs.put(updates)
        if not self.threaded:  # inline: run the updates now, on this thread
            self._jobs.put(None)
            self._run()

    # ---- worker ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads and self.threaded:
            torch.set_num_threads(self.threads)  # OpenMP: this thread's parallel regions
        try:
            if self.cuda:
                self._run_device()
            else:
                while (job := self._jobs.get()) is not None:
                    for upd in job:
                        t0 = time.perf_counter()
                        self._notify_before_update(upd.unit)
                        self._apply(upd)
                        self._landed(upd)
                        self._ready[upd.unit].set()
                        dt, numel = time.perf_counter() - t0, self.store.tiles[upd.unit].numel
                        self.stats["update_s"] += dt
                        self.stats["params"] += numel
                        self._held(dt, numel)
        except BaseException as e:  # surfaced on the training thread by wait_for_update / put / finish_step
            self._error = e
            for ev in self._ready:
                ev.set()

    def _apply(self, upd: _Update) -> None:
        """A unit's whole update from its host gradient (CPU): in one call, or with an SSD tier piece by piece."""
        tile = self.store.tiles[upd.unit]
        if self.disk is None:
            self.optimizer.update(tile, upd.grad, lr=upd.lr, clip_coef=upd.coef)
            return
        for a, n in self.disk.pieces(upd.unit):
            self._update_states(tile, upd, upd.grad[a: a + n], a)

    def _update_states(self, tile, upd: _Update, grad: torch.Tensor, a: int) -> None:
        """AdamW of tile[a : a + len(grad)]; states on the SSD tier are fetched first and written behind after."""
        if self.disk is None:
            self.optimizer.update(tile, grad, lr=upd.lr, clip_coef=upd.coef, offset=a, new_step=(a == 0))
            return
        states = self.disk.acquire(upd.unit, a)
        try:
            self.optimizer.update(tile, grad, lr=upd.lr, clip_coef=upd.coef, offset=a, new_step=(a == 0),
                                  states=states)
        finally:
            self.disk.release(upd.unit, a)

    def _landed(self, upd: _Update) -> None:
        """The unit's gradient is no longer needed where it was put: drop it (freeing device memory) and make room."""
        upd.grad = None
        if upd.held:
            upd.held = False
            self._room.release()

    def _next_piece(self, block: bool):
        """(update, offset, length) of the next piece to copy and apply, in the order the updates were queued;
        None when nothing is queued yet (block=False); _STOP when the pipeline closes."""
        while self._unit is None:
            if self._in_hand:
                self._unit = (self._in_hand.popleft(), 0)
                break
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return None
            if job is None:
                return _STOP
            self._in_hand.extend(job)
        upd, a = self._unit
        numel = self.store.tiles[upd.unit].numel
        n = min(self.piece, numel - a)
        self._unit = (upd, a + n) if a + n < numel else None
        return upd, a, n

    def _run_device(self) -> None:
        """Pieces in the order they were queued, through the landing buffers in turn; the copy of the next piece
        is issued before the current one is updated when its gradient is already queued (else right after)."""
        issued = 0

        def issue(piece):
            nonlocal issued
            buf = issued % len(self.landing)
            issued += 1
            t0 = time.perf_counter()
            out = (*piece, buf, self._copy_piece(*piece, buf))
            self._held(time.perf_counter() - t0, piece[2])  # issuing a copy takes microseconds
            return out

        cur = self._next_piece(block=True)
        if cur is _STOP:
            return
        cur = issue(cur)
        while True:
            nxt = self._next_piece(block=False)  # its buffer was freed by the update before this one
            if nxt is not None and nxt is not _STOP:
                nxt = issue(nxt)
            self._update_piece(*cur)
            if nxt is None:
                nxt = self._next_piece(block=True)
                if nxt is not _STOP:
                    nxt = issue(nxt)
            if nxt is _STOP:
                return
            cur = nxt

    def _copy_piece(self, upd: _Update, a: int, n: int, buf: int):
        """Issue the copy of grad[a : a + n] into landing buffer `buf` on the d2h stream; returns its event."""
        if upd.unit in self.offload:  # already on the host: its copy-done event stands in for a landing copy
            return upd.ready
        dst = self.landing[buf]
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(upd.ready)
            if self.timeline is not None:
                with self.timeline.span("d2h", self.d2h):
                    dst[:n].copy_(upd.grad[a: a + n], non_blocking=True)
            else:
                dst[:n].copy_(upd.grad[a: a + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        return ev

    def _update_piece(self, upd: _Update, a: int, n: int, buf: int, copied) -> None:
        t0 = time.perf_counter()
        copied.synchronize()
        i = upd.unit
        tile = self.store.tiles[i]
        last = a + n == tile.numel
        if i in self.offload:
            src = upd.grad[a: a + n]
        else:
            src = self.landing[buf][:n]
            if last:
                self._landed(upd)  # the device gradient is free once its last piece has landed
        if a == 0:
            self._notify_before_update(i)
        t1 = time.perf_counter()
        self._update_states(tile, upd, src, a)
        dt = time.perf_counter() - t1
        self.stats["update_s"] += dt
        self._held(dt, n)
        self.stats["copy_wait_s"] += t1 - t0
        self.stats["params"] += n
        if last:
            self._landed(upd)
            self._ready[i].set()
