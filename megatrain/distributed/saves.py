"""Checkpoints in a distributed run are written once, by rank 0, from its node's shared store.

Rank 0 runs the ordinary CheckpointSaver (checkpoint/saver.py) with the node's NodeFlags as its listener: the save
step is announced before the writer starts and each unit is marked as the writer finishes it. The other ranks run
a `FollowerSaver`, which writes nothing: on rank 0's node, before its rank's optimizer modifies its shard of unit
u, it waits until the save in progress has written unit u, or rank 0 has staged it (copied the whole unit, every
rank's shard, into its staging pool before its own update of it), so the files hold exactly one step's state, as in
a single-process run (the ranks of other nodes update their own replica and never wait).
"""

from __future__ import annotations

from pathlib import Path

from .shared import NodeFlags


class FollowerSaver:
    """The saver of a rank other than 0: the CheckpointSaver's interface, no files."""

    def __init__(self, root: Path, flags: NodeFlags | None, pipeline):
        """flags: rank 0's node's flags (None on other nodes: nothing to wait for)."""
        self.root, self.flags = Path(root), flags
        self.last: Path | None = None
        self.last_seconds = 0.0
        if flags is not None:
            pipeline.add_before_update(self.before_update)

    def before_update(self, unit_index: int) -> None:
        self.flags.wait_written(unit_index)

    @property
    def busy(self) -> bool:
        return False

    def step_done(self, step, run_state, write_files=None, stopping: bool = False) -> bool:
        return False

    def wait(self) -> Path | None:
        return None

    def clear(self) -> int:
        return 0

    def abandon(self) -> None:
        pass
