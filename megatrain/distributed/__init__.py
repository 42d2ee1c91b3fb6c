"""Several GPUs and several machines: data-parallel ranks launched by torchrun, one host store per node. Modules:

    world.py     who this process is (torchrun's environment); how a unit is cut into one shard per local rank
    session.py   Distributed: process groups (NCCL on CUDA, gloo on CPU), host-side agreement, failure reports
    watchdog.py  heartbeats and published failures: a rank that dies, raises or hangs ends the run on every rank
    shared.py    the node's shared memory (the host store's allocator) and the flags its ranks share
    grads.py     ShardedPipeline: reduce-scatter of each unit's gradient, each rank updating its shard
    step.py      DistributedEngine (one step over every rank: totals, global loss and norm) and build_runtime
    saves.py     checkpoints written once by rank 0; the other ranks' FollowerSaver

One rank's engine is the single-GPU engine; what this package adds sits around it: the store's memory, the
gradient sink, the step's totals. The run (megatrain/run) starts it when torchrun launched the process.
"""

from .saves import FollowerSaver
from .session import Distributed
from .step import DistributedEngine, build_runtime as build_distributed_runtime
from .world import World, from_env, shard_range

__all__ = ["Distributed", "DistributedEngine", "FollowerSaver", "World", "build_distributed_runtime", "from_env",
           "shard_range"]
