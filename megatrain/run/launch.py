"""`megatrain train` in one process, or as one rank of a torchrun launch.

Under torchrun (`torchrun --nproc-per-node=N [--nnodes=M ...] -m megatrain train CONFIG`) each process starts
megatrain.distributed (process groups, watchdog) on its device (cuda:LOCAL_RANK, or the CPU with gloo), trains as
one rank of the run, and ends it on every rank if it fails: its failure is published with its rank, and a rank
that fails because another did reports that one's message instead (megatrain/distributed/session.py). Started any
other way, the run is one process (megatrain.distributed.OneProcess), on the same path.
"""

from __future__ import annotations

import torch

from ..config import Config
from ..distributed import Distributed, OneProcess, Ranks, from_env, resolve_device
from .trainer import train as train_one


def train(cfg: Config, since_process_start: bool = False, config_read_at: float | None = None) -> dict:
    """since_process_start: the start-up's timing (the start summary, metrics.jsonl's startup_s) begins at the
    process's start: `megatrain train`; config_read_at: when it had read the config (time.time())."""
    ranks = start_ranks(cfg.train.device)
    try:
        summary = train_one(cfg, ranks, since_process_start, config_read_at)
    except BaseException as e:
        report = ranks.failed(e)  # published already if it happened in the step loop (Run.failing)
        if report is e:
            raise
        raise report from None
    ranks.finish()
    return summary


def start_ranks(device_choice: str) -> Ranks:
    """This process's ranks: one of torchrun's when torchrun launched it with a world of more than one (on
    cuda:LOCAL_RANK, or the CPU with gloo), else one process on train.device."""
    world = from_env()
    if world is None:
        return OneProcess(device_choice)
    device = resolve_device(device_choice)
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    return Distributed.start(world, device)
