"""The schedule of one training step: layer-major waves, weight slots, streams and events.

Order of work in `train_step` (every micro-batch goes through unit u before unit u+1 is touched):

    forward wave   embed -> layer 0 .. layer L-1      (no autograd; each layer's input is checkpointed)
    head           final norm + LM head + cross-entropy in token chunks, fused with its backward
    backward wave  layer L-1 .. layer 0               (recompute the layer from its checkpoint, local autograd,
                                                       fp32 gradient accumulated over micro-batches)
    embed          index_add of the input gradient into the embedding gradient

Stream/event protocol (CUDA; on CPU the slots are the host tiles themselves and every copy is a no-op):

    h2d stream      copies unit u's streaming tile into a slot after waiting on that slot's `free` event,
                    then records the slot's `ready` event. Before it issues the copy, the host thread calls
                    `wait_for_update(u)`, which returns once the CPU optimizer has written unit u's new
                    weights (the optimizer of step t overlaps the forward of step t+1).
    compute stream  waits on `ready` before the first kernel that reads the slot, records `free` after the
                    last one. Gradients are accumulated here.
    spill streams   checkpoints of spilled layers go to pinned host memory and come back one layer ahead of their
                    backward (their protocol: spill.py).
    d2h stream      owned by the gradient sink: it waits on the event recorded after a unit's gradient is
                    complete and copies it to host memory; nothing on the compute stream waits for it.

No host synchronisation happens inside the waves: labels, target positions and token counts are computed on
the host before the step, and the loss stays a device scalar until the caller reads it.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..models import ModelAdapter
from ..models.base import AttnContext
from .lmhead import accumulate_matmul, ce_loss_and_grad, default_chunk, fusable_dtypes
from .activation_spill import CheckpointSpill
from .store import HostStore, LayerTile

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    """Host tensors of one micro-batch, validated and prepared for the device."""

    input_ids: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64; restarts at 0 at each packed document
    target_index: torch.Tensor  # [n] int64: flat positions (into B*T) that predict a token
    targets: torch.Tensor  # [n] int64: the token each of those positions predicts
    packed: bool  # some row holds more than one document

    @property
    def num_targets(self) -> int:
        return int(self.targets.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def from_labels(cls, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None):
        """From Hugging Face style (input_ids, labels): labels are unshifted, -100 where no loss is taken."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).repeat(B, 1)
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        flat = shifted.reshape(-1)
        index = torch.nonzero(flat != IGNORE_INDEX).squeeze(1)
        packed = bool((position_ids != torch.arange(T)).any())
        return cls(input_ids.long().contiguous(), position_ids.long().contiguous(), index, flat[index].long(), packed)

    def to(self, device: torch.device) -> "MicroBatch":
        if device.type == "cpu":
            return self
        nb = dict(device=device, non_blocking=True)
        return MicroBatch(self.input_ids.pin_memory().to(**nb), self.position_ids.pin_memory().to(**nb),
                          self.target_index.pin_memory().to(**nb), self.targets.pin_memory().to(**nb), self.packed)


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # device scalar: sum of token losses (already divided by num_targets => the loss)
    grad_sq_norm: torch.Tensor  # device scalar: squared global gradient norm
    num_targets: int
    num_tokens: int


class CollectGrads:
    """Gradient sink that keeps each unit's fp32 gradient where it was made. `put` runs on the compute stream."""

    def __init__(self):
        self.grads: dict[int, torch.Tensor] = {}

    def put(self, unit_index: int, grad: torch.Tensor) -> None:
        self.grads[unit_index] = grad


@dataclass
class _Slot:
    buf: torch.Tensor
    ready: object = None  # torch.cuda.Event
    free: object = None
    holds: tuple | None = None  # (unit indices, weights version) currently in the buffer


@dataclass
class _Loaded:
    weights: list[dict[str, torch.Tensor]]  # per tile: views of the slot (or of the host tile on CPU)
    slot: _Slot | None = None
    busy_from: object = None  # timeline event when compute began using the slot


class Engine:
    def __init__(self, store: HostStore, adapter: ModelAdapter, device: torch.device,
                 loss_chunk_tokens: int = 0, num_slots: int = 2, compile_layers: bool = False,
                 spill_layers: int = 0):
        self.store, self.adapter, self.device = store, adapter, torch.device(device)
        # The layer template, optionally compiled: fusing RMSNorm, rope, SwiGLU and the residual adds around
        # the matmuls. One graph per (grad mode, micro-batch shape); weights are graph inputs, so every layer
        # shares the graphs.
        self.layer = torch.compile(adapter.layer_forward, dynamic=False) if compile_layers else adapter.layer_forward
        self.dtype = store.stream_dtype
        self.tiles = store.tiles
        self.embed_i, self.head_i = 0, len(self.tiles) - 1
        self.layer_is = list(range(1, len(self.tiles) - 1))
        V = adapter.vocab_size
        self.loss_chunk = loss_chunk_tokens or default_chunk(V)  # 512M logits (1 GiB in bf16) per chunk
        # LM-head kernels: None = on CUDA (fused cross-entropy, fp32 accumulation inside the weight-gradient GEMM).
        # The planner's meta-device simulation and the kernel A/B bench set these on shims of their own.
        self.head_kernels: bool | None = None
        self.fused_head_accumulate = True
        # A slot's contents are reused only within one pass (the last layer around the head): every pass starts a
        # new version, since the optimizer may have rewritten any tile in between.
        self.weights_version = 0
        self.wait_for_update: Callable[[int], None] = lambda unit_index: None
        self.timeline = None  # a megatrain.runtime.timeline.Timeline to measure stream busy shares (CUDA only)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            head_uses = [self.head_i, self.embed_i] if adapter.tied else [self.head_i]
            slot_numel = max(store.max_unit_numel, sum(self.tiles[i].numel for i in head_uses))
            self.h2d = torch.cuda.Stream(self.device)
            self.compute = torch.cuda.current_stream(self.device)
            self.slots = [_Slot(torch.empty(slot_numel, dtype=self.dtype, device=self.device),
                                torch.cuda.Event(), torch.cuda.Event()) for _ in range(num_slots)]
            for s in self.slots:
                s.free.record(self.compute)
            self._next_slot = 0
        # checkpoints of the lowest `spill_layers` layers live in pinned host memory (see spill.py)
        self.spill = CheckpointSpill(min(spill_layers, adapter.num_layers), self.device, self.dtype,
                                     getattr(self, "h2d", None), getattr(self, "compute", None))

    # ---- weights in and out of slots --------------------------------------------------------------
    def _fetch(self, unit_indices: list[int]) -> _Loaded:
        """Start bringing these units' weights to the device; returns at once (the copy is asynchronous)."""
        tiles = [self.tiles[i] for i in unit_indices]
        if not self.cuda:
            for i in unit_indices:
                self.wait_for_update(i)
            return _Loaded([t.views(t.stream) for t in tiles])
        key = (tuple(unit_indices), self.weights_version)
        # Slots are used strictly in ring order, so the slot taken here is the one released longest ago. If it
        # still holds these very weights (the last layer, around the head), the copy is skipped.
        slot = self.slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self.slots)
        if slot.holds != key:
            for i in unit_indices:
                self.wait_for_update(i)
            with torch.cuda.stream(self.h2d):
                self.h2d.wait_event(slot.free)
                with self._span("h2d", self.h2d):
                    off = 0
                    for t in tiles:
                        slot.buf[off: off + t.numel].copy_(t.stream, non_blocking=True)
                        off += t.numel
                slot.ready.record(self.h2d)
            slot.holds = key
        views, off = [], 0
        for t in tiles:
            views.append(t.views(slot.buf[off: off + t.numel]))
            off += t.numel
        return _Loaded(views, slot)

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
                end = self.timeline.marker(self.compute)
                self.timeline.add("compute", loaded.busy_from, end)

    def _span(self, name: str, stream):
        return self.timeline.span(name, stream) if self.timeline is not None else nullcontext()

    def _grad_buffer(self, tile: LayerTile) -> torch.Tensor:
        return torch.zeros(tile.numel, dtype=torch.float32, device=self.device)

    # ---- the step ----------------------------------------------------------------------------------
    def train_step(self, microbatches: list[MicroBatch], sink) -> StepOutput:
        num_targets = sum(mb.num_targets for mb in microbatches)
        if num_targets == 0:
            raise ValueError("a step without any target token (every label is -100)")
        self.weights_version += 1
        mbs = [mb.to(self.device) for mb in microbatches]
        ctxs = [self.adapter.make_context(mb.position_ids, self.dtype, mb.packed) for mb in mbs]
        L = len(self.layer_is)
        schedule = [[self.embed_i]] + [[i] for i in self.layer_is] + [self._head_units()] + \
                   [[i] for i in reversed(self.layer_is)]
        # Use k's weights were fetched when use k-1 finished queueing its compute: the copy overlaps that
        # compute, and a wait for the optimizer (wait_for_update) never delays kernels already decided.
        pending = [self._fetch(schedule[0])]

        def weights(k: int) -> _Loaded:
            return pending[k]

        def done(k: int) -> None:
            self._release(pending[k])
            pending[k] = None
            if k + 1 < len(schedule):
                pending.append(self._fetch(schedule[k + 1]))

        sq_norms: list[torch.Tensor] = []

        # forward wave
        with torch.no_grad():
            (w_embed,) = self._acquire(weights(0))
            hidden = [F.embedding(mb.input_ids, w_embed["weight"]) for mb in mbs]
            done(0)
            self.spill.begin_step([h.shape for h in hidden])
            checkpoints: list[list[torch.Tensor] | None] = []
            for li in range(L):
                (w,) = self._acquire(weights(1 + li))
                if self.spill.spills(li):
                    self.spill.save(li, hidden)
                    checkpoints.append(None)
                else:
                    checkpoints.append(hidden)
                hidden = [self.layer(w, h, c) for h, c in zip(hidden, ctxs)]
                done(1 + li)

        # head: loss and its backward, chunked over target tokens
        head_w = self._acquire(weights(1 + L))
        head_tile = self.tiles[self.head_i]
        head_grad = self._grad_buffer(head_tile)
        embed_grad = self._grad_buffer(self.tiles[self.embed_i])
        norm_w, lm_w = self._head_weights(head_w)
        lm_grad = self.tiles[self.embed_i].views(embed_grad)["weight"] if self.adapter.tied \
            else head_tile.views(head_grad)["lm_head.weight"]
        norm_grad = head_tile.views(head_grad)["norm.weight"]
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        grads_out = []
        for mb, h in zip(mbs, hidden):
            loss, dh = self._head_loss(h, mb, norm_w, lm_w, norm_grad, lm_grad, 1.0 / num_targets)
            loss_sum += loss
            grads_out.append(dh)
        done(1 + L)
        del hidden
        sq_norms.append(self._emit(sink, self.head_i, head_grad))
        del head_grad, lm_grad, norm_grad  # the sink owns it now (offloaded units free their device copy early)

        # backward wave
        for li in reversed(range(L)):
            unit_index = self.layer_is[li]
            k = 2 + L + (L - 1 - li)
            (w,) = self._acquire(weights(k))
            grad = self._grad_buffer(self.tiles[unit_index])
            gviews = list(self.tiles[unit_index].views(grad).values())
            self.spill.prefetch(li - 1)  # overlaps this layer's backward (no-op unless layer li-1 was spilled)
            ckpt = checkpoints[li] if checkpoints[li] is not None else self.spill.load(li)
            for m, (c, dh) in enumerate(zip(ctxs, grads_out)):
                grads_out[m] = self._layer_backward(w, ckpt[m], c, dh, gviews)
                ckpt[m] = None  # this checkpoint is spent
            done(k)
            sq_norms.append(self._emit(sink, unit_index, grad))
            del grad, gviews

        # embedding backward: scatter-add of the input gradient; needs no weights
        ev = self.tiles[self.embed_i].views(embed_grad)["weight"]
        for mb, dh in zip(mbs, grads_out):
            ev.index_add_(0, mb.input_ids.reshape(-1), dh.reshape(-1, dh.shape[-1]).float())
        sq_norms.append(self._emit(sink, self.embed_i, embed_grad))
        grad_sq = torch.stack(sq_norms).sum()
        return StepOutput(loss_sum, grad_sq, num_targets, sum(mb.num_tokens for mb in microbatches))

    def _head_units(self) -> list[int]:
        return [self.head_i, self.embed_i] if self.adapter.tied else [self.head_i]

    @staticmethod
    def _emit(sink, unit_index: int, grad: torch.Tensor) -> torch.Tensor:
        sq = torch.dot(grad, grad)
        sink.put(unit_index, grad)
        return sq

    def _layer_backward(self, w, checkpoint, ctx: AttnContext, dh, grad_views) -> torch.Tensor:
        """Recompute one layer for one micro-batch and run its local backward; returns d(input)."""
        params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        x = checkpoint.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self.layer(params, x, ctx)
            grads = torch.autograd.grad(out, [x, *params.values()], dh)
        for acc, g in zip(grad_views, grads[1:]):
            acc.add_(g)
        return grads[0]

    def _head_loss(self, h, mb: MicroBatch, norm_w, lm_w, norm_grad, lm_grad, scale: float):
        """Final norm + LM head + cross-entropy over the micro-batch's target positions, never holding more
        than `loss_chunk` rows of logits. Returns (sum of token losses * scale, d hidden) and accumulates the
        norm and LM-head gradients."""
        H = h.shape[-1]
        x = h.reshape(-1, H).index_select(0, mb.target_index).detach().requires_grad_(True)
        nw = norm_w.detach().requires_grad_(True)
        with torch.enable_grad():
            xn = self.adapter.final_norm(nw, x)
        d_xn = torch.empty_like(xn)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        xn_d = xn.detach()
        scale_t = torch.full((), scale, dtype=torch.float32, device=h.device)  # a fill kernel: no host sync
        n, C = xn_d.shape[0], self.loss_chunk
        kernels = getattr(self, "head_kernels", None)  # getattr: shims (probe, actsim, bench) may leave it out
        kernels = lm_grad.is_cuda if kernels is None else kernels
        fused = kernels and getattr(self, "fused_head_accumulate", True) and fusable_dtypes(lm_grad, xn_d)
        for a in range(0, n, C):
            xc, y = xn_d[a: a + C], mb.targets[a: a + C]
            chunk_loss, dlogits = ce_loss_and_grad(xc @ lm_w.t(), y, scale_t, kernel=kernels)
            loss += chunk_loss
            torch.mm(dlogits, lm_w, out=d_xn[a: a + C])
            accumulate_matmul(lm_grad, dlogits.t(), xc, fused)
            del dlogits
        dx, dnw = torch.autograd.grad(xn, [x, nw], d_xn)
        norm_grad.add_(dnw)
        dh = torch.zeros_like(h)
        dh.reshape(-1, H).index_copy_(0, mb.target_index, dx)
        return loss * scale, dh

    # ---- evaluation ----------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self, microbatches: list[MicroBatch]) -> tuple[float, int]:
        """(mean token loss, target count) with the same streaming forward and no gradients."""
        hidden, mbs = self._forward_only(microbatches)
        loaded = self._fetch(self._head_units())
        norm_w, lm_w = self._head_weights(self._acquire(loaded))
        total, n = torch.zeros((), device=self.device), 0
        for mb, h in zip(mbs, hidden):
            x = self.adapter.final_norm(norm_w, h.reshape(-1, h.shape[-1]).index_select(0, mb.target_index))
            for a in range(0, x.shape[0], self.loss_chunk):
                logits = (x[a: a + self.loss_chunk] @ lm_w.t()).float()
                total += F.cross_entropy(logits, mb.targets[a: a + self.loss_chunk], reduction="sum")
            n += mb.num_targets
        self._release(loaded)
        return (total / max(n, 1)).item(), n

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] at position lengths-1 of each right-padded row (for greedy decoding and checks)."""
        B = input_ids.shape[0]
        mb = MicroBatch.from_labels(input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        hidden, _ = self._forward_only([mb])
        loaded = self._fetch(self._head_units())
        norm_w, lm_w = self._head_weights(self._acquire(loaded))
        last = hidden[0][torch.arange(B, device=self.device), (lengths - 1).to(self.device)]
        logits = (self.adapter.final_norm(norm_w, last) @ lm_w.t()).float()
        self._release(loaded)
        return logits

    def _head_weights(self, head_w: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        lm_w = head_w[1]["weight"] if self.adapter.tied else head_w[0]["lm_head.weight"]
        return head_w[0]["norm.weight"], lm_w

    def _forward_only(self, microbatches: list[MicroBatch]):
        self.weights_version += 1
        mbs = [mb.to(self.device) for mb in microbatches]
        ctxs = [self.adapter.make_context(mb.position_ids, self.dtype, mb.packed) for mb in mbs]
        loaded = self._fetch([self.embed_i])
        (w_embed,) = self._acquire(loaded)
        hidden = [F.embedding(mb.input_ids, w_embed["weight"]) for mb in mbs]
        self._release(loaded)
        for i in self.layer_is:
            loaded = self._fetch([i])
            (w,) = self._acquire(loaded)
            hidden = [self.layer(w, h, c) for h, c in zip(hidden, ctxs)]
            self._release(loaded)
        return hidden, mbs
