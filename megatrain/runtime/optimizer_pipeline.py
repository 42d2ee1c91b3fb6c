"""Gradients out, updates in: the CPU optimizer overlapped with the GPU.

`OptimizerPipeline` is the engine's gradient sink. During backward it only remembers each unit's finished fp32
gradient (still on the device) and the event after which it is complete. When the step's backward has been
queued, `finish_step` hands the whole step to a worker thread, which, in forward order (embed, layer 0, ...,
head):

    1. copies the unit's gradient to a pinned landing buffer on the d2h stream (after the unit's event),
       the next unit's copy already in flight while the current one is updated;
    2. runs AdamW on the unit's tile (global-norm clip folded in), rewriting its streaming copy;
    3. marks the unit ready: the engine's `wait_for_update(u)`, called before it streams unit u for the next
       step's forward, returns.

So layer l of step t+1 waits only for the update of layer l of step t; the result is the same AdamW as
updating everything after backward (tested bit for bit on CPU). Landing buffers are a bounded pool (two
buffers of at most PIECE_MAX elements); units pass through them in pieces.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

import torch

from . import adamw
from .adamw import CpuAdamW
from .pinned import PinnedHost
from .store import HostStore

PIECE_MAX = 64 << 20  # elements per landing buffer
NUM_LANDING = 2  # landing buffers: the copy of piece k+1 overlaps the update of piece k


def update_order(num_units: int) -> list[int]:
    """The order in which the optimizer updates units (and the next forward needs them): forward order."""
    return list(range(num_units))


def landing_piece(max_unit_numel: int) -> int:
    """Elements per landing buffer: the largest unit rounded down to adamw.CHUNK (pieces on CHUNK boundaries keep
    a piecewise update bit-identical to a whole-tile one), at least one CHUNK, at most PIECE_MAX (256 MiB: copies
    that large run at full PCIe bandwidth, and two buffers cost 0.5 GiB of host memory however large the layers)."""
    return min(PIECE_MAX, max(adamw.CHUNK, max_unit_numel // adamw.CHUNK * adamw.CHUNK))


class OptimizerThreadError(RuntimeError):
    """The optimizer worker failed; its exception is the cause."""


class OptimizerPipeline:
    def __init__(self, store: HostStore, optimizer: CpuAdamW, device: torch.device, pinned: PinnedHost,
                 num_landing: int = NUM_LANDING, threaded: bool | None = None, to_host: tuple[int, ...] = (),
                 threads: int | None = None, timeline=None):
        """pinned: registers the landing buffers and offloaded gradients' host copies. to_host: the units whose
        gradients the schedule sends to host memory as soon as they are complete (schedule.grads_to_host). threaded: run updates on a
        worker thread (default on CUDA). On a CPU-only machine the optimizer and the engine share the same cores,
        so by default updates run inline in `finish_step` (the same result). threads: intra-op threads of the
        worker's AdamW (default: torch's, one per core). timeline: measures the d2h stream's busy share."""
        self.store, self.optimizer, self.device = store, optimizer, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.threaded = self.cuda if threaded is None else threaded
        self.order = update_order(len(store.tiles))
        # Offloaded units' gradients go straight to host buffers: GPU memory for gradients stops growing with
        # depth, at 4 B/param of host memory for those units.
        self.offload = set(to_host)
        self.offload_host = {i: pinned.empty(store.tiles[i].numel, torch.float32, f"offloaded gradient of "
                                             f"{store.tiles[i].unit.name}") for i in sorted(self.offload)}
        self._grads: dict[int, tuple[torch.Tensor, object]] = {}
        self._ready = [threading.Event() for _ in self.order]
        for e in self._ready:
            e.set()  # the initial weights are ready
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        if self.cuda:
            self.piece = landing_piece(store.max_unit_numel)
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
        to_host: copy it to its pinned host buffer now (one of the units given as `to_host`)."""
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
            self._grads[unit_index] = (host, event)
            return
        if self.cuda:
            event = torch.cuda.Event()
            event.record(self.compute)
        self._grads[unit_index] = (grad, event)

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
        memory for offloaded units): for inspection, e.g. by equivalence tests."""
        return self._grads[unit_index][0]

    def wait_for_update(self, unit_index: int) -> None:
        """Blocks the scheduling thread until the last step's update of this unit has been written."""
        while not self._ready[unit_index].wait(timeout=1.0):
            self._raise_if_failed()
        self._raise_if_failed()

    # ---- trainer side -----------------------------------------------------------------------------
    def finish_step(self, *, lr: float, clip_coef: float) -> None:
        """Queue the update of every unit, in forward order; returns at once."""
        self._raise_if_failed()
        missing = [i for i in self.order if i not in self._grads]
        if missing:
            raise RuntimeError(f"no gradient for units {missing}")
        grads, self._grads = self._grads, {}
        for e in self._ready:
            e.clear()
        self._jobs.put((grads, lr, clip_coef))
        if not self.threaded:
            self._jobs.put(None)
            self._run()

    def drain(self) -> None:
        """Wait until every queued update has been written (before evaluation, checkpoints, exit)."""
        for i in self.order:
            self.wait_for_update(i)

    def close(self) -> None:
        """Stop the worker (its buffers are unregistered by the runtime's PinnedHost)."""
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join(timeout=60)
            self._worker = None

    @staticmethod
    def _no_stats() -> dict:
        return {"update_s": 0.0, "copy_wait_s": 0.0, "params": 0}

    def take_stats(self) -> dict:
        """The worker's time since the last call (AdamW seconds, copy-wait seconds, parameters), and a reset."""
        stats, self.stats = self.stats, self._no_stats()
        return stats

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OptimizerThreadError(f"the optimizer thread failed: {type(self._error).__name__}: "
                                       f"{self._error}") from self._error

    # ---- worker ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        if self.threads and self.threaded:
            torch.set_num_threads(self.threads)  # OpenMP: this thread's parallel regions
        try:
            while (job := self._jobs.get()) is not None:
                grads, lr, coef = job
                if self.cuda:
                    self._update_from_device(grads, lr, coef)
                else:
                    for i in self.order:
                        grad, _ = grads.pop(i)
                        self._notify_before_update(i)
                        self.optimizer.update(self.store.tiles[i], grad, lr=lr, clip_coef=coef)
                        self._ready[i].set()
        except BaseException as e:  # surfaced on the training thread by wait_for_update / finish_step
            self._error = e
            for ev in self._ready:
                ev.set()

    def _update_from_device(self, grads: dict, lr: float, coef: float) -> None:
        # The work list: (unit, offset, length) pieces no larger than a landing buffer, in forward order (an empty
        # tile, a rank's empty shard of a small unit, is one empty piece: its step count still advances).
        pieces = [(i, a, min(self.piece, self.store.tiles[i].numel - a))
                  for i in self.order for a in range(0, max(self.store.tiles[i].numel, 1), self.piece)]
        done_events: list = [None] * len(self.landing)

        def issue(k: int) -> None:
            i, a, n = pieces[k]
            grad, ready = grads[i]
            if i in self.offload:  # already on the host: its copy-done event stands in for a landing copy
                done_events[k % len(self.landing)] = ready
                return
            buf = self.landing[k % len(self.landing)]
            with torch.cuda.stream(self.d2h):
                self.d2h.wait_event(ready)
                if self.timeline is not None:
                    with self.timeline.span("d2h", self.d2h):
                        buf[:n].copy_(grad[a: a + n], non_blocking=True)
                else:
                    buf[:n].copy_(grad[a: a + n], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
            done_events[k % len(self.landing)] = ev

        issue(0)
        for k, (i, a, n) in enumerate(pieces):
            if k + 1 < len(pieces):
                issue(k + 1)  # the next copy overlaps this update (its buffer was freed by update k-1)
            t0 = time.perf_counter()
            done_events[k % len(self.landing)].synchronize()
            tile = self.store.tiles[i]
            if a == 0:
                self._notify_before_update(i)
            src = grads[i][0][a: a + n] if i in self.offload else self.landing[k % len(self.landing)][:n]
            t1 = time.perf_counter()
            self.optimizer.update(tile, src, lr=lr, clip_coef=coef, offset=a, new_step=(a == 0))
            self.stats["update_s"] += time.perf_counter() - t1
            self.stats["copy_wait_s"] += t1 - t0
            self.stats["params"] += n
            if a + n == tile.numel:
                grads.pop(i)  # the device gradient is free once its last piece has landed
                self._ready[i].set()
