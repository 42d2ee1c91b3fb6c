"""`megatrain train` in one process, or as one rank of a torchrun launch.

Under torchrun (`torchrun --nproc-per-node=N [--nnodes=M ...] -m megatrain train CONFIG`) each process starts
megatrain.distributed (process groups, watchdog) on its device (cuda:LOCAL_RANK, or the CPU with gloo), trains as
one rank of the run, and ends it on every rank if it fails: its failure is published with its rank, and a rank
that fails because another did reports that one's message instead (megatrain/distributed/session.py).
"""

from __future__ import annotations

import torch

from ..config import Config
from .prepare import resolve_device
from .trainer import train as train_one


def train(cfg: Config, since_process_start: bool = False) -> dict:
    """since_process_start: the start-up's timing (the start summary, metrics.jsonl's startup_s) begins at the
    process's start: `megatrain train`."""
    from ..distributed import Distributed, from_env

    world = from_env()
    if world is None:
        return train_one(cfg, since_process_start=since_process_start)
    device = resolve_device(cfg.train.device)
    if device.type == "cuda":
        device = torch.device("cuda", world.local_rank)
    d = Distributed.start(world, device)
    try:
        summary = train_one(cfg, d, since_process_start)
    except BaseException as e:
        report = d.failed(e)  # published already if it happened in the step loop (Run.failing)
        if report is e:
            raise
        raise report from None
    d.finish()
    return summary
