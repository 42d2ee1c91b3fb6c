"""Gradients of several ranks into one update of the node's shared store: `ShardedPipeline`.

It is the engine's gradient sink (runtime/engine.py's GradientSink) and the trainer's optimizer pipeline in a
distributed run, wrapping the single-GPU `OptimizerPipeline` (runtime/optimizer_pipeline.py), which it builds over
a `ShardStore`: the same tiles, cut to this rank's shard of each unit (world.shard_range). For each unit, as soon
as the engine hands over its finished fp32 gradient (`put`):

    1. within the node: reduce-scatter of the first L*S elements (S: shard_part) over the local process group, so
       local rank r receives the node's sum of elements [r*S, (r+1)*S); the remainder (fewer than L*CHUNK) is
       reduced to the last local rank, whose shard it ends. NCCL on CUDA, gloo on CPU.
    2. across nodes: all-reduce of that shard over the ranks with the same local rank on every node (each node
       keeps a full replica of the state, and updates it from the same global sum).
    3. the squared norm of the reduced shard, for the global norm (`shard_sq_norm`); the shard goes to the
       wrapped pipeline, which copies it to host and updates only this rank's part of the tile.
On CUDA the reductions run on NCCL's streams and a side stream (`comm`): the compute stream never waits for them,
and the pipeline's copy stream waits for `comm` before it copies a shard out. On CPU they run on gloo's threads
while the backward goes on, and are completed (tails, the cross-node all-reduce) when the step's norm is asked.

Across processes, `wait_for_update(u)` (before the next forward streams unit u) waits for this rank's own update and
then for every local rank's (NodeFlags.done): the shared tile is whole only when all of them are written. Each
rank publishes its own as its pipeline finishes each unit (a small thread when the pipeline is threaded).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime.engine import squared_norm
from ..runtime.optimizer_pipeline import OptimizerPipeline, update_order
from ..runtime.store import HostStore, LayerTile
from .shared import NodeFlags
from .world import World, shard_part, shard_range


# torch 2.13 names it reduce_scatter_single (reduce_scatter_tensor, deprecated there, before); gloo has it since 2.6
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ShardUnit:
    """What CpuAdamW and the pipeline read of a unit, for one shard [lo, hi) of it."""

    name: str
    numel: int
    decay_numel: int  # the shard's elements that get weight decay (a unit lays decayed tensors out first)


class ShardStore:
    """The store's tiles cut to one rank's shards: views of the same memory, the same Adam step counters."""

    def __init__(self, store: HostStore, ranges: list[tuple[int, int]]):
        self.tiles = []
        for t, (lo, hi) in zip(store.tiles, ranges):
            unit = ShardUnit(f"{t.unit.name}[{lo}:{hi}]", hi - lo, min(max(t.unit.decay_numel - lo, 0), hi - lo))
            self.tiles.append(LayerTile(unit, t.master[lo:hi], t.exp_avg[lo:hi], t.exp_avg_sq[lo:hi],
                                        t.stream[lo:hi], t.step))

    @property
    def max_unit_numel(self) -> int:
        return max(t.numel for t in self.tiles)


@dataclass
class _Reduction:
    unit: int
    out: torch.Tensor  # this rank's shard of the reduced gradient
    grad: torch.Tensor  # the unit's full local gradient (its tail is reduced in place)
    works: list
    to_host: bool


class ShardedPipeline:
    def __init__(self, store: HostStore, optimizer, device: torch.device, pinned, world: World, groups, flags: NodeFlags,
                 *, threaded: bool | None = None, to_host: tuple[int, ...] = (), threads: int | None = None,
                 timeline=None, wait_timeout: float = 1800.0):
        """groups: the run's ProcessGroups (local, cross); flags: the node's shared update flags."""
        self.store, self.world, self.groups, self.flags = store, world, groups, flags
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        L = world.local_size
        self.parts = [shard_part(t.numel, L) for t in store.tiles]
        self.ranges = [shard_range(t.numel, L, world.local_rank) for t in store.tiles]
        self.inner = OptimizerPipeline(ShardStore(store, self.ranges), optimizer, device, pinned, threaded=threaded,
                                       to_host=to_host, threads=threads, timeline=timeline)
        self.threaded = self.inner.threaded
        self.order = update_order(len(store.tiles))
        self.last_local = groups.local_ranks[-1]  # global rank of the node's last local rank: owns the remainders
        self.comm = torch.cuda.Stream(self.device) if self.cuda else None
        self.wait_timeout = wait_timeout
        self.steps = 0  # optimizer steps queued by this rank
        self._pending: list[_Reduction] = []
        self._sq: list[torch.Tensor] = []
        self._publish: queue.Queue = queue.Queue()
        self._publish_error: BaseException | None = None
        self._publisher = None
        if self.threaded:
            self._publisher = threading.Thread(target=self._publish_updates, name="megatrain-shard-flags",
                                               daemon=True)
            self._publisher.start()

    # ---- engine side ------------------------------------------------------------------------------
    def put(self, unit_index: int, grad: torch.Tensor, to_host: bool) -> None:
        n, L, S = grad.numel(), self.world.local_size, self.parts[unit_index]
        lo, hi = self.ranges[unit_index]
        works = []
        if L == 1:
            out = grad
        else:
            out = torch.empty(hi - lo, dtype=torch.float32, device=grad.device)
            if S:
                works.append(_reduce_scatter(out[:S], grad[: L * S], group=self.groups.local, async_op=True))
            if n > L * S:
                works.append(dist.reduce(grad[L * S:], dst=self.last_local, group=self.groups.local, async_op=True))
        r = _Reduction(unit_index, out, grad, works, to_host)
        if self.cuda:
            with torch.cuda.stream(self.comm):
                self._complete(r)
            grad.record_stream(self.comm)
            out.record_stream(self.comm)
            self.inner.d2h.wait_stream(self.comm)  # the copy out of the shard waits for its reduction
            self.inner.put(unit_index, out, to_host)
        else:
            self._pending.append(r)

    def _complete(self, r: _Reduction) -> None:
        """The reduction's last stages (on CUDA: queued on the comm stream, which waits for NCCL's)."""
        for w in r.works:
            w.wait()
        n, L, S = r.grad.numel(), self.world.local_size, self.parts[r.unit]
        if L > 1 and n > L * S and self.world.local_rank == L - 1:
            r.out[S:].copy_(r.grad[L * S:])
        if self.groups.cross is not None:
            dist.all_reduce(r.out, group=self.groups.cross, async_op=True).wait()
        self._sq.append(squared_norm(r.out))

    def shard_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced shards of the step, on the device (after every reduction)."""
        for r in self._pending:  # CPU: gloo's reductions were left running during the backward
            self._complete(r)
            self.inner.put(r.unit, r.out, r.to_host)
        self._pending.clear()
        sq, self._sq = self._sq, []
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.comm)
            for t in sq:
                t.record_stream(compute)
        return torch.stack(sq).sum() if sq else torch.zeros((), device=self.device)

    def host_buffer(self, unit_index: int) -> torch.Tensor | None:
        return None  # the pipeline's host buffers hold a shard; a wave group's accumulator is the whole unit

    def wait_for_update(self, unit_index: int) -> None:
        self.inner.wait_for_update(unit_index)
        if self._publish_error is not None:
            raise self._publish_error
        self.flags.wait_updated(unit_index, self.steps, self.wait_timeout)

    def gradient(self, unit_index: int) -> torch.Tensor:
        """This rank's reduced shard of a unit's gradient (for tests)."""
        return self.inner.gradient(unit_index)

    # ---- trainer side -----------------------------------------------------------------------------
    def begin_step(self, *, lr: float | None) -> None:
        """As OptimizerPipeline.begin_step: with an lr (no clipping) each shard's update is queued as soon as its
        reduction is (CUDA: during backward; CPU: gloo's reductions finish when the norm is asked for)."""
        self.inner.begin_step(lr=lr)

    def finish_step(self, *, lr: float, clip_coef: float) -> None:
        if self._pending:
            self.shard_sq_norm()
        self.inner.finish_step(lr=lr, clip_coef=clip_coef)
        self.steps += 1
        if self.threaded:
            self._publish.put(self.steps)
        else:  # the updates ran inline
            for u in self.order:
                self.flags.publish(u, self.steps)

    def drain(self) -> None:
        for u in self.order:
            self.wait_for_update(u)

    def add_before_update(self, hook) -> None:
        self.inner.add_before_update(hook)

    def take_stats(self) -> dict:
        return self.inner.take_stats()

    @property
    def stats(self) -> dict:
        return self.inner.stats

    def close(self) -> None:
        if self._publisher is not None:
            self._publish.put(None)
            self._publisher.join(timeout=60)
            self._publisher = None
        self.inner.close()

    def _publish_updates(self) -> None:
        try:
            while (steps := self._publish.get()) is not None:
                for u in self.order:
                    self.inner.wait_for_update(u)
                    self.flags.publish(u, steps)
        except BaseException as e:  # the pipeline failed: its own error reaches the training thread
            self._publish_error = e
