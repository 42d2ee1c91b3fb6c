"""Memory of a run, from config.json and the workload alone: host RAM by component, and the GPU phase by phase.

Nothing is allocated. Where megatrain/runtime has a function that sizes an allocation, the planner calls it; what
the runtime does not size itself (the runtime's own RSS, allocator reserve, CUDA context) is fitted to measured runs
(calibration.py):

    host    `host_memory`: HostStore's tiles (runtime/store.py: each unit padded by `padded_numel`; fp32 master, m, v
            and, in bf16 mode, a bf16 streaming copy), the OptimizerPipeline's two pinned landing buffers of
            `landing_piece` elements (runtime/optimizer_pipeline.py), and what the placement puts in host memory:
            the buffers of the gradients sent to host (`grads_to_host`), ActivationSpill's spilled checkpoints
            (runtime/activation_spill.py), the wave groups' parked accumulators (runtime/accumulators.py: only
            for units without a gradient buffer there already); one step's batches, and the runtime itself.
    GPU     `gpu_phases`: one (phase, {component: bytes}) per use of the runtime's own `step_schedule`
            (runtime/schedule.py) with the workload's placement, at the use's worst micro-batch, keeping the
            engine's books (runtime/engine.py): weight slots (`slot_numel`), the group's kept, fetched and rebuilt
            layer inputs, hidden states and d(hidden), fp32 accumulators in use, parked on the GPU between wave
            groups or coming back from host, finished gradients waiting for the optimizer (with clipping it copies
            them out in forward order during the next step's first forward wave; without, at most DEVICE_GRADS
            wait for its worker on CUDA, none on CPU where it runs inline, none are left at the next forward), rope
            tables, and one micro-batch's layer or LM-head work, measured by running the runtime's own layer and
            head functions on the meta device (activations.py). tests/test_plan.py checks the peak against the real
            Engine run on the meta device, placement by placement.
    disk    `checkpoint_bytes`: what checkpoint/saver.py writes per save; `ssd_traffic`: the SSD tier's files
            (runtime/disk_tier.py) and what it reads and writes per step. A state on the SSD tier leaves host RAM;
            the tier's cache (a ring of DEPTH + 2 slots of one landing piece per state kind on disk) and the
            staging buffer of one unit (checkpoint saves, resume) take its place.
"""

from __future__ import annotations

from itertools import accumulate

import torch

from ..runtime.activation_spill import spill_numel
from ..runtime.disk_tier import DEPTH as SSD_DEPTH
from ..runtime.pinned import PAGE
from ..runtime.engine import STAGE_ELEMS
from ..runtime.optimizer_pipeline import DEVICE_GRADS, NUM_LANDING, update_order
from ..runtime.adamw import landing_piece as _landing_piece
from ..runtime.schedule import (TIED_INPUT, ScheduleVisitor, grads_to_host, iter_schedule, spilled_layers, stashes,
                                step_schedule, walk)
from ..runtime.schedule import slot_numel as _slot_numel
from ..runtime.store import padded_numel
from . import activations as actsim
from .peak_walk import walk_peak
from .calibration import (CHECKPOINT_EXTRA, COMPILED_ACTIVATIONS, COMPILED_HOST_BASE_GIB, COMPILED_HOST_FROM_TOKENS,
                          COMPILED_HOST_FULL_TOKENS, COMPILED_HOST_RISE_GIB, CUDA_CONTEXT, DATA_BYTES_PER_TOKEN,
                          DATA_FIXED_GIB, GPU_RESERVE, GPU_RESERVE_COMPILED, GPU_RESERVE_LONG_ROW,
                          GPU_RESERVE_LONG_ROW_STREAMS, GPU_RESERVE_STREAMS, GPU_WORKSPACE, LONG_ROW, RUNTIME_HOST)
from .profile import GiB, Profile
from .tally import Tally, unit_sizes as _sizes
from .workload import Workload

# COMPILED_ACTIVATIONS (imported above) is applied in activations.activation_sizes; other code reads it from here

# host components with a name other modules look for
STREAM_COPY_PINNED = "bf16 streaming copy (pinned)"
LANDING = "gradient landing buffers (pinned)"
OFFLOADED = "gradients sent to host during backward (pinned on CUDA)"
SPILLED = "layer-boundary checkpoint spill (pinned on CUDA)"
PARKED = "wave-group gradient accumulators (pinned on CUDA)"
MASTER = "fp32 master weights"
SSD_CACHE = "SSD tier cache (read-ahead and write-behind slots)"
AUTOTUNE = "autotuning copies (pinned; first compiled step)"
SSD_STAGING = "SSD tier staging (one unit: checkpoint saves, resume)"
TUNE_COPY = "engine.tune_first's copy of the model, above the run's own peak"
STATE_NAMES = {"master": MASTER, "m": "Adam m (fp32)", "v": "Adam v (fp32)"}
DEVICE_WORK = "device work (activations, gradients; peak)"  # a CPU run: the device is the host


# ---- sizes of what the runtime allocates: its own functions, over the adapter's units --------------------------
def padded_elems(numels) -> int:
    """HostStore.total_elems: each unit's tile padded to the store's alignment."""
    return sum(padded_numel(n) for n in numels)


def landing_piece(units) -> int:
    """OptimizerPipeline.piece for these units."""
    return _landing_piece(max(u.numel for u in units))


def slot_numel(units, tied: bool) -> int:
    """The engine's weight-slot size for these units."""
    return _slot_numel([u.numel for u in units], tied)


def checkpoint_bytes(params: int) -> float:
    """Disk per checkpoint: fp32 master, Adam m and v of every parameter (checkpoint/saver.py's KINDS), plus the
    run state and manifest."""
    return 12.0 * params + CHECKPOINT_EXTRA


def ssd_traffic(units, w: Workload) -> dict[str, float]:
    """The SSD tier's bytes: `resident` in its files (each unit's state of each kind on disk, rounded up to a page),
    `read` and `written` per step (every state on disk is read before its unit's update and written after it)."""
    files = sum(-(-4 * u.numel // PAGE) * PAGE for u in units) * len(w.disk_states)
    return {"resident": float(files), "read": float(files), "written": float(files)}


# ---- host ---------------------------------------------------------------------------------------------------
def compiled_runtime_host(tokens_per_micro_batch: int) -> float:
    """Extra peak RSS of a torch.compile'd MoE run (a fit to compiled dense runs, kept where `autotune_host` has no
    model): COMPILED_HOST_BASE_GIB up to COMPILED_HOST_FROM_TOKENS tokens per micro-batch, rising linearly by
    COMPILED_HOST_RISE_GIB to COMPILED_HOST_FULL_TOKENS."""
    share = min(1.0, max(0.0, (tokens_per_micro_batch - COMPILED_HOST_FROM_TOKENS) /
                         (COMPILED_HOST_FULL_TOKENS - COMPILED_HOST_FROM_TOKENS)))
    return (COMPILED_HOST_BASE_GIB + COMPILED_HOST_RISE_GIB * share) * GiB


def autotune_host(units, w: Workload) -> float:
    """Page-locked host memory of a compiled run's first step (bench/autotune_copies.py measures it): the first time an
    Inductor kernel with several configurations runs, its autotuning copies the buffers the kernel writes to host
    memory when a copy on the GPU would raise the GPU's peak so far, and torch's caching host allocator keeps them
    in blocks rounded up to a power of two (returned after the step now: runtime/pinned.release_torch_pinned_cache;
    none when Inductor's on-disk cache has the kernels tuned: the same shapes again, a resume; not on the
    store's peak when `engine.tune_first` tuned them on a copy of the model before the store existed). The largest such
    buffer of a dense layer is its widest projection's output over the micro-batch (or one tile of `seq_tile`
    tokens) in the compute dtype: measured 4.02 GiB for Qwen2.5-7B at 80,896 tokens (80,896 x 18,944 x 2 B = 2.85
    GiB, a 4 GiB block), 0.50 at 8,192 (0.29 GiB, a 0.5 GiB block), 0.27 for Llama-3.1-8B in tiles of 8,192 (0.22,
    a 0.25 GiB block). An upper bound: with headroom below the GPU's peak the copy stays on the GPU."""
    tokens = max(w.micro_batches) * w.seq_len
    if 0 < w.placement.seq_tile < tokens:
        tokens = w.placement.seq_tile
    specs = units[1].specs if len(units) > 2 else []
    if not specs or any(len(s.shape) > 2 for s in specs):  # experts' stacked weights: routed tokens, not modelled
        return compiled_runtime_host(tokens)
    width = max(s.shape[0] for s in specs if len(s.shape) == 2)
    nbytes = int(tokens * width * w.elem)
    return float(1 << (nbytes - 1).bit_length())


def host_memory(units, w: Workload, tied: bool = False) -> dict[str, float]:
    """Host RAM by component, in bytes (a CPU run's device work is added by make_plan). tied: the LM head is the
    embedding (its input-side gradient has an accumulator of its own)."""
    z = _sizes(units)
    elems = z.elems
    out = {name: 4.0 * elems for k, name in STATE_NAMES.items() if k not in w.disk_states}
    if w.precision == "bf16" and not w.fp32_stream:
        out["bf16 streaming copy" + (" (pinned)" if w.device == "cuda" else "")] = 2.0 * elems
    if w.disk_states:  # DiskTier's slots (its pieces are the landing pieces) and HostStore.unit_state's buffer
        kinds = len(w.disk_states)
        out[SSD_CACHE] = (SSD_DEPTH + 2) * kinds * 4.0 * z.landing
        out[SSD_STAGING] = float(-(-4 * z.largest // PAGE) * PAGE)
    if w.device == "cuda":
        out[LANDING] = NUM_LANDING * 4.0 * z.landing
    # what the placement puts in host memory (runtime/schedule.py), as the runtime allocates it (on CPU too)
    pl, n = w.placement, len(units)
    sent = min(pl.grads_to_host, n)  # grads_to_host(n, pl): the first `sent` of the gradient order
    if sent:  # OptimizerPipeline.offload_host
        out[OFFLOADED] = 4.0 * z.sent[sent]
    spilled = spilled_layers(n - 2, pl)
    if spilled:  # ActivationSpill's buffer: every micro-batch's input of every spilled layer
        hidden = units[0].specs[0].shape[1]  # the embedding is [vocab, hidden]
        shapes = [torch.Size((b, w.seq_len, hidden)) for b in w.micro_batches]
        out[SPILLED] = float(spill_numel(len(spilled), shapes) * w.elem)
    if len(w.groups) > 1 and pl.group_grads == "host":  # GroupAccumulators: the units without a gradient buffer
        #                                                 on the host already, and a tied embedding's input side
        out[PARKED] = 4.0 * (z.sent[n] - z.sent[sent] + (z.numels[0] if tied else 0))  # (TIED_INPUT: unit 0's size)
    # one step's rows as int64 (input ids, labels, positions), the pinned copies sent to the device, the
    # tokenizer and sampler index; the tokenised data itself stays in memory-mapped Arrow files (page cache)
    out["data (one step's batches, tokenizer)"] = DATA_BYTES_PER_TOKEN * w.tokens_per_step + DATA_FIXED_GIB * GiB
    out["runtime (python, torch" + (", CUDA" if w.device == "cuda" else "") + ")"] = RUNTIME_HOST[w.device]
    if w.compile and w.device == "cuda" and not w.tune_first:  # tuned first: before the store exists, not here
        out[AUTOTUNE] = autotune_host(units, w)
    return out


def pinned_bytes(host: dict[str, float], w: Workload) -> float:
    """The page-locked share of `host` (cudaHostRegister'ed by the runtime's PinnedHost)."""
    if w.device != "cuda":
        return 0.0
    pinned = sum(host.get(k, 0) for k in (STREAM_COPY_PINNED, LANDING, OFFLOADED, SPILLED, PARKED, AUTOTUNE))
    if w.precision == "fp32" or w.fp32_stream:
        pinned += host.get(MASTER, 0.0)  # streaming the fp32 master: it is what the runtime registers as pinned
    return pinned


# ---- GPU: the step, use by use ------------------------------------------------------------------------------
CHECKPOINTS = "layer-boundary checkpoints"
STASHED = "attention kept for the backward (q, k, v, output)"
HIDDEN = "hidden states (layer input, outputs so far)"
DHIDDEN = "d(hidden) buffers"
ACTIVE = "gradient accumulators (fp32, in use)"
FINISHED = "finished gradients (fp32, on the GPU until copied out)"
PARKED_GPU = "accumulators waiting on the GPU for the next wave group"
LAST_STEP = "gradients of the last step (awaiting copy-out)"
ARRIVING = "gradient accumulators (fp32, one leaving for host, the next arriving)"


def _worst(parts: list[tuple[float, float]]) -> tuple[int, float, float]:
    """(micro-batch, state, transient) of the largest state + transient over a group's micro-batches."""
    sums = [state + transient for state, transient in parts]
    m = sums.index(max(sums))  # the first of equals, as max(range(...), key=...) picks
    return m, parts[m][0], parts[m][1]


_GROUPS: dict[tuple, tuple] = {}  # (id(act), micro-batches, elem, seq, hidden) -> (act, _group_sizes)


def _group_sizes(act: dict, mbs: tuple[int, ...], e: int, T: int, H: int) -> tuple:
    """A wave group's C and each kind of work's worst (micro-batch, state, transient), once per shape and sizes."""
    key = (id(act), mbs, e, T, H)
    got = _GROUPS.get(key)
    if got is not None and got[0] is act:
        return got[1]
    c = [float(b * T * H * e) for b in mbs]
    C = sum(c)
    pre = list(accumulate(c[:-1], initial=0))  # outputs (or d(hidden)) of the micro-batches before m: sum(c[:m])
    fwd = _worst([(pre[m], act[b]["forward"]) for m, b in enumerate(mbs)])
    st = [float(act[b].get("stash", 0.0)) for b in mbs]  # each micro-batch's kept attention
    # sum(st[:m]) and sum(st[m + 1:]) for every m (whole bytes: exact in any order)
    before = list(accumulate(st, initial=0))
    after = list(accumulate(reversed(st), initial=0))[-2::-1]
    # a layer that keeps its attention: the earlier micro-batches' stashes of it are alive in its forward; in
    # its backward, those of the micro-batches after the current one (whose own stash, spent as its backward
    # goes, is in that backward's measured peak)
    fwd_st = _worst([(pre[m] + before[m], act[b].get("forward_stash", 0.0)) for m, b in enumerate(mbs)])
    bwd_st = _worst([(C - pre[m] + after[m], act[b].get("backward_stash", 0.0)) for m, b in enumerate(mbs)])
    lm = _worst([(pre[m], act[b]["head"]) for m, b in enumerate(mbs)])
    bwd = _worst([(C - pre[m], act[b]["backward"]) for m, b in enumerate(mbs)])  # own inputs not yet spent
    emb = _worst([(0.0, 2.0 * c[m] if e == 2 else 0.0) for m in range(len(mbs))])  # d(hidden) as fp32
    if len(_GROUPS) >= 256:
        _GROUPS.clear()
    _GROUPS[key] = (act, (C, fwd, st, before, after, fwd_st, bwd_st, lm, bwd, emb))
    return _GROUPS[key][1]


def gpu_phases(adapter, units, w: Workload, notes: list[str], prof: Profile | None = None) -> list:
    """(phase, {component: bytes}) for every use of the step's schedule (runtime/schedule.py), at its worst
    micro-batch, in step order: what Engine.train_step holds on the device while that use computes.

    Walks `step_schedule` with the workload's placement, keeping the engine's books: which layer inputs are kept,
    spilled, fetched back (`Use.fetch`) or rebuilt (`rebuild` uses) for the current wave group; which fp32
    accumulators are in use (the embedding's from the head to its backward, a layer's through its backward, a tied
    embedding's input side in its backward: engine.TIED_INPUT); where each unit's gradient goes after its last use in
    a group (`Use.grad`: waits on the GPU for the optimizer, copied to host, parked for the next group on the GPU or
    in host memory, brought back one use ahead of its next touch); and, on CUDA, the last step's gradients still
    waiting for the optimizer's copy-out while the first group's forward waits for their updates unit by unit."""
    books = _GpuBooks(adapter, units, w, notes, prof)
    walk(books.uses, books)
    return books.phases


class Over(Exception):
    """gpu_peak's walk stopped: `over` held for a phase's total."""


def gpu_peak(adapter, units, w: Workload, prof: Profile | None = None, over=None) -> float:
    """max(sum(c.values()) for _, c in gpu_phases(...)): the same walk, each phase's total summed in the same order,
    without keeping the phases (the placement search plans hundreds of placements). over(total): raise Over at the
    first phase total, above those before it, for which it holds (when the search asks only whether a peak fits)."""
    books = _GpuBooks(adapter, units, w, [], prof, peak_only=True)
    books.over = over
    walk_peak(iter_schedule(len(units), adapter.tied, w.placement, len(w.groups)), books)  # built as far as walked
    return books.peak


class _GpuBooks(ScheduleVisitor):
    """gpu_phases' walk of the schedule: the engine's books as attributes (the step's; the wave group's, set anew
    when a group begins), one phase appended per use, its method named after its kind (peak_only: only the largest
    phase total kept)."""

    def __init__(self, adapter, units, w: Workload, notes: list[str], prof: Profile | None, peak_only: bool = False):
        e, n, pl = w.elem, len(units), w.placement
        self.peak_only, self.peak, self.over = peak_only, 0.0, None
        if not peak_only:
            self.forward_run = None  # (schedule.walk: each forward use on its own, a phase each)
        self.adapter, self.w, self.groups = adapter, w, w.groups
        z = _sizes(units)
        self.grad = grad = z.grad  # fp32, by unit index (forward order: embed, layers, head); read only
        self.cuda = cuda = w.device == "cuda"
        slots = float(w.num_slots * z.slot_numel(adapter.tied) * e) if cuda else 0.0
        if cuda and w.fp32_stream:  # the engine's staging buffer: fp32 pieces cast into the slots
            slots += 4.0 * min(z.slot_numel(adapter.tied), STAGE_ELEMS)
        self.slots = slots
        self.per_token_ctx = 2 * adapter.head_dim * e + 4 * 8  # cos, sin; input ids, positions, target index, targets
        self.act = actsim.activation_sizes(adapter, w, notes, prof)
        # the last step's gradients that waited on the GPU, copied out in the optimizer's order (forward order);
        # without clipping they were updated during that step's backward: none is left
        key = (min(pl.grads_to_host, n), w.clipping)  # (grads_to_host: the first N of the gradient order)
        if key not in z.left_after:
            to_host = set(grads_to_host(n, pl))
            copied_out = update_order(n)
            stays = [0.0 if i in to_host or not w.clipping else grad[i] for i in range(n)]
            left_after = [0.0] * n
            for k in range(n - 2, -1, -1):
                left_after[copied_out[k]] = left_after[copied_out[k + 1]] + stays[copied_out[k + 1]]
            z.left_after[key] = left_after
        self.left_after = z.left_after[key]  # read only
        self.phases, self.handed = [], []  # handed: without clipping, those given to the optimizer (the last waits)
        self.finished = 0.0  # this step's complete gradients waiting on the GPU
        self.parked = Tally()  # unit -> accumulator waiting on the GPU for the next group (TIED_INPUT)
        self.uses = [] if peak_only else step_schedule(n, adapter.tied, pl, len(self.groups))  # (gpu_peak: its own)
        # every group's forwards keep the same layers' attention (none without reuse_attention)
        self.stashing = pl.reuse_attention > 0 and any(stashes(l, pl, n - 2) for l in range(n - 2))
        self.gi = None  # the wave group of the use being visited

    def _begin_group(self, gi: int) -> None:
        """A wave group's sizes (the worst micro-batch of each kind of work) and empty books."""
        w, act = self.w, self.act
        e, T, H = w.elem, w.seq_len, self.adapter.hidden_size
        self.gi = gi
        mbs = [w.micro_batches[m] for m in self.groups[gi]]
        self.tag = f", group {gi + 1}/{len(self.groups)}" if len(self.groups) > 1 else ""
        rows = sum(mbs)
        self.base = {"weight slots": self.slots, "rope tables, token ids, masks":
                     float(rows * T * self.per_token_ctx) + actsim.mask_bytes(self.adapter, rows, T, w.packed,
                                                                              self.cuda),
                     "workspace": float(GPU_WORKSPACE) if self.cuda else 0.0}
        self.base_total = sum(self.base.values())
        self.C, self.fwd, self.st, self.st_before, self.st_after, self.fwd_st, self.bwd_st, self.lm, self.bwd, \
            self.emb = _group_sizes(act, tuple(mbs), e, T, H)
        if self.stashing and not all("stash" in act[b] for b in mbs):
            raise ValueError("reuse_attention: this model's layers cannot keep their attention (runtime.layer."
                             "can_stash)")
        self.kept = Tally()  # layer -> its inputs of this group on the GPU (kept, fetched, or rebuilt)
        self.stashed = Tally()  # layer -> its kept attention of this group's micro-batches
        self.active = Tally()  # unit -> accumulator in use
        self.dh = self.hidden = self.last_out = self.prev_out = 0.0

    def enter(self, use) -> None:
        if use.group != self.gi:
            self._begin_group(use.group)
        self.prev_out, self.last_out = self.last_out, 0.0  # an accumulator copied to host by the use before

    def _phase(self, name: str, m: int | None, comps: dict) -> None:
        if self.peak_only:  # the phase's dict below, summed in its order (base, STASHED, comps, the last three)
            total = self.base_total + comps.get(STASHED, self.stashed.total)
            for k, v in comps.items():
                if k != STASHED:
                    total += v
            self._peak_at(total + self.active.total + self.finished + self.parked.total)
            return
        where = f", micro-batch {self.groups[self.gi][m] + 1}/{len(self.w.micro_batches)}" if m is not None else ""
        self.phases.append((name + self.tag + where, {**self.base, STASHED: self.stashed.total, **comps,
                                                      ACTIVE: self.active.total, FINISHED: self.finished,
                                                      PARKED_GPU: self.parked.total}))

    def _peak_at(self, total: float) -> None:
        """peak_only: a phase's total against the largest so far (Over: `over` holds for it). The layers' uses
        (forward, rebuild, backward: nearly every use) sum their phase inline, in _phase's order, without its dict."""
        if total > self.peak:
            self.peak = total
            if self.over is not None and self.over(total):
                raise Over

    def _take(self, unit: int) -> None:  # Engine._grad_buffer: continued from the GPU, back from host, or new
        b = self.parked.pop(unit, None)
        if b is None:
            b = self.grad[max(unit, 0)]
            if self.gi > 0 and self.w.placement.group_grads == "host":  # prefetched at the end of the use before,
                #                                   while that use's own accumulator was still on the device
                self._phase("accumulator back from host", None, {CHECKPOINTS: self.kept.total,
                                                                  HIDDEN: self.hidden, DHIDDEN: self.dh,
                                                                  ARRIVING: b + self.prev_out})
        self.active[unit] = b

    def _done(self, unit: int, where: str) -> None:  # after the unit's last use in the group (Use.grad)
        b = self.active.pop(unit)
        if where == "gpu" and self.w.clipping:
            self.finished += b
        elif where == "gpu":  # OptimizerPipeline.put holds the engine while DEVICE_GRADS wait for the worker
            self.handed.append(b)
            self.finished = sum(self.handed[-DEVICE_GRADS:]) if self.cuda else 0.0
        elif where == "group-gpu":
            self.parked[unit] = b
        else:  # copied to host memory: freed (its memory reused once the copy ends)
            self.last_out = b

    def _bring_back(self, use) -> None:  # spilled inputs on the device: fetched a block ahead, or loaded at use
        if use.fetch is not None:
            self.kept[use.fetch] = self.C
        self.kept.setdefault(use.layer, self.C)

    def _last_step(self, unit: int) -> float:
        """The last step's gradients still on the GPU while the first group's forward waits for `unit`'s update."""
        return self.left_after[unit] if self.cuda and self.gi == 0 else 0.0

    def embed(self, use) -> None:
        self.hidden = self.C
        self._phase("embedding", None, {HIDDEN: self.C, LAST_STEP: self._last_step(0)})

    def forward_run(self, uses) -> None:
        """peak_only (schedule.walk hands it a group's forward wave): enter, forward and leave of each use, the
        phase totals summed as `forward` sums them, without the calls per use (the search's walks are mostly this)."""
        self.enter(uses[0])
        if len(uses) > 1:
            self.prev_out = self.last_out = 0.0  # what each later enter leaves
        base, C, kept, stashed, before = self.base_total, self.C, self.kept, self.stashed, self.st_before
        rest = (self.active.total, self.finished, self.parked.total)  # no forward changes them
        left = self.left_after if self.cuda and self.gi == 0 else None  # _last_step
        _, fwd_state, fwd_transient = self.fwd
        for use in uses:
            on_gpu = use.keep == "gpu"
            if on_gpu:
                kept[use.layer] = C
            if use.stash:
                m, state, transient = self.fwd_st
                sm = before[m]
                state -= sm
            else:
                state, transient, sm = fwd_state, fwd_transient, 0.0
            total = base + (stashed.total + sm) + kept.total + ((0.0 if on_gpu else C) + state) + transient + \
                (0.0 if left is None else left[use.units[0]]) + rest[0] + rest[1] + rest[2]
            if total > self.peak:
                self._peak_at(total)
            if use.stash:
                stashed[use.layer] = before[-1]

    def forward(self, use) -> None:
        if use.keep == "gpu":
            self.kept[use.layer] = self.C
        m, state, transient = self.fwd_st if use.stash else self.fwd
        sm = self.st_before[m] if use.stash else 0.0  # `state` holds this layer's earlier micro-batches' stashes:
        state -= sm  #                                  counted apart, as STASHED
        if self.peak_only:  # the dict below, summed in its order (_phase)
            self._peak_at(self.base_total + (self.stashed.total + sm) + self.kept.total +
                          ((0.0 if use.keep == "gpu" else self.C) + state) + transient +
                          self._last_step(use.grad_unit) + self.active.total + self.finished + self.parked.total)
        else:
            self._phase(f"forward, layer {use.layer}", m, {
                STASHED: self.stashed.total + sm, CHECKPOINTS: self.kept.total,
                HIDDEN: (0.0 if use.keep == "gpu" else self.C) + state, "layer activations (1 micro-batch)": transient,
                LAST_STEP: self._last_step(use.grad_unit)})
        if use.stash:
            self.stashed[use.layer] = self.st_before[-1]

    def head(self, use) -> None:
        self._take(0)
        self._take(use.grad_unit)
        m, state, transient = self.lm
        self._phase("LM head", m, {CHECKPOINTS: self.kept.total, HIDDEN: self.C, DHIDDEN: state,
                                   "LM head chunk + loss (1 micro-batch)": transient})
        self.dh, self.hidden = self.C, 0.0
        self._done(use.grad_unit, use.grad)

    def rebuild(self, use) -> None:
        self._bring_back(use)
        m, state, transient = self.fwd
        if self.peak_only:  # the dict below, summed in its order (_phase)
            self._peak_at(self.base_total + self.stashed.total + self.kept.total + state + self.dh + transient +
                          self.active.total + self.finished + self.parked.total)
        else:
            self._phase(f"rebuild, layer {use.layer}", m, {CHECKPOINTS: self.kept.total, HIDDEN: state, DHIDDEN:
                                                           self.dh, "layer activations (1 micro-batch)": transient})
        self.kept[use.layer + 1] = self.C

    def backward(self, use) -> None:
        self._take(use.grad_unit)
        self._bring_back(use)
        own = self.stashed.pop(use.layer, None)
        m, state, transient = self.bwd if own is None else self.bwd_st
        left = 0.0
        if own is not None:  # `state` holds the later micro-batches' stashes: counted apart, as STASHED
            left = self.st_after[m]
            state -= left
        if self.peak_only:  # the dict below, summed in its order (_phase)
            self._peak_at(self.base_total + (self.stashed.total + left) +
                          (self.kept.total - self.kept[use.layer] + state) + self.dh + transient +
                          self.active.total + self.finished + self.parked.total)
        else:
            self._phase(f"backward, layer {use.layer}", m, {
                STASHED: self.stashed.total + left,
                CHECKPOINTS: self.kept.total - self.kept[use.layer] + state, DHIDDEN: self.dh,
                "layer activations (1 micro-batch)": transient})
        del self.kept[use.layer]
        self._done(use.grad_unit, use.grad)

    def embed_backward(self, use) -> None:  # the scatter-add of each micro-batch's d(hidden), no weights
        tied = self.adapter.tied
        if tied:
            self._take(TIED_INPUT)
        m, _, transient = self.emb
        self._phase("embedding backward", m, {DHIDDEN: self.dh + transient})
        self.dh = 0.0
        if tied:  # the input side is added to the LM-head side, or waits for the next group
            b = self.active.pop(TIED_INPUT)
            if use.grad == "group-gpu":
                self.parked[TIED_INPUT] = b
            elif use.grad == "group-host":
                self.last_out = b
        self._done(0, use.grad)


def peak_phase(phases: list) -> tuple[str, dict[str, float]]:
    """The phase with the largest live total (the first of equals)."""
    return max(phases, key=lambda p: sum(p[1].values()))


def gpu_needed(peak: float, w: Workload) -> float:
    """GPU memory a CUDA run needs for an allocated peak: the caching allocator's reserve and the CUDA context."""
    pl = w.placement
    side_streams = pl.spill_layers or pl.grads_to_host or (len(w.groups) > 1 and pl.group_grads == "host")
    if pl.seq_tile and max(w.micro_batches) == 1 and w.seq_len >= LONG_ROW:
        reserve = GPU_RESERVE_LONG_ROW + (GPU_RESERVE_LONG_ROW_STREAMS if side_streams else 0.0)
    else:
        reserve = (GPU_RESERVE_COMPILED if w.compile else GPU_RESERVE) + (GPU_RESERVE_STREAMS if side_streams else 0.0)
    return peak * (1 + reserve) + CUDA_CONTEXT
