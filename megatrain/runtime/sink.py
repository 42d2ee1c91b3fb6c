"""Where the engine's finished gradients go: `GradientSink`, what the engine asks of it (the optimizer pipeline,
runtime/optimizer_pipeline.py), and `CollectGrads`, a sink that keeps them (tests, exports)."""

from __future__ import annotations

from typing import Protocol

import torch


class GradientSink(Protocol):
    """Where finished gradients go (the optimizer pipeline; CollectGrads in tests), and whose updates the next
    forward waits for."""

    def put(self, unit_index: int, grad: torch.Tensor, to_host: bool) -> None: ...  # on the compute stream's
    #   timeline; to_host: the schedule sends this gradient to pinned host memory at once. It may start the update
    #   (no clipping), holding the caller while earlier gradients still wait on the device

    def wait_for_update(self, unit_index: int) -> None: ...  # before unit u's weights are streamed for a forward

    def host_buffer(self, unit_index: int) -> torch.Tensor | None: ...  # the pinned host buffer this unit's
    #   finished gradient will be copied into (to_host units), which a wave group's accumulator may wait in


class CollectGrads:
    """A sink that keeps each unit's fp32 gradient where it was made and applies no update."""

    def __init__(self):
        self.grads: dict[int, torch.Tensor] = {}

    def put(self, unit_index: int, grad: torch.Tensor, to_host: bool = False) -> None:
        self.grads[unit_index] = grad

    def wait_for_update(self, unit_index: int) -> None:
        pass

    def host_buffer(self, unit_index: int) -> torch.Tensor | None:
        return None
