"""The executor of one training step's schedule (schedule.py): layer-major waves, weight slots, streams, events.

Order of work in `train_step` (every micro-batch goes through unit u before unit u+1 is touched):

    forward wave   embed -> layer 0 .. layer L-1      (no autograd; each layer's input is checkpointed)
    head           final norm + LM head + cross-entropy in token chunks, fused with its backward (lmhead.py);
                   a preference or grpo objective: a forward-only pass for the log-probs first (head_objective.py)
    backward wave  layer L-1 .. layer 0               (recompute the layer from its checkpoint, local autograd,
                                                       fp32 gradient accumulated over micro-batches: layer.py)
    embed          index_add of the input gradient into the embedding gradient

Stream/event protocol (CUDA; on CPU the slots are the host tiles themselves and every copy is a no-op):

    h2d stream      copies unit u's streaming tile into a slot after waiting on that slot's `free` event,
                    then records the slot's `ready` event. Before it issues the copy, the host thread calls the
                    sink's `wait_for_update(u)`, which returns once the CPU optimizer has written unit u's new
                    weights (with clipping the optimizer of step t overlaps the forward of step t+1; without, a
                    unit's update starts when the sink is handed its gradient, during step t's backward).
    compute stream  waits on `ready` before the first kernel that reads the slot, records `free` after the
                    last one. Gradients are accumulated here.
    spill streams   checkpoints of spilled layers go to pinned host memory and come back one layer ahead of their
                    backward (their protocol: activation_spill.py).
    d2h stream      owned by the gradient sink (optimizer_pipeline.py): it waits on the event recorded after a
                    unit's gradient is complete and copies it to host memory; the compute stream never waits for it.

`train_step` walks the schedule (schedule.walk) with `_StepRun`: one method per kind of use, the step's state in
its attributes. No host synchronisation happens inside the waves: labels, target positions and token counts are
computed on the host before the step, and the loss stays a device scalar until the caller reads it. The engine
records what it is doing in `phase`, so an out-of-memory error can be told apart by what was being allocated.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..models import ModelAdapter
from .accumulators import GroupAccumulators
from .activation_spill import ActivationSpill
from .forward_only import ForwardOnly
from .head_objective import GRPOStep, PreferenceStep, check_grpo, check_pairs, chosen_targets
from .layer import layer_backward, layer_template
from .lmhead import HeadKernels, default_chunk, head_loss
from .router_loss import RouterStats, group_router_loss
from .microbatch import MicroBatch, StepOutput
from .objective import SFT, Objective
from .schedule import (TIED_INPUT, Placement, ScheduleVisitor, Use, group_sizes, head_units, slot_numel,
                       spilled_layers, step_schedule, walk)
from .pinned import PinnedHost
from .sink import CollectGrads, GradientSink  # CollectGrads: imported from here too
from .store import HostStore

STAGE_ELEMS = 32 << 20  # fp32 streaming: elements per staged piece (128 MiB of device memory)
DOT_CHUNK = 2**30  # cuBLAS dot takes an int32 length: a layer of 3.2e9 parameters (Llama-3.1-405B) is longer


def squared_norm(flat: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Sum of squares of a flat fp32 tensor as a 0-d tensor on its device, in chunks cuBLAS accepts (one dot when
    it is shorter than `chunk`, default DOT_CHUNK: the same number as one dot for every tensor that fits one call)."""
    chunk = chunk or DOT_CHUNK
    if flat.numel() <= chunk:
        return torch.dot(flat, flat)
    return torch.stack([torch.dot(part, part) for part in flat.split(chunk)]).sum()


def own_version(t: torch.Tensor) -> torch.Tensor:
    """`t`'s memory under an autograd version counter of its own (CPU: the host tiles share one, and an update of
    another tile during backward, no clipping, must not look like a write to the weights a backward saved)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                              t.stride())


class Phase(NamedTuple):
    """What the engine was doing: 'weights' (slots and copies), 'inputs' (micro-batches to the device, rope
    tables, masks), 'forward', 'head', 'gradients' (a fp32 accumulator), 'backward', 'embedding backward'."""

    what: str
    layer: int | None = None
    micro: int | None = None  # 0-based micro-batch


@dataclass(frozen=True)
class EngineOptions:
    loss_chunk_tokens: int = 0  # target tokens per LM-head chunk (0: lmhead.default_chunk of the vocabulary)
    num_slots: int = 2
    compile_layers: bool = False  # torch.compile the layer template
    placement: Placement = Placement()  # checkpoint interval, spill, gradients to host, wave groups (schedule.py)
    head_kernels: HeadKernels | None = None  # None: HeadKernels.for_device
    objective: Objective = SFT  # the loss: next-token (sft), a preference objective or grpo (head_objective.py)


@dataclass
class _Group:
    """One wave group's state while its uses run."""

    index: range  # the step's micro-batches in this group
    mbs: list[MicroBatch]  # on the device
    ctxs: list
    hidden: list[torch.Tensor] | None = None  # the current layer boundary of each micro-batch
    checkpoints: dict = field(default_factory=dict)  # layer -> kept inputs (None: spilled to host)
    stashes: dict = field(default_factory=dict)  # layer -> each micro-batch's AttentionStash (reuse_attention)
    grads_out: list[torch.Tensor] | None = None  # d(hidden) of each micro-batch, flowing down
    router: list[RouterStats] | None = None  # MoE: each micro-batch's router statistics from the forward wave
    router_grads: list | None = None  # MoE: d(router loss)/d(a layer's probability sum), per micro-batch


@dataclass
class _Slot:
    buf: torch.Tensor
    ready: torch.cuda.Event | None = None
    free: torch.cuda.Event | None = None
    holds: tuple | None = None  # (unit indices, weights version) currently in the buffer


@dataclass
class _Loaded:
    weights: list[dict[str, torch.Tensor]]  # per tile: views of the slot (or of the host tile on CPU)
    slot: _Slot | None = None
    busy_from: torch.cuda.Event | None = None  # timeline event when compute began using the slot
    label: str = ""  # the use, in the timeline ("forward (3,)")


class Engine(ForwardOnly):
    def __init__(self, store: HostStore, adapter: ModelAdapter, device: torch.device, sink: GradientSink,
                 options: EngineOptions = EngineOptions(), timeline=None, pinned=None):
        """sink: receives each unit's finished gradient and says when its update is written. timeline: a
        runtime.timeline.Timeline measuring the streams' busy shares (CUDA), or None. pinned: the PinnedHost
        that registers the activation spill's and the wave groups' host buffers (needed on CUDA when the placement
        spills or parks accumulators in host memory)."""
        self.store, self.adapter, self.device = store, adapter, torch.device(device)
        self.sink, self.timeline, self.options, self.pinned = sink, timeline, options, pinned
        # The layer template, optionally compiled: fusing RMSNorm, rope, SwiGLU and the residual adds around
        # the matmuls. One graph per (grad mode, micro-batch shape); weights are graph inputs, so every layer
        # shares the graphs. With a sequence tile its per-token work runs over tiles of tokens (layer.py).
        self.kinds = adapter.layer_kinds  # each layer's attention kind: which of a micro-batch's contexts it uses
        self.layer = layer_template(adapter, options.placement.seq_tile, options.compile_layers,
                                    stash=options.placement.reuse_attention > 0,
                                    attn_block=options.placement.attn_block)
        self.dtype = store.compute_dtype
        self.cast_on_device = store.stream_dtype != self.dtype  # fp32 streamed, cast into the slots
        if self.dtype == torch.bfloat16 and self.cast_on_device != (options.placement.stream_dtype == "fp32"):
            raise ValueError(f"the placement streams {options.placement.stream_dtype} but the host store holds "
                             f"{store.stream_dtype} tiles (build it with store_dtypes)")
        self.tiles = store.tiles
        self.loss_chunk = options.loss_chunk_tokens or default_chunk(adapter.vocab_size)
        self.head_kernels = options.head_kernels or HeadKernels.for_device(self.device)
        self.placement = options.placement
        self.head_units = head_units(len(self.tiles), adapter.tied)
        self.phase = Phase("weights")
        # A slot's contents are reused only within one pass (the last layer around the head): every pass starts a
        # new version, since the optimizer may have rewritten any tile in between.
        self.weights_version = 0
        self.cuda = self.device.type == "cuda"
        self.h2d = self.compute = None
        if self.cuda:
            numel = slot_numel([t.numel for t in self.tiles], adapter.tied)
            self.h2d = torch.cuda.Stream(self.device)
            self.compute = torch.cuda.current_stream(self.device)
            self.slots = [_Slot(torch.empty(numel, dtype=self.dtype, device=self.device),
                                torch.cuda.Event(), torch.cuda.Event()) for _ in range(options.num_slots)]
            for s in self.slots:
                s.free.record(self.compute)
            self._next_slot = 0
            # fp32 streaming: tiles arrive in pieces through one staging buffer and are cast into the slot, both on
            # the h2d stream (in order: the next piece's copy waits for the previous piece's cast)
            self.staging = torch.empty(min(numel, STAGE_ELEMS), dtype=store.stream_dtype, device=self.device) \
                if self.cast_on_device else None
        self.spill = ActivationSpill(self.device, self.dtype, self.h2d, self.compute, pinned)
        self.accumulators = GroupAccumulators(self.device, pinned or PinnedHost(cuda=False), self.h2d, self.compute,
                                              borrow=sink.host_buffer)

    def schedule(self, num_micro: int) -> list[Use]:
        """This step's uses (schedule.py): the placement's, with as many wave groups as there are micro-batches
        at most."""
        return step_schedule(len(self.tiles), self.adapter.tied, self.placement,
                             len(group_sizes(num_micro, self.placement.wave_groups)))

    # ---- weights in and out of slots --------------------------------------------------------------
    def _fetch(self, unit_indices: tuple[int, ...], reference: bool = False) -> _Loaded:
        """Start bringing these units' weights to the device; returns at once (the copy is asynchronous).
        reference: the store's frozen reference copy (compute dtype, never updated) instead of the policy's."""
        if not unit_indices:
            return _Loaded([])
        tiles = [self.tiles[i] for i in unit_indices]
        srcs = [self.store.reference_tiles[i] for i in unit_indices] if reference else [t.stream for t in tiles]
        cast, waits = self.cast_on_device and not reference, () if reference else unit_indices
        if not self.cuda:
            for i in waits:
                self.sink.wait_for_update(i)
            return _Loaded([t.views(src.to(self.dtype) if cast else own_version(src)) for t, src in zip(tiles, srcs)])
        key = (unit_indices, self.weights_version, reference)
        # Slots are used strictly in ring order, so the slot taken here is the one released longest ago. If it
        # still holds these very weights (the last layer, around the head), the copy is skipped.
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        if slot.holds != key:
            for i in waits:
                self.sink.wait_for_update(i)
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(slot.free)
                with self._span("h2d", self.h2d):
                    off = 0
                    for t, src in zip(tiles, srcs):
                        if cast:
                            self._copy_cast(slot.buf[off: off + t.numel], src)
                        else:
                            slot.buf[off: off + t.numel].copy_(src, non_blocking=True)
                        off += t.numel
                slot.ready.record(self.h2d)
            slot.holds = key
        views, off = [], 0
        for t in tiles:
            views.append(t.views(slot.buf[off: off + t.numel]))
            off += t.numel
        return _Loaded(views, slot)

    def _copy_cast(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """src (pinned host, fp32) into dst (device, compute dtype) through the staging buffer, on the h2d stream."""
        n = self.staging.numel()
        for start in range(0, src.numel(), n):
            piece = src[start: start + n]
            stage = self.staging[: piece.numel()]
            stage.copy_(piece, non_blocking=True)
            dst[start: start + piece.numel()].copy_(stage)

    def _acquire(self, loaded: _Loaded) -> list[dict[str, torch.Tensor]]:
        if loaded.slot is not None:
            self.compute.wait_event(loaded.slot.ready)
            if self.timeline is not None:
                loaded.busy_from = self.timeline.marker(self.compute)
        return loaded.weights

    def _release(self, loaded: _Loaded) -> None:
        if loaded.slot is not None:
            loaded.slot.free.record(self.compute)
            if self.timeline is not None and loaded.busy_from is not None:
                self.timeline.add("compute", loaded.busy_from, self.timeline.marker(self.compute), loaded.label)

    def _span(self, name: str, stream):
        return self.timeline.span(name, stream) if self.timeline is not None else nullcontext()

    def _grad_buffer(self, unit_index: int) -> torch.Tensor:
        """The unit's fp32 accumulator: continued from an earlier wave group, or a new one."""
        self.phase = Phase("gradients")
        acc = self.accumulators.take(unit_index)
        if acc is None:
            acc = torch.zeros(self.tiles[max(unit_index, 0)].numel, dtype=torch.float32, device=self.device)
        return acc

    def _inputs(self, microbatches: list[MicroBatch]):
        self.phase = Phase("inputs")
        mbs = [mb.to(self.device) for mb in microbatches]
        return mbs, [self.adapter.make_context(mb.position_ids, self.dtype, mb.packed).with_token_mask(mb.token_mask)
                     .with_attn_block(self.options.placement.attn_block) for mb in mbs]

    # ---- the step ----------------------------------------------------------------------------------
    def train_step(self, microbatches: list[MicroBatch], totals: tuple[int, ...] | None = None) -> StepOutput:
        """totals: (target tokens, micro-batches) of the whole step when these micro-batches are one rank's share
        of it (megatrain/distributed): the loss is the step's mean over all of them. A preference objective: (target
        tokens, micro-batches, pairs[, chosen target tokens (orpo)]); the loss is the mean over the step's pairs. grpo:
        the loss is Σ w_r·l_t over the micro-batches' completion tokens (head_objective.GRPOStep)."""
        obj = self.options.objective
        num_targets, num_micro = totals[:2] if totals else (sum(mb.num_targets for mb in microbatches),
                                                            len(microbatches))
        if num_targets == 0:
            raise ValueError("a step without any target token (every label is -100)")
        pref = None
        if obj.preference:
            check_pairs(obj, microbatches)
            pairs = totals[2] if totals and len(totals) > 2 else sum(mb.input_ids.shape[0] // 2 for mb in microbatches)
            chosen = totals[3] if totals and len(totals) > 3 else sum(chosen_targets(mb) for mb in microbatches)
            pref = PreferenceStep(obj, pairs, chosen, self.device, microbatches)
        elif obj.grpo:  # each row's weight w_r carries the step's aggregation: no totals beyond the SFT ones
            check_grpo(obj, microbatches)
            pref = GRPOStep(obj, self.device)
        self.weights_version += 1
        run = _StepRun(self, microbatches, num_targets, num_micro, pref)
        walk(run.uses, run)
        return StepOutput(run.loss_sum, torch.stack(run.sq_norms).sum(), num_targets,
                          sum(mb.num_tokens for mb in microbatches),
                          run.router["aux"] if run.router else None, run.router["counts"] if run.router else None,
                          pref.metrics if pref else None)

    @torch.no_grad()
    def _forward_layer(self, w: dict, g: _Group, layer: int, stash: bool = False) -> list[torch.Tensor]:
        """One layer over the group's micro-batches in the forward wave: the next hidden states (a MoE layer's
        router statistics kept in the group for the router loss; with `stash`, each micro-batch's attention kept
        in the group for this layer's backward). No reference to the inputs outlives the call."""
        kind, run = self.kinds[layer], self.layer.forward_stash if stash else self.layer
        outs = [run(w, h, c.for_kind(kind)) for h, c in zip(g.hidden, g.ctxs)]
        if stash:  # (output, AttentionStash) pairs
            g.stashes[layer], outs = [s for _, s in outs], [o for o, _ in outs]
        if not self.adapter.moe:
            return outs
        g.router = g.router or [RouterStats() for _ in g.mbs]
        for stats, o in zip(g.router, outs):  # (h, probability sum, counts)
            stats.add(o[1], o[2])
        return [o[0] for o in outs]

    def _hidden(self, out):
        """A layer's output hidden states (a MoE layer also returns its router statistics)."""
        return out[0] if self.adapter.moe else out

    def _head(self, w, mbs, hidden, head_grad, embed_grad, scale: float, loss_sum: torch.Tensor,
              pref: PreferenceStep | None = None) -> list[torch.Tensor]:
        """The LM head over a group's micro-batches: adds their losses to `loss_sum`; d(hidden) per micro-batch.
        pref: a preference or grpo objective's head instead of the token loss (head_objective.py)."""
        norm_w, lm_w = self._head_weights(w)
        head_tile = self.tiles[self.head_units[0]]
        lm_grad = self.tiles[0].views(embed_grad)["weight"] if self.adapter.tied \
            else head_tile.views(head_grad)["lm_head.weight"]
        norm_grad = head_tile.views(head_grad)["norm.weight"]
        grads_out = []
        for m, (mb, h) in enumerate(zip(mbs, hidden)):
            self.phase = Phase("head", micro=m)
            if pref is not None:
                grads_out.append(pref.head(self.adapter.final_norm, h, mb, norm_w, lm_w, norm_grad, lm_grad,
                                           self.loss_chunk, self.head_kernels, self.adapter.logit_softcap, loss_sum))
                continue
            loss, dh = head_loss(self.adapter.final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, norm_grad,
                                 lm_grad, scale, self.loss_chunk, self.head_kernels, self.adapter.logit_softcap)
            loss_sum += loss
            grads_out.append(dh)
        return grads_out

    def _head_weights(self, head_w: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        lm_w = head_w[1]["weight"] if self.adapter.tied else head_w[0]["lm_head.weight"]
        return head_w[0]["norm.weight"], lm_w

    def _forward_only(self, microbatches: list[MicroBatch], reference: bool = False):
        """The forward wave alone (evaluation, decoding, log-probs; of the reference copy with `reference`): the
        hidden states after the last layer, the batches."""
        self.weights_version += 1
        wave = _ForwardWave(self, *self._inputs(microbatches), reference)
        walk(step_schedule(len(self.tiles), self.adapter.tied)[:len(self.tiles) - 1], wave)  # embed, layers
        return wave.hidden, wave.mbs


class _StepRun(ScheduleVisitor):
    """One train_step's walk of the schedule (schedule.walk), its state as attributes. Use k's weights were fetched
    when use k-1 finished queueing its compute: the copy overlaps that compute, and a wait for the optimizer
    (wait_for_update) never delays kernels already decided. A parked gradient accumulator comes back the same way,
    ahead of its use."""

    def __init__(self, engine: Engine, microbatches: list[MicroBatch], num_targets: int, num_micro: int,
                 pref: PreferenceStep | None = None):
        e, self.pref = engine, pref
        self.e = e
        self.microbatches, self.scale, self.num_micro = microbatches, 1.0 / num_targets, num_micro
        self.uses = e.schedule(len(microbatches))
        self.groups = group_sizes(len(microbatches), e.placement.wave_groups)
        e.spill.begin_step(spilled_layers(len(e.tiles) - 2, e.placement),
                           [torch.Size((*mb.input_ids.shape, e.adapter.hidden_size)) for mb in microbatches])
        self.k, self.loaded = 0, e._fetch(self.uses[0].units)  # use k and its weights, on their way
        self.w: list[dict[str, torch.Tensor]] = []  # use k's weights, once they arrived
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=e.device)
        self.router = {"aux": torch.zeros((), dtype=torch.float32, device=e.device), "counts": None} \
            if e.adapter.moe else None
        self.sq_norms: list[torch.Tensor] = []
        self.acc: dict[int, torch.Tensor] = {}  # accumulators in use: the embedding's from the head on, a layer's
        self.g: _Group | None = None  # the wave group running

    def enter(self, use: Use) -> None:
        e = self.e
        if self.g is None or self.g.index != self.groups[use.group]:
            self.g = _Group(self.groups[use.group], *e._inputs([self.microbatches[m] for m in self.groups[use.group]]))
        self.loaded.label = f"{use.kind} {use.units}" if e.timeline is not None else ""
        self.w = e._acquire(self.loaded)

    def leave(self, use: Use) -> None:
        """Release the slot, start fetching the next use's weights and accumulators, then place the gradient this use
        last touched in its group: complete -> to the sink; else kept for the next group where the schedule says."""
        e = self.e
        e._release(self.loaded)
        self.loaded, self.k = None, self.k + 1
        if self.k < len(self.uses):
            e.phase = Phase("weights")
            nxt = self.uses[self.k]
            self.loaded = e._fetch(nxt.units)
            for unit in nxt.accumulators:
                e.accumulators.prefetch(unit)
        if use.grad:
            unit = use.grad_unit
            grad = self.acc.pop(unit)
            if use.grad in ("gpu", "host"):
                self.sq_norms.append(squared_norm(grad))
                e.sink.put(unit, grad, use.grad == "host")
            else:
                e.accumulators.park(unit, grad, use.grad.removeprefix("group-"))

    def embed(self, use: Use) -> None:
        with torch.no_grad():
            self.g.hidden = [self.e.adapter.embed(self.w[0]["weight"], mb.input_ids) for mb in self.g.mbs]

    def forward(self, use: Use) -> None:
        e, g = self.e, self.g
        e.phase = Phase("forward", use.layer)
        if use.keep == "gpu":  # this layer's input: kept on the GPU, spilled to host, or dropped
            g.checkpoints[use.layer] = g.hidden
        elif use.keep == "host":
            e.spill.save(use.layer, g.index, g.hidden)
            g.checkpoints[use.layer] = None
        g.hidden = e._forward_layer(self.w[0], g, use.layer, use.stash)

    def head(self, use: Use) -> None:
        e, g, acc, unit = self.e, self.g, self.acc, use.units[0]
        acc[0] = e._grad_buffer(0)
        acc[unit] = e._grad_buffer(unit)
        g.grads_out = e._head(self.w, g.mbs, g.hidden, acc[unit], acc[0], self.scale, self.loss_sum, self.pref)
        g.hidden = None
        if e.adapter.moe:  # the group's router losses, their gradients for the backward (router_loss.py)
            g.router_grads = group_router_loss(g.mbs, g.router, e.adapter, self.num_micro, self.loss_sum,
                                               self.router)
            g.router = None

    def rebuild(self, use: Use) -> None:  # the block's next input, from the one below (kept or rebuilt)
        e, g = self.e, self.g
        e.phase = Phase("forward", use.layer)
        x, kind = self._checkpoint(use), e.kinds[use.layer]
        with torch.no_grad():
            g.checkpoints[use.layer + 1] = [e._hidden(e.layer(self.w[0], h, c.for_kind(kind)))
                                            for h, c in zip(x, g.ctxs)]

    def backward(self, use: Use) -> None:
        e, g, unit = self.e, self.g, use.units[0]
        self.acc[unit] = e._grad_buffer(unit)
        gviews = list(e.tiles[unit].views(self.acc[unit]).values())
        ckpt = self._checkpoint(use)
        del g.checkpoints[use.layer]
        stashes = g.stashes.pop(use.layer, None)  # the attention kept from the forward wave
        for m, (c, dh) in enumerate(zip(g.ctxs, g.grads_out)):
            e.phase = Phase("backward", use.layer, g.index[m])
            extra = g.router_grads[m] if g.router_grads else None  # MoE: the router loss's gradient
            g.grads_out[m] = layer_backward(e.layer, self.w[0], ckpt[m], c.for_kind(e.kinds[use.layer]), dh, gviews,
                                            extra, stashes[m] if stashes else None)
            ckpt[m] = None  # this checkpoint is spent (and the stash, emptied by the backward)

    def embed_backward(self, use: Use) -> None:  # scatter-add of the input gradient; needs no weights
        e, g, acc = self.e, self.g, self.acc
        e.phase = Phase("embedding backward")
        into = acc[0]
        if e.adapter.tied:  # the input side apart from the LM head's
            into = acc[TIED_INPUT] = e._grad_buffer(TIED_INPUT)
        ev = e.tiles[0].views(into)["weight"]
        for mb, dh in zip(g.mbs, g.grads_out):
            dx = e.adapter.embed_input_grad(dh)
            ev.index_add_(0, mb.input_ids.reshape(-1), dx.reshape(-1, dx.shape[-1]).float())
        del ev, into  # no reference may outlive the accumulator's trip to host between groups
        g.grads_out = None
        # A tied embedding's gradient is its LM-head side (accumulated at the head) plus its input side, added once
        # both are complete: the same numbers in whatever wave groups the micro-batches ran, since each side
        # accumulates its micro-batches in the step's order.
        if e.adapter.tied and use.grad in ("gpu", "host"):
            acc[0].add_(acc.pop(TIED_INPUT))
        elif e.adapter.tied:
            e.accumulators.park(TIED_INPUT, acc.pop(TIED_INPUT), use.grad.removeprefix("group-"))

    def _checkpoint(self, use: Use) -> list[torch.Tensor]:
        """The inputs of the use's layer for the group's micro-batches, on the device (brought back if spilled),
        the fetch of the next block's spilled input (`use.fetch`) started first, to overlap this use."""
        g, spill = self.g, self.e.spill
        if use.fetch is not None:
            spill.prefetch(use.fetch, g.index)
        if g.checkpoints[use.layer] is None:
            g.checkpoints[use.layer] = spill.load(use.layer, g.index)
        return g.checkpoints[use.layer]


class _ForwardWave(ScheduleVisitor):
    """The forward wave without autograd or checkpoints (Engine._forward_only): the last hidden states."""

    def __init__(self, engine: Engine, mbs: list[MicroBatch], ctxs: list, reference: bool = False):
        self.e, self.mbs, self.ctxs, self.hidden, self.reference = engine, mbs, ctxs, [], reference

    def enter(self, use: Use) -> None:
        self.loaded = self.e._fetch(use.units, self.reference)
        (self.w,) = self.e._acquire(self.loaded)
        self.e.phase = Phase("forward", use.layer)

    def leave(self, use: Use) -> None:
        self.e._release(self.loaded)

    def embed(self, use: Use) -> None:
        self.hidden = [self.e.adapter.embed(self.w["weight"], mb.input_ids) for mb in self.mbs]

    def forward(self, use: Use) -> None:
        e = self.e
        self.hidden = [e._hidden(e.layer(self.w, h, c.for_kind(e.kinds[use.layer])))
                       for h, c in zip(self.hidden, self.ctxs)]

    def _not_in_the_forward_wave(self, use: Use) -> None:
        raise ValueError(f"the forward wave has no {use.kind} use")

    head = rebuild = backward = embed_backward = _not_in_the_forward_wave
