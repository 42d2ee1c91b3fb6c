"""The processes of a run, as the run (megatrain/run) sees them: `Ranks`, with two implementations.

    OneProcess    a plain `megatrain train`: rank 0 of a world of one, which writes output.dir and fills its own
                  store; every wait returns at once, every agreement and sum is this process's own value
    Distributed   one rank of a torchrun launch (session.py): process groups, the node's shared store, a watchdog

run/launch.py starts one or the other.

The run calls the same methods in both, so its code has one path: a step that only a distributed run needs (waiting
for the other ranks, sharing the node's store) is a method that does nothing in a run of one process.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import Protocol

import torch

from ..errors import MegatrainError
from ..runtime import CpuAdamW, HostStore, Runtime, RuntimeOptions, build_runtime
from .shared import NodeFlags
from .watchdog import Failure
from .world import World


class Ranks(Protocol):
    """What the run asks of its processes: who this one is, waiting for the others, small agreements, the host
    store's memory and the runtime of one rank."""

    world: World  # this process's place: rank, size, node, local rank
    flags: NodeFlags | None  # the node's shared update flags (None: a run of one process)
    threads: int  # CPU threads of this process (a rank: its share of the node's cores)

    @property
    def device(self) -> torch.device:
        """The device this process trains on."""
        ...

    @property
    def allocate(self) -> Callable[..., torch.Tensor] | None:
        """The host store's allocator (HostStore's `allocate`; None: the store's own, private memory)."""
        ...

    def node_phase(self, name: str) -> None:
        """Until every rank of this node has reached `name`."""
        ...

    def phase(self, name: str) -> None:
        """Until every rank of the run has reached `name`."""
        ...

    def agreed(self, name: str, compute: Callable[[], float]) -> float:
        """A number every rank uses alike: rank 0's `compute()` (planner.plan.run_profile's `agree`)."""
        ...

    def all_sum(self, values: list[float]) -> list[float]:
        """The sums of `values` over every rank."""
        ...

    def agree_stop(self, requested: str | None) -> str | None:
        """The stop request (a signal's name) of any rank, agreed at a step boundary."""
        ...

    def make_flags(self, num_units: int) -> NodeFlags | None:
        """The node's shared flags over the store's units, once the store is allocated."""
        ...

    def store_filled(self, store: HostStore) -> None:
        """After the store's first state was loaded (by local rank 0): every rank may use it."""
        ...

    def build_runtime(self, store: HostStore, optimizer: CpuAdamW, options: RuntimeOptions) -> Runtime:
        """This process's engine and optimizer pipeline over the filled store."""
        ...

    def step_tokens(self, tokens: int) -> int:
        """Real tokens of the step just trained on every rank; `tokens`: this process's."""
        ...

    def publish(self, exc: BaseException) -> Failure | None:
        """This process is failing: the other ranks are told at once. Returns the run's first failure."""
        ...

    def failed(self, exc: BaseException) -> BaseException:
        """What to raise for `exc`, after `publish`: `exc` itself when the failure is this process's own."""
        ...

    def finish(self) -> None:
        """The run ended well: release what connects the ranks."""
        ...


def resolve_device(choice: str) -> torch.device:
    """train.device: "auto" is CUDA when torch sees a device, else the CPU."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise MegatrainError("train.device: 'cuda' was asked for but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


class OneProcess:
    """A run of one process (`Ranks`): rank 0 of a world of one."""

    world = World(rank=0, size=1, local_rank=0, local_size=1, node=0)
    flags = None

    def __init__(self, device_choice: str = "auto"):
        """device_choice: train.device, resolved when the run first asks for its device (after the config's paths
        are checked: an unusable device is one of the inputs `check_inputs` refuses, in its order)."""
        self.device_choice = device_choice
        self.threads = torch.get_num_threads()

    @cached_property
    def device(self) -> torch.device:
        return resolve_device(self.device_choice)

    @property
    def allocate(self) -> None:
        return None

    def node_phase(self, name: str) -> None:
        pass

    def phase(self, name: str) -> None:
        pass

    def agreed(self, name: str, compute: Callable[[], float]) -> float:
        return compute()

    def all_sum(self, values: list[float]) -> list[float]:
        return values

    def agree_stop(self, requested: str | None) -> str | None:
        return requested

    def make_flags(self, num_units: int) -> None:
        return None

    def store_filled(self, store: HostStore) -> None:
        pass

    def build_runtime(self, store: HostStore, optimizer: CpuAdamW, options: RuntimeOptions) -> Runtime:
        return build_runtime(store, self.device, optimizer, options)

    def step_tokens(self, tokens: int) -> int:
        return tokens

    def publish(self, exc: BaseException) -> None:
        return None

    def failed(self, exc: BaseException) -> BaseException:
        return exc

    def finish(self) -> None:
        pass

