"""A distributed run's process groups, shared memory, watchdog and failure handling: `Distributed`.

    Distributed.start(world, device)   connects to torchrun's rendezvous store, initialises the process groups
                                       (NCCL on CUDA, gloo on CPU; a gloo group for host-side agreement in both),
                                       starts the watchdog, splits the node's cores between its ranks
    groups.local / groups.cross        the ranks of this node / the ranks with this local rank on every node
    memory, flags                      the node's shared memory (the host store's allocator) and shared flags
    node_phase / phase                 wait until every rank of the node / of the run has reached a point, for as
                                       long as it takes (a rank loading a 70B model): the watchdog ends the wait if
                                       a rank fails, so these carry no timeout
    all_sum, agree_stop                small host-side all-reduces (gloo): counts of a step, the stop request
    build_runtime                      this rank's runtime: a ShardedPipeline and a DistributedEngine (step.py)
    failed(exc)                        publishes this rank's failure, or reports the one that caused it
    finish()                           marks this rank done, stops the watchdog, destroys the process groups

Collectives carry MEGATRAIN_DIST_TIMEOUT_S (default 1800 s), the heartbeats MEGATRAIN_HEARTBEAT_TIMEOUT_S (30 s).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import MegatrainError
from ..runtime import CpuAdamW, HostStore, Runtime, RuntimeOptions, build_runtime
from .grads import ShardedPipeline
from .shared import NodeFlags, NodeMemory
from .step import DistributedEngine
from .watchdog import Failure, Watchdog, heartbeat_timeout, publish_failure, read_failure
from .world import World

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")
PEER_GRACE_S = 5.0  # a collective that failed because a peer died: how long to wait for that peer's message


@dataclass
class ProcessGroups:
    backend: str  # of the gradient reductions: nccl on CUDA, gloo on CPU
    control: dist.ProcessGroup  # gloo, every rank: host-side counts and agreement
    local: dist.ProcessGroup  # this node's ranks
    local_ranks: list[int]  # their global ranks, by local rank
    cross: dist.ProcessGroup | None  # the ranks of every node with this local rank (None with one node)
    local_control: dist.ProcessGroup  # gloo, this node's ranks (the local group itself on CPU)


def dist_timeout() -> float:
    try:
        return float(os.environ.get("MEGATRAIN_DIST_TIMEOUT_S", "1800"))
    except ValueError:
        raise MegatrainError("MEGATRAIN_DIST_TIMEOUT_S: not a number of seconds") from None


def _connect(world: World, timeout: float):
    """A client of torchrun's rendezvous store (rank 0 hosts it when torchrun's agent does not), keys under this
    launch's prefix."""
    env = os.environ
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not host or not port:
        raise MegatrainError("torchrun: MASTER_ADDR and MASTER_PORT are not set; launch with torchrun")
    master = world.rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(host, int(port), world.size if master else None, master, timedelta(seconds=timeout),
                              wait_for_workers=False)
    except (RuntimeError, ValueError, OSError) as e:
        raise MegatrainError(f"torchrun: {world.describe()} cannot reach the rendezvous store at {host}:{port} "
                             f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    prefix = f"megatrain/{env.get('TORCHELASTIC_RUN_ID', 'run')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    return dist.PrefixStore(prefix, store)


class Distributed:
    """One rank of a torchrun launch: the run's `Ranks` (ranks.py) for a distributed run."""

    def __init__(self, world: World, device: torch.device, store, groups: ProcessGroups, watchdog: Watchdog):
        self.world, self.device, self.store, self.groups, self.watchdog = world, device, store, groups, watchdog
        self.memory = NodeMemory(store, world)
        self.flags: NodeFlags | None = None  # made with the store (it needs the number of units)
        self.threads = max(1, len(os.sched_getaffinity(0)) // world.local_size)
        self.timeout = dist_timeout()
        self._phases: dict[str, int] = {}
        self._first: Failure | None = None  # the run's first failure, once this rank has seen one
        self.engine: DistributedEngine | None = None  # made by build_runtime

    @classmethod
    def start(cls, world: World, device: torch.device) -> "Distributed":
        # a rank that dies in native code (SIGSEGV, SIGABRT) prints every thread's Python stack: which one it was
        faulthandler.enable(all_threads=True)
        timeout = dist_timeout()
        store = _connect(world, timeout)
        watchdog = Watchdog(_connect(world, timeout), world, heartbeat_timeout())
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.set_device(device)
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, store=dist.PrefixStore("pg/", store), rank=world.rank,
                                world_size=world.size, timeout=timedelta(seconds=timeout))
        try:
            watchdog.start()  # every rank has registered: the group's init waited for all of them
            groups = _groups(world, backend)
        except BaseException:
            dist.destroy_process_group()
            raise
        d = cls(world, device, store, groups, watchdog)
        torch.set_num_threads(d.threads)  # the node's cores split between its ranks (torchrun's default is 1)
        return d

    # ---- waiting for each other ------------------------------------------------------------------------
    def _arrive(self, name: str, count: int) -> None:
        n = self._phases[name] = self._phases.get(name, 0) + 1
        key = f"phase/{name}/{n}"
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < count:
            time.sleep(0.01)

    def node_phase(self, name: str) -> None:
        """Until every rank of this node has reached `name` (no timeout: see the module docstring)."""
        self._arrive(f"{name}/node{self.world.node}", self.world.local_size)

    def phase(self, name: str) -> None:
        """Until every rank of the run has reached `name`."""
        self._arrive(name, self.world.size)

    def agreed(self, name: str, compute) -> float:
        """A number every rank must use alike (the CPU AdamW rate the plan is made with: ranks planning with rates
        measured each on its own would choose different placements): rank 0 computes it and publishes it in the
        store, the other ranks wait for it there (the store's timeout) and read it. Every rank arrives first: the
        ranks check their inputs at once, and a rate is measured only while the others wait idle."""
        self.phase(f"agree/{name}")
        key = f"agreed/{name}"
        if self.world.rank == 0:
            try:
                value = float(compute())
            except Exception as e:  # the others raise too (the caller may fall back, as rank 0's does)
                self.store.set(key, f"failed: {type(e).__name__}: {e}")
                raise
            self.store.set(key, repr(value))
            return value
        got = self.store.get(key).decode()
        if got.startswith("failed: "):
            raise RuntimeError(f"rank 0 could not compute {name} ({got[len('failed: '):]})")
        return float(got)

    # ---- small host-side collectives -----------------------------------------------------------------
    def all_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.groups.control)
        return t.tolist()

    def agree_stop(self, requested: str | None) -> str | None:
        """The stop request of any rank, agreed by all at this step boundary (SIGTERM to one rank stops all)."""
        code = torch.tensor([STOP_SIGNALS.index(requested) + 1 if requested in STOP_SIGNALS else
                             (len(STOP_SIGNALS) + 1 if requested else 0)], dtype=torch.int64)
        dist.all_reduce(code, op=dist.ReduceOp.MAX, group=self.groups.control)
        c = int(code)
        return None if c == 0 else (STOP_SIGNALS[c - 1] if c <= len(STOP_SIGNALS) else "a stop request")

    # ---- the node's shared store --------------------------------------------------------------------
    @property
    def allocate(self):
        """The host store's allocator: memory shared by the node's ranks."""
        return self.memory.allocate

    def make_flags(self, num_units: int) -> NodeFlags:
        self.flags = NodeFlags(self.memory, num_units, self.world)
        return self.flags

    def store_filled(self, store) -> None:
        """After local rank 0 filled the shared store: every local rank waits for it, takes its Adam step
        counters (per process, like the rest of a tile's bookkeeping) and closes its shared-memory descriptors."""
        self.node_phase("filled")
        steps = torch.stack([t.step for t in store.tiles]).clone()
        dist.broadcast(steps, src=self.groups.local_ranks[0], group=self.groups.local_control)
        for t, s in zip(store.tiles, steps):
            t.step.copy_(s)
        self.memory.release_files()

    # ---- this rank's runtime ------------------------------------------------------------------------
    def build_runtime(self, store: HostStore, optimizer: CpuAdamW, options: RuntimeOptions) -> Runtime:
        """runtime.build_runtime for this rank: the pipeline is a ShardedPipeline over this rank's shards, the engine
        a DistributedEngine (step.py). The node's shared store must be filled (store_filled)."""
        def make_pipeline(pinned, to_host, timeline):
            return ShardedPipeline(store, optimizer, self.device, pinned, self.world, self.groups, self.flags,
                                   threaded=options.threaded_optimizer, to_host=to_host,
                                   threads=options.adam_threads or self.threads, timeline=timeline,
                                   wait_timeout=self.timeout)

        rt = build_runtime(store, self.device, optimizer, options, make_pipeline,
                           "host store's streaming copy (shared by the node's ranks)")
        self.engine = DistributedEngine(rt.engine, rt.pipeline, self)
        return Runtime(store, self.engine, rt.pipeline, rt.pinned, rt.timeline)

    def step_tokens(self, tokens: int) -> int:
        """Real tokens of the step just trained on every rank (the engine summed them before the step)."""
        return self.engine.world_tokens

    # ---- the end --------------------------------------------------------------------------------------
    def publish(self, exc: BaseException) -> Failure:
        """Record this rank's failure for every rank to see, unless another rank's failure came first (or caused
        this one: a collective that broke because a peer died waits a moment for that peer's message). Returns the
        run's first failure. Called once, as early as possible (the other ranks stop at once)."""
        if self._first is None:
            if threading.current_thread() is threading.main_thread():  # torchrun SIGTERMs the survivors of a failed
                signal.signal(signal.SIGTERM, signal.SIG_IGN)          # rank: say what happened first, then exit
            first = self._first_failure(exc)
            if first is None:
                first = publish_failure(self.store, self.world.rank, f"{self.world.describe()}: {_describe(exc)}",
                                        input_error=isinstance(exc, MegatrainError))
            self._first = first
        return self._first

    def failed(self, exc: BaseException) -> BaseException:
        """This rank is failing with `exc`: publish it (`publish`) and return what to raise: `exc` when it is this
        rank's own failure (the command line reports it as usual), else a SystemExit once the first failure's
        message is printed (not for bad input, which its rank reports: every rank would say the same)."""
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return exc
        first = self.publish(exc)
        if first.rank == self.world.rank:
            return exc
        self.watchdog.stop()  # it would print the same message
        if first.input_error:
            return SystemExit(2)
        print(f"megatrain: error: stopping: {first.message}", flush=True, file=sys.stderr)
        return SystemExit(1)

    def _first_failure(self, exc: BaseException) -> Failure | None:
        """The failure another rank published, waiting a moment for it when `exc` looks like its consequence."""
        deadline = time.monotonic() + (PEER_GRACE_S if _communication_error(exc) else 0.0)
        while True:
            try:
                found = read_failure(self.store)
            except Exception:  # the store is gone too: nothing more to learn
                return None
            if found is not None or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    def finish(self) -> None:
        self.watchdog.stop(done=True)
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _describe(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (a second SIGTERM/SIGINT, or Ctrl-C)"
    if isinstance(exc, MegatrainError):
        return str(exc)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _communication_error(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}".lower()
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        w in text for w in ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "peer"))


def _groups(world: World, backend: str) -> ProcessGroups:
    """Every rank makes every group, in the same order (as torch.distributed requires)."""
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    layout: list = [None] * world.size
    dist.all_gather_object(layout, (world.node, world.local_rank), group=control)
    local = cross = local_control = None
    local_ranks: list[int] = []
    for node in range(world.nodes):
        ranks = sorted((r for r in range(world.size) if layout[r][0] == node), key=lambda r: layout[r][1])
        g = dist.new_group(ranks, backend=backend)
        gc = dist.new_group(ranks, backend="gloo") if backend != "gloo" else g
        if node == world.node:
            local, local_control, local_ranks = g, gc, ranks
    if world.nodes > 1:
        for lr in range(world.local_size):
            ranks = sorted((r for r in range(world.size) if layout[r][1] == lr), key=lambda r: layout[r][0])
            g = dist.new_group(ranks, backend=backend)
            if lr == world.local_rank:
                cross = g
    return ProcessGroups(backend, control, local, local_ranks, cross, local_control)
