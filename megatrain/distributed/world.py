"""Who this process is among a run's ranks, read from torchrun's environment, and how a unit is cut into shards.

torchrun (`torchrun --nproc-per-node=L [--nnodes=N ...] -m megatrain train CONFIG`) starts L processes on each of
N nodes and tells each its global RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and its node (GROUP_RANK). A
process started any other way, or with a world of one, is a plain single-process run.

Shards: every unit's tile is cut into `local_size` contiguous ranges, one per local rank, so each rank's CPU AdamW
updates a disjoint part of the node's shared store. Range boundaries sit on multiples of adamw.CHUNK when the unit
is large enough (the update of a range is then bit-identical to the same elements of a whole-tile update) and of a
page otherwise, so no two ranks ever write the same page. The first L-1 ranges are equal (what a reduce-scatter
needs); the last rank also takes the remainder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import MegatrainError
from ..runtime.adamw import CHUNK
from ..runtime.store import ALIGN_ELEMS


@dataclass(frozen=True)
class World:
    rank: int  # global rank, 0 .. size-1
    size: int
    local_rank: int  # rank within the node
    local_size: int  # ranks per node (the same on every node)
    node: int  # 0 .. nodes-1

    @property
    def nodes(self) -> int:
        return self.size // self.local_size

    @property
    def writer(self) -> bool:
        """Rank 0 writes output.dir: metrics, checkpoints, the export."""
        return self.rank == 0

    @property
    def fills_store(self) -> bool:
        """Local rank 0 loads the node's shared store (weights, a checkpoint, or random init)."""
        return self.local_rank == 0

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, local rank {self.local_rank})"

    def layout(self) -> str:
        return f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.local_size} rank" \
               f"{'s' if self.local_size > 1 else ''} = {self.size} ranks"


def from_env(env=None) -> World | None:
    """This process's place in a torchrun launch; None when not launched by torchrun (or a world of one)."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_size = int(env.get("LOCAL_WORLD_SIZE", size))
        node = int(env.get("GROUP_RANK", rank // max(local_size, 1)))
    except ValueError as e:
        raise MegatrainError(f"torchrun: unreadable rank variables in the environment ({e})") from None
    if size <= 1:
        return None
    if local_size < 1 or size % local_size:
        raise MegatrainError(f"torchrun: {size} ranks do not split into nodes of {local_size} "
                             f"(LOCAL_WORLD_SIZE); every node must run the same --nproc-per-node")
    return World(rank, size, local_rank, local_size, node)


def shard_part(numel: int, parts: int) -> int:
    """Elements of each of the first parts-1 shards of a unit of `numel` (0: the last rank takes it all)."""
    if parts <= 1:
        return numel
    align = CHUNK if numel >= parts * CHUNK else ALIGN_ELEMS
    return numel // parts // align * align


def shard_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of shard `index` of a unit of `numel` elements cut into `parts` (see the module docstring)."""
    s = shard_part(numel, parts)
    lo = index * s
    return lo, (numel if index == parts - 1 else lo + s)
