"""What each process of a run writes: one process, or rank 0 of a distributed run, writes output.dir (metrics,
checkpoints, the export); every other rank logs nothing and runs a FollowerSaver (megatrain/distributed/saves.py),
which writes nothing but keeps its rank's updates behind rank 0's background save of the shared store."""

from __future__ import annotations

from ..checkpoint import CheckpointSaver
from .metrics import MetricsLogger


class QuietLog:
    """MetricsLogger's interface for the ranks that do not write."""

    stats = None

    def info(self, msg: str) -> None:
        pass

    def log(self, record: dict) -> None:
        pass

    def enable_wandb(self, config: dict | None = None, name: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def open_log(run, total_steps: int, start_step: int, tensorboard: bool):
    if run.writes:
        return MetricsLogger(run.out_dir, total_steps, start_step=start_step, tensorboard=tensorboard)
    return QuietLog()


def open_saver(run, *, keep: int, every: int, final_step: int | None):
    root = run.out_dir / "checkpoints"
    if run.writes:
        staging = int((run.plan.io if run.plan is not None else {}).get("staging_bytes", 0))  # the plan's bound
        return CheckpointSaver(root, run.store, run.pipeline, keep=keep, every=every, final_step=final_step,
                               world=run.world_info, listener=run.ranks.flags, staging_bytes=staging)
    from ..distributed import FollowerSaver

    on_writer_node = run.ranks.world.node == 0
    return FollowerSaver(root, run.ranks.flags if on_writer_node else None, run.pipeline)
