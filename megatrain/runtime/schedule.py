"""One training step's order of work, as data: the engine executes it, the planner simulates it (docs/design.md,
rule 10).

A step is a list of `Use`s. Each streams the weights of one or two units into a slot (none for the embedding's
backward) while every micro-batch of one wave group passes through them (layer-major waves, rule 1). A `Placement`
decides, before the step, where everything lives:

    checkpoint_every K   the input of every K-th layer (0, K, 2K, ...) is kept in the forward wave; in backward a
                         block's other inputs are rebuilt from its kept one ('rebuild' uses: the block's weights
                         stream once more) before the block's backward
    keep_top_layers T    with K > 1: the top T layers keep every input (no rebuild), the layers below them are in
                         blocks of K, so rebuilds cost only what the memory needs (default 0: every layer in blocks)
    spill_layers S       kept inputs of layers below S live in pinned host memory, not on the GPU; each comes back
                         one block ahead of its backward (`Use.fetch`)
    grads_to_host N      the first N units to finish their gradient (head, last layer, ...) send it to pinned host
                         memory as soon as it is complete; the others wait on the GPU for the optimizer
    stream_dtype         with bf16 compute, what the host streams: its bf16 copy, or the fp32 master (cast on the
                         device: no bf16 copy on the host); it changes where bytes live, not the step's order
    wave_groups G        the step's micro-batches run in G consecutive groups, each a whole forward and backward
                         wave; gradients accumulate across groups (on the GPU, or parked in pinned host memory
                         between groups: `group_grads`), the optimizer runs once per step: the same step
    seq_tile t           inside each layer use, the per-token work (q/k/v, o_proj, MLP) runs over tiles of t
                         tokens (runtime/layer.py): it changes a use's working set, not the step's order
    reuse_attention N    of the top N layers, those whose input is kept (not rebuilt) keep their attention (q, k, v,
                         its output and what the kernel saves) from the forward wave on the GPU until their backward
                         (`Use.stash`), which then neither recomputes q, k, v nor runs the attention forward again
    attn_block b         plain causal rows longer than b tokens run the attention's backward over (query block, key
                         block) pairs of b tokens from the forward's output and log-sum-exp (models/attention.py): a
                         use's working set without the fused kernel's row-sized fp32 d(q) and expanded d(k), d(v)

Per group g, the uses are:

    embed                    the embedding lookup
    forward, layer l         l = 0 .. L-1; `keep`: this layer's input is kept on the GPU, spilled, or dropped
    head                     final norm + LM head + loss with its backward (the embedding too when tied)
    per block, top down:     rebuild, layer s .. e-2   (forward from the block's kept input; outputs kept)
                             backward, layer e-1 .. s  (recompute + local backward; fp32 gradient accumulated)
    embed_backward           scatter-add of the input gradient into the embedding's gradient (no weights)

Units are numbered in forward order: 0 the embedding, 1 .. L the layers, L + 1 the head. A unit's gradient is
complete after its last use of the last group; `Use.grad` says where it goes then (or where the accumulator waits
between groups).

Every model of the step visits it through `ScheduleVisitor`, one method per kind of use (`KINDS`): the engine's
executor (runtime/engine.py), the planner's memory (planner/memory.py) and time (planner/timing.py) models. `walk`
is the one place that branches on a use's kind; a model that lacks a kind's method cannot be instantiated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal, get_args

from .knobs import knob, knobs

TIED_INPUT = -1  # the accumulator of a tied embedding's input-side gradient (unit 0 accumulates its LM-head side)

Kind = Literal["embed", "forward", "head", "rebuild", "backward", "embed_backward"]
KINDS: tuple[str, ...] = get_args(Kind)  # each is the name of a ScheduleVisitor method


@dataclass(frozen=True)
class Placement:
    """Where a step's tensors live (the module's note says how each knob shapes the schedule). Each field is a knob,
    declared once here with its config key (memory.<name>), bounds and doc (runtime/knobs.py)."""

    checkpoint_every: int = knob(
        1, "keep every K-th layer's input in the forward; rebuild a block's others in backward, streaming its "
           "weights once more", ge=1, shown="always")
    keep_top_layers: int = knob(
        0, "with checkpoint_every > 1: the top N layers keep their inputs, only the layers below are rebuilt in "
           "blocks", ge=0, shown="checkpoint_every")
    spill_layers: int = knob(
        0, "kept inputs of the lowest N layers live in pinned host memory, fetched back a block ahead of their "
           "backward", ge=0, shown="always", code="runtime/activation_spill.py")
    grads_to_host: int = knob(
        0, "the first N units to finish their gradient (head, last layer, ...) send it to pinned host memory at once, "
           "instead of waiting on the GPU for the optimizer", ge=0, shown="always",
        code="runtime/optimizer_pipeline.py")
    wave_groups: int = knob(
        1, "run each step's micro-batches in G groups, each a whole forward and backward wave; gradients accumulate "
           "across groups", ge=1, shown="always")
    group_grads: Literal["gpu", "host"] = knob(
        "gpu", "with wave groups: where gradient accumulators wait between groups", choices=("gpu", "host"),
        shown="wave_groups", code="runtime/accumulators.py")
    stream_dtype: Literal["bf16", "fp32"] = knob(
        "bf16", "bf16 training: stream the host's bf16 copy (14 B/param), or the fp32 master, cast on the GPU: "
                "12 B/param, twice the bus traffic, the same numbers", choices=("bf16", "fp32"),
        unset="chosen: bf16, or fp32 where only it fits, it is faster, or the bf16 copy would leave too little host "
              "RAM free", graphs=True, code="runtime/store.py")
    seq_tile: int = knob(
        0, "run each layer's per-token work (q/k/v, o_proj, MLP) over tiles of this many tokens, so its working set "
           "stops growing with intermediate x sequence", ge=0, zero="whole", graphs=True, code="runtime/layer.py")
    attn_block: int = knob(
        0, "plain causal rows longer than this many tokens run the attention's backward over blocks of this many "
           "queries and keys: no row-sized fp32 d(q) or per-query-head d(k), d(v)", ge=0,
        zero="the fused kernel over the row", unset="chosen at long rows", graphs=True,
        code="models/attention.blockwise_causal")
    reuse_attention: int = knob(
        0, "the top N layers whose input is kept keep their attention (q, k, v, output) on the GPU from the forward "
           "to their backward, which does not run it again", ge=0, zero="none", unset="chosen at long rows",
        graphs=True, code="runtime/layer.AttentionStash")

    def __post_init__(self):
        if not all(k.allows(getattr(self, k.name)) for k in knobs(Placement)):
            raise ValueError(f"invalid placement {self}")


@dataclass(frozen=True)
class Use:
    units: tuple[int, ...]  # unit indices whose weights this use streams into one slot, in this order
    kind: Kind
    layer: int | None = None  # 0-based layer number for forward, rebuild and backward uses
    group: int = 0
    keep: Literal["", "gpu", "host", "drop"] = ""  # forward: where this layer's input boundary goes
    fetch: int | None = None  # bring this layer's spilled input back from host memory during this use
    stash: bool = False  # forward: keep this layer's attention for its backward (Placement.reuse_attention)
    grad: Literal["", "gpu", "host", "group-gpu", "group-host"] = ""  # where the gradient of units[0] (embed:
    #   unit 0) goes after this use: complete -> waits on the GPU / copied to host; accumulating -> waits for
    #   the next group on the GPU / in host memory
    accumulators: tuple[int, ...] = ()  # the fp32 accumulators this use continues into, in the order the engine
    #   brings them back ahead of it when they wait in host memory between groups (head: the head's and the
    #   embedding's; backward: the layer's; embed_backward: a tied embedding's input side, TIED_INPUT)

    @property
    def forward(self) -> bool:
        """Reads weights that must hold this step's update (the forward wave, the head)."""
        return self.kind in ("embed", "forward", "head")

    @property
    def grad_unit(self) -> int:
        """The unit whose gradient `grad` places: units[0], the embedding (unit 0) for embed_backward."""
        return self.units[0] if self.units else 0


class ScheduleVisitor(ABC):
    """A model of the step: one method per kind of use (KINDS), each abstract, so that a model lacking one cannot be
    instantiated. `walk` calls, for each use in step order, `enter(use)`, the method of its kind, `leave(use)`:
    `enter` and `leave` hold the work every use shares (weights in, gradients out), the kind's method its own."""

    def enter(self, use: Use) -> None:
        """Before the use's own work."""

    def leave(self, use: Use) -> None:
        """After the use's own work."""

    @abstractmethod
    def embed(self, use: Use) -> None:
        """The embedding lookup of the group's micro-batches."""

    @abstractmethod
    def forward(self, use: Use) -> None:
        """A layer's forward over the group; `use.keep`: where its input goes, `use.stash`: keep its attention."""

    @abstractmethod
    def head(self, use: Use) -> None:
        """Final norm, LM head and loss with their backward: the group's d(hidden) starts here."""

    @abstractmethod
    def rebuild(self, use: Use) -> None:
        """A layer's forward again from its block's kept input: the input of the layer above, kept until used."""

    @abstractmethod
    def backward(self, use: Use) -> None:
        """A layer's recompute and backward from its input; the layer's gradient accumulated."""

    @abstractmethod
    def embed_backward(self, use: Use) -> None:
        """The scatter-add of the group's input gradient into the embedding's gradient (no weights)."""


def walk(uses: Iterable[Use], visitor: ScheduleVisitor) -> None:
    """Visit the uses in order: `enter`, the method of the use's kind, `leave`. The only place that branches on a
    use's kind: a kind without a method fails here. A visitor with a `forward_run` method is handed each run of
    consecutive forward uses of one wave group instead, to do the same in one call."""
    enter, leave = visitor.enter, visitor.leave
    methods = {kind: getattr(visitor, kind) for kind in KINDS}
    run_forward = getattr(visitor, "forward_run", None)  # a visitor's own loop over a group's forward wave
    run: list[Use] = []
    for use in uses:
        if run_forward is not None:
            if use.kind == "forward" and (not run or run[-1].group == use.group):
                run.append(use)
                continue
            if run:
                run_forward(run)
                run = [use] if use.kind == "forward" else []
                if run:
                    continue
        method = methods.get(use.kind)
        if method is None:
            raise ValueError(f"a use of unknown kind {use.kind!r} (schedule.KINDS: {KINDS})")
        enter(use)
        method(use)
        leave(use)
    if run:
        run_forward(run)


def head_units(num_units: int, tied: bool) -> tuple[int, ...]:
    """The units the head uses: the head (final norm, LM head), and the embedding when the LM head is tied to it."""
    return (num_units - 1, 0) if tied else (num_units - 1,)


def gradient_order(num_units: int) -> list[int]:
    """Unit indices in the order their gradients are complete in backward: head, last layer, ..., embedding."""
    return [num_units - 1] + list(range(num_units - 2, 0, -1)) + [0]


def grads_to_host(num_units: int, placement: Placement) -> list[int]:
    """The units whose finished gradients go to pinned host memory at once (the first to complete, which would
    otherwise wait longest on the GPU for the optimizer)."""
    return gradient_order(num_units)[:placement.grads_to_host]


def blocked_layers(num_layers: int, placement: Placement) -> int:
    """The layers (from the bottom) grouped in blocks of K: all but the top `keep_top_layers`."""
    return max(0, num_layers - placement.keep_top_layers)


def blocks(num_layers: int, placement: Placement) -> list[tuple[int, int]]:
    """The step's backward blocks, bottom up, as [start, end) layer ranges: blocks of K below the kept top layers
    (the last of them short when K does not divide their number), then one per top layer."""
    B, K = blocked_layers(num_layers, placement), placement.checkpoint_every
    return [(s, min(B, s + K)) for s in range(0, B, K)] + [(l, l + 1) for l in range(B, num_layers)]


def kept(layer: int, placement: Placement, num_layers: int) -> str:
    """Where the forward wave leaves this layer's input: on the GPU, spilled to host, or dropped (rebuilt)."""
    if layer < blocked_layers(num_layers, placement) and layer % placement.checkpoint_every:
        return "drop"
    return "host" if layer < placement.spill_layers else "gpu"


def stashes(layer: int, placement: Placement, num_layers: int) -> bool:
    """Whether the forward wave keeps this layer's attention for its backward: one of the top `reuse_attention`
    layers, and its input is kept (a layer whose input is dropped to save memory does not keep more than it)."""
    return layer >= num_layers - placement.reuse_attention and kept(layer, placement, num_layers) != "drop"


def spilled_layers(num_layers: int, placement: Placement) -> list[int]:
    """The layers whose input kept() sends to host: below spill_layers, and not dropped (inside a block)."""
    B, K = blocked_layers(num_layers, placement), placement.checkpoint_every
    return [l for l in range(min(placement.spill_layers, num_layers)) if not (l < B and l % K)]


def keeps_and_stashes(num_layers: int, placement: Placement) -> tuple[list[str], list[bool]]:
    """kept() and stashes() of every layer."""
    B, K, S, R = blocked_layers(num_layers, placement), placement.checkpoint_every, placement.spill_layers, \
        num_layers - placement.reuse_attention
    keeps = ["drop" if l < B and l % K else "host" if l < S else "gpu" for l in range(num_layers)]
    return keeps, [l >= R and k != "drop" for l, k in enumerate(keeps)]


def group_sizes(num_micro: int, groups: int) -> list[range]:
    """The micro-batches of each wave group: consecutive, as even as can be, every group non-empty."""
    return list(_group_sizes(num_micro, groups))


@lru_cache(maxsize=1024)
def _group_sizes(num_micro: int, groups: int) -> tuple[range, ...]:
    groups = min(groups, num_micro)
    base, extra = divmod(num_micro, groups)
    out, start = [], 0
    for g in range(groups):
        n = base + (1 if g < extra else 0)
        out.append(range(start, start + n))
        start += n
    return tuple(out)


def step_schedule(num_units: int, tied: bool, placement: Placement = Placement(), groups: int | None = None) \
        -> list[Use]:
    """The uses of one step. `groups`: the wave groups actually run (at most the number of micro-batches; default
    placement.wave_groups)."""
    return list(_schedule(num_units, tied, placement, placement.wave_groups if groups is None else groups))


# the uses the schedules share, built once (a Use is immutable): the planner builds hundreds of schedules that differ
# in a few uses
_use = lru_cache(maxsize=1 << 16)(Use)


@lru_cache(maxsize=64)
def _schedule(num_units: int, tied: bool, placement: Placement, groups: int) -> tuple[Use, ...]:
    return tuple(iter_schedule(num_units, tied, placement, groups))


def iter_schedule(num_units: int, tied: bool, placement: Placement, groups: int) -> Iterator[Use]:
    """step_schedule's uses, each built as it is taken (the planner's walks that stop early build no more)."""
    L = num_units - 2
    to_host = set(grads_to_host(num_units, placement))
    bl = blocks(L, placement)
    keeps, stash = map(tuple, keeps_and_stashes(L, placement))
    head = head_units(num_units, tied)
    for g in range(groups):
        last = g == groups - 1

        def grad(unit: int) -> str:
            if not last:
                return "group-" + placement.group_grads
            return "host" if unit in to_host else "gpu"

        yield _use((0,), "embed", None, g)
        yield from _forward_wave(g, keeps, stash)
        yield _use(head, "head", None, g, "", None, False, grad(head[0]), (head[0], 0))
        for b in reversed(range(len(bl))):
            s, e = bl[b]
            # the next block's kept input comes back from host during this block, one block ahead of its use
            below = bl[b - 1][0] if b > 0 else None
            fetch = below if below is not None and keeps[below] == "host" else None
            # the block's first use (its bottom layer's rebuild, or its backward when it has one layer) fetches
            for l in range(s, e - 1):
                yield _use((1 + l,), "rebuild", l, g, "", fetch if l == s else None)
            for l in reversed(range(s, e)):
                yield _use((1 + l,), "backward", l, g, "", fetch if l == e - 1 and e - s == 1 else None, False,
                           grad(1 + l), (1 + l,))
        yield _use((), "embed_backward", None, g, "", None, False, grad(0), (TIED_INPUT,) if tied else ())


@lru_cache(maxsize=1024)
def _forward_wave(group: int, keeps: tuple[str, ...], stash: tuple[bool, ...]) -> tuple[Use, ...]:
    """A group's forward uses (the planner's walks go through thousands of forward waves, most of them alike)."""
    return tuple(_use((1 + l,), "forward", l, group, keeps[l], None, stash[l]) for l in range(len(keeps)))


def slot_numel(unit_numels: list[int], tied: bool) -> int:
    """Elements of one weight slot: the largest use (one unit, or the head with the tied embedding)."""
    head = sum(unit_numels[i] for i in head_units(len(unit_numels), tied))
    return max(max(unit_numels), head)
