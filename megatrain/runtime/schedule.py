"""One training step's order of work, as data: the engine executes it, the planner simulates it.

A step is a list of `Use`s, each the weights of one or two units held in a slot while every micro-batch passes
through them (layer-major waves, DESIGN.md rule 1):

    embed              the embedding lookup
    forward, layer l   l = 0 .. L-1
    head               final norm + LM head + loss, fused with its backward (the embedding too when tied)
    backward, layer l  l = L-1 .. 0 (recompute from the layer's input checkpoint, then local backward)

after which the embedding's gradient is a scatter-add that needs no weights. Gradients complete in
`gradient_order`: head, last layer, ..., first layer, embedding. Units are numbered in forward order: 0 the
embedding, 1 .. L the layers, L + 1 the head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Use:
    units: tuple[int, ...]  # unit indices whose weights this use streams into one slot, in this order
    kind: Literal["embed", "forward", "head", "backward"]
    layer: int | None = None  # 0-based layer number for forward and backward uses

    @property
    def forward(self) -> bool:
        """Part of the forward wave (the head included): its weights must hold this step's update."""
        return self.kind != "backward"


def head_units(num_units: int, tied: bool) -> tuple[int, ...]:
    """The units the head uses: the head (final norm, LM head), and the embedding when the LM head is tied to it."""
    return (num_units - 1, 0) if tied else (num_units - 1,)


def step_schedule(num_units: int, tied: bool) -> list[Use]:
    layers = num_units - 2
    return ([Use((0,), "embed")] + [Use((1 + l,), "forward", l) for l in range(layers)]
            + [Use(head_units(num_units, tied), "head")]
            + [Use((1 + l,), "backward", l) for l in reversed(range(layers))])


def gradient_order(num_units: int) -> list[int]:
    """Unit indices in the order their gradients are complete in backward: head, last layer, ..., embedding."""
    return [num_units - 1] + list(range(num_units - 2, 0, -1)) + [0]


def slot_numel(unit_numels: list[int], tied: bool) -> int:
    """Elements of one weight slot: the largest use (one unit, or the head with the tied embedding)."""
    head = sum(unit_numels[i] for i in head_units(len(unit_numels), tied))
    return max(max(unit_numels), head)
