"""LayerTile: one unit's parameters and optimizer states as flat views, where the store keeps them (its slices of
each host allocation, store.py) or a part of them (a rank's shard of each unit, distributed/grads.py); what CpuAdamW
updates (adamw.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..models import Unit


@dataclass
class LayerTile:
    """One unit's slice of each host allocation, plus its layout."""

    unit: Unit
    master: torch.Tensor | None  # fp32, flat (None: on the SSD tier)
    exp_avg: torch.Tensor | None  # Adam m, fp32 (None: on the SSD tier)
    exp_avg_sq: torch.Tensor | None  # Adam v, fp32 (None: on the SSD tier)
    stream: torch.Tensor  # what is sent to the GPU: bf16 copy, or the master itself in fp32 mode
    step: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float32))  # Adam step count

    @property
    def numel(self) -> int:
        return self.unit.numel

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into any flat buffer laid out like this tile (host tile, GPU slot, gradient)."""
        return self.unit.views(flat)
