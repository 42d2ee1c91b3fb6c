"""Several GPUs and several machines: data-parallel ranks launched by torchrun, one host store per node. Modules:

    world.py     who this process is (torchrun's environment); how a unit is cut into one shard per local rank
    ranks.py     Ranks: what the run asks of its processes; OneProcess, a run of one (Distributed is the other)
    session.py   Distributed: process groups (NCCL on CUDA, gloo on CPU), host-side agreement, failure reports,
                 this rank's runtime
    watchdog.py  heartbeats and published failures: a rank that dies, raises or hangs ends the run on every rank
    shared.py    the node's shared memory (the host store's allocator) and the flags its ranks share
    grads.py     ShardedPipeline: reduce-scatter of each unit's gradient, each rank updating its shard
    step.py      DistributedEngine (one step over every rank: totals, global loss and norm)
    saves.py     checkpoints written once by rank 0; the other ranks' FollowerSaver

One rank's engine is the single-GPU engine; what this package adds sits around it: the store's memory, the
gradient sink, the step's totals. The run (megatrain/run) starts it when torchrun launched the process.
"""

from .ranks import OneProcess, Ranks, resolve_device
from .saves import FollowerSaver
from .session import Distributed
from .step import DistributedEngine
from .world import World, from_env, shard_range

__all__ = ["Distributed", "DistributedEngine", "FollowerSaver", "OneProcess", "Ranks", "World", "from_env",
           "resolve_device", "shard_range"]
