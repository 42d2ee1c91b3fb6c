"""Memory of a run, from config.json and the workload alone: host RAM by component, and the GPU phase by phase.

Nothing is allocated. Where megatrain/runtime has a function that sizes an allocation, the planner calls it; what
the runtime does not size itself (the runtime's own RSS, allocator reserve, CUDA context) is calibrated on the H200
runs (the constants below):

    host    `host_memory`: HostStore's tiles (runtime/store.py: each unit padded by `padded_numel`; fp32 master, m, v
            and, in bf16 mode, a bf16 streaming copy), the OptimizerPipeline's two pinned landing buffers of
            `landing_piece` elements and the gradients it offloads (`offloaded_units`;
            runtime/optimizer_pipeline.py), ActivationSpill's pinned checkpoints (runtime/activation_spill.py), one
            step's batches, and the runtime itself (python, torch, CUDA).
    GPU     `gpu_phases`: one (phase, {component: bytes}) for every point of Engine.train_step (runtime/engine.py)
            where the live total can peak, found by walking the runtime's own `step_schedule`
            (runtime/schedule.py) use by use, then the embedding backward that follows it. Components: the weight
            slots (`slot_numel`), layer-boundary checkpoints, d(hidden) buffers, fp32 gradient accumulators,
            finished gradients waiting for the optimizer (which copies them out in forward order, while gradients
            complete in `gradient_order`), rope tables, and one micro-batch's layer or LM-head work, measured by
            running the runtime's own layer and head functions on the meta device (activations.py).
            tests/test_plan.py checks the peak against the real Engine run on the meta device.
    disk    `checkpoint_bytes`: what checkpoint/saver.py writes per save.

What is still modelled by hand here rather than read from the schedule: which layer-boundary checkpoints are on
the GPU at each use (`_Checkpoints`: spill_layers, and checkpoint_every, which the engine does not do yet). When
the schedule carries its checkpoints (kept, spilled, recomputed) and where each gradient goes, `gpu_phases` should
read them off each `Use` instead.
"""

from __future__ import annotations

import math
import weakref

import torch

from ..runtime.lmhead import default_chunk
from ..runtime.optimizer_pipeline import landing_piece as _landing_piece
from ..runtime.activation_spill import spill_numel
from ..runtime.optimizer_pipeline import NUM_LANDING, offloaded_units, update_order
from ..runtime.schedule import gradient_order, step_schedule
from ..runtime.schedule import slot_numel as _slot_numel
from ..runtime.store import padded_numel
from . import activations as actsim
from .profile import GiB, Profile
from .workload import Workload

RUNTIME_HOST = {"cuda": 1.5 * GiB, "cpu": 0.6 * GiB}  # peak RSS beyond the store's buffers (H200 runs)
GPU_WORKSPACE = int(0.25 * GiB)  # cuBLAS/cuDNN workspaces in the caching allocator
# caching-allocator fragmentation, reserved / allocated on the H200 runs: eager 1.07-1.09 (1.29 with spill and
# offload, whose record_stream delays reuse); compiled 1.18-1.49
GPU_RESERVE = 0.10
GPU_RESERVE_COMPILED = 0.35
GPU_RESERVE_STREAMS = 0.20  # added with spill or offload
CUDA_CONTEXT = int(0.6 * GiB)  # outside the caching allocator
COMPILED_ACTIVATIONS = 0.67  # compiled / eager layer backward peak, fitted to the 2026-11-21 compiled runs

# host components with a name other modules look for
STREAM_COPY_PINNED = "bf16 streaming copy (pinned)"
LANDING = "gradient landing buffers (pinned)"
OFFLOADED = "gradients offloaded during backward (pinned)"
SPILLED = "layer-boundary checkpoint spill (pinned)"
MASTER = "fp32 master weights"
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


def offloaded(units, n: int) -> list[int]:
    """The units the OptimizerPipeline offloads with offload_units=n."""
    return offloaded_units(len(units), n)


def checkpoint_bytes(params: int) -> float:
    """Disk per checkpoint: fp32 master, Adam m and v of every parameter (checkpoint/saver.py's KINDS), plus the
    run state and manifest."""
    return 12.0 * params + 16 * 2**20


# ---- host ---------------------------------------------------------------------------------------------------
def compiled_runtime_host(tokens_per_micro_batch: int) -> float:
    """Extra peak RSS of a torch.compile'd run: 0.3 GiB at 32k tokens per micro-batch, 4.4 GiB from 81k on
    (2026-11-21 runs; the cause, in torch.compile's host side, is not pinned down)."""
    share = min(1.0, max(0.0, (tokens_per_micro_batch - 32768) / (80896 - 32768)))
    return (0.3 + 4.1 * share) * GiB


def host_memory(units, w: Workload) -> dict[str, float]:
    """Host RAM by component, in bytes (a CPU run's device work is added by make_plan)."""
    elems = padded_elems(u.numel for u in units)
    out = {MASTER: 4.0 * elems, "Adam m (fp32)": 4.0 * elems, "Adam v (fp32)": 4.0 * elems}
    if w.precision == "bf16":
        out["bf16 streaming copy" + (" (pinned)" if w.device == "cuda" else "")] = 2.0 * elems
    if w.device == "cuda":
        out[LANDING] = NUM_LANDING * 4.0 * landing_piece(units)
        if w.offload_units:
            out[OFFLOADED] = 4.0 * sum(units[i].numel for i in offloaded(units, w.offload_units))
        layers = sum(1 for u in units if u.kind == "layer")
        if w.spill_layers and layers:
            hidden = units[0].specs[0].shape[1]  # the embedding is [vocab, hidden]
            shapes = [torch.Size((b, w.seq_len, hidden)) for b in w.micro_batches]
            out[SPILLED] = float(spill_numel(min(w.spill_layers, layers), shapes) * w.elem)
    # one step's rows as int64 (input ids, labels, positions), the pinned copies sent to the device, the
    # tokenizer and sampler index; the tokenised data itself stays in memory-mapped Arrow files (page cache)
    out["data (one step's batches, tokenizer)"] = 64.0 * w.tokens_per_step + 0.25 * GiB
    runtime = RUNTIME_HOST[w.device]
    if w.compile and w.device == "cuda":
        runtime += compiled_runtime_host(max(w.micro_batches) * w.seq_len)
    out["runtime (python, torch" + (", CUDA" if w.device == "cuda" else "") + ")"] = runtime
    return out


def pinned_bytes(host: dict[str, float], w: Workload) -> float:
    """The page-locked share of `host` (cudaHostRegister'ed by the runtime's PinnedHost)."""
    pinned = host.get(STREAM_COPY_PINNED, 0) + host.get(LANDING, 0) + host.get(OFFLOADED, 0) + host.get(SPILLED, 0)
    if w.precision == "fp32" and w.device == "cuda":
        pinned += host[MASTER]  # in fp32 mode the master is what streams, registered as pinned
    return pinned


# ---- GPU: one micro-batch's work, measured on the meta device ------------------------------------------------
# adapter -> {shape: sizes}: suggestions re-plan the same shapes many times
_ACTIVATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _measured_activations(adapter, w: Workload, prof: Profile | None, b: int) -> float | None:
    """The probe's measured recompute+backward peak for this layer shape, micro-batch and compile mode."""
    if prof is None or w.device != "cuda" or w.packed or w.precision != "bf16":
        return None
    shape = (adapter.hidden_size, adapter.intermediate_size, adapter.num_heads, adapter.num_kv_heads, adapter.head_dim)
    for r in prof.layer_rates:
        if (r.hidden, r.intermediate, r.heads, r.kv_heads, r.head_dim) == shape and (r.micro, r.seq, r.compile) == \
                (b, w.seq_len, w.compile) and r.activation_peak_bytes:
            return float(r.activation_peak_bytes)
    return None


def _activation_sizes(adapter, w: Workload, notes: list[str], prof: Profile | None = None) -> dict[int, dict]:
    """Per distinct micro-batch size: the layer's forward and backward peaks and the LM head's peak."""
    dtype = torch.bfloat16 if w.precision == "bf16" else torch.float32
    chunk = w.loss_chunk_tokens or default_chunk(adapter.vocab_size)  # the Engine's
    targets = w.seq_len - 1 if w.targets_per_row is None else w.targets_per_row
    out = {}
    cache = _ACTIVATIONS.setdefault(adapter, {})
    for b in sorted(set(w.micro_batches)):
        key = (b, w.seq_len, dtype, w.packed, w.device, chunk, targets, w.head_kernels)
        if key not in cache:
            layer = actsim.layer_memory(adapter, b, w.seq_len, dtype, w.packed, cuda_attention=w.device == "cuda")
            cache[key] = {"forward": layer["forward_peak"], "backward": layer["backward_peak"],
                          "head": actsim.head_memory(adapter, b, w.seq_len, b * targets, chunk, dtype,
                                                     cuda=w.device == "cuda" and w.head_kernels)}
        out[b] = dict(cache[key])
        out[b]["backward"] *= COMPILED_ACTIVATIONS if w.compile else 1.0
    measured = {b: _measured_activations(adapter, w, prof, b) for b in out}
    for b, m in measured.items():
        if m is not None:
            out[b]["backward"] = m
    if any(m is not None for m in measured.values()):
        notes.append("layer activations: measured by the probe at this shape")
    elif w.compile:
        notes.append(f"compiled template: layer activations taken as {COMPILED_ACTIVATIONS:.2f} x the eager "
                     f"template's (fitted to the H200 runs); a probe at this shape measures them")
    return out


# ---- GPU: the step, use by use ------------------------------------------------------------------------------
class _Checkpoints:
    """Bytes of layer-boundary checkpoints on the GPU (C: one boundary of every micro-batch; c: of each). Layers
    0 .. S-1 keep theirs in pinned host memory (ActivationSpill); with K > 1 only every K-th boundary is kept
    (PENDING in the engine)."""

    def __init__(self, c: list[float], L: int, S: int, K: int):
        self.c, self.C, self.L, self.S, self.K = c, float(sum(c)), L, S, K

    def forward(self, l: int) -> float:
        """While layer l runs forward (its input included)."""
        C, S, K = self.C, self.S, self.K
        if K > 1:
            return (l // K + 1 + (1 if l % K else 0)) * C
        return (l + 1 - min(l + 1, S)) * C + (C if l < S else 0.0)  # a spilled input lives until layer l is done

    def head(self) -> float:
        """While the head runs: the last layer's input is spilled by now if its layer spills."""
        return self.forward(self.L - 1) - (self.C if self.L - 1 < self.S else 0.0)

    def backward(self, l: int, m: int) -> float:
        """While micro-batch m of layer l runs backward."""
        C, S, K, L = self.C, self.S, self.K, self.L
        own = sum(self.c[m:])
        if K > 1:
            return math.ceil(L / K) * C + (l % K) * C + own
        prefetched = C if 0 < l <= S else 0.0  # layer l-1's spilled checkpoints, brought back behind this layer
        return max(0, l - S) * C + own + prefetched


def gpu_phases(adapter, units, w: Workload, notes: list[str], prof: Profile | None = None) -> list:
    """(phase, {component: bytes}) for every point of the step where the live total can peak, in step order."""
    e, T, H = w.elem, w.seq_len, adapter.hidden_size
    mbs = list(w.micro_batches)
    n = len(units)
    L = sum(1 for u in units if u.kind == "layer")
    c = [b * T * H * e for b in mbs]  # one layer boundary of one micro-batch
    C = float(sum(c))
    grad = [4.0 * u.numel for u in units]  # fp32, by unit index (forward order: embed, layers, head)
    off = set(offloaded(units, w.offload_units))
    kept = [0.0 if i in off else g for i, g in enumerate(grad)]  # finished gradients that stay on the GPU
    # Engine.train_step drops its reference to each gradient once the sink has it, so an offloaded unit's device
    # gradient is freed as soon as its copy to host ends (kept[] is 0 for those).
    completed = gradient_order(n)  # when this step's gradients are complete (backward)
    copied_out = update_order(n)  # when the last step's leave the GPU: the optimizer's order
    cuda = w.device == "cuda"
    slots = float(w.num_slots * slot_numel(units, adapter.tied) * e) if cuda else 0.0
    per_token_ctx = 2 * adapter.head_dim * e + 4 * 8  # cos, sin; input ids, positions, target index, targets
    ctx = float(sum(b * T for b in mbs) * per_token_ctx + (sum(b * T * T for b in mbs) if w.packed else 0))
    base = {"weight slots": slots, "rope tables, token ids, masks": ctx, "workspace": GPU_WORKSPACE if cuda else 0}
    act = _activation_sizes(adapter, w, notes, prof)
    ckpt = _Checkpoints(c, L, min(w.spill_layers, L), max(1, w.checkpoint_every))

    def last_steps_left(u: int) -> float:  # the last step's gradients still on the GPU while unit u runs forward
        if not cuda:  # on CPU the update runs inline: no gradients survive into the next step
            return 0.0
        return sum(kept[i] for i in copied_out[copied_out.index(u) + 1:])

    def finished_before(u: int) -> float:  # this step's gradients complete (and kept) before unit u's
        return sum(kept[i] for i in completed[:completed.index(u)])

    phases = []
    for use in step_schedule(n, adapter.tied):
        u = use.units[0]
        if use.kind == "forward":
            for m, b in enumerate(mbs):
                phases.append((f"forward, layer {use.layer}, micro-batch {m + 1}/{len(mbs)}", {
                    **base, "layer-boundary checkpoints": ckpt.forward(use.layer),
                    "layer outputs so far": float(sum(c[:m])),
                    "layer activations (1 micro-batch)": act[b]["forward"],
                    "gradients of the last step (awaiting copy-out)": last_steps_left(u)}))
        elif use.kind == "head":  # the embedding's gradient accumulator is allocated here, with the head's
            for m, b in enumerate(mbs):
                phases.append((f"LM head, micro-batch {m + 1}/{len(mbs)}", {
                    **base, "layer-boundary checkpoints": ckpt.head(),
                    "layer outputs so far": C, "d(hidden) buffers": float(sum(c[:m])),
                    "LM head chunk + loss (1 micro-batch)": act[b]["head"],
                    "embedding + head gradients (fp32)": grad[0] + grad[u]}))
        elif use.kind == "backward":
            for m, b in enumerate(mbs):
                phases.append((f"backward, layer {use.layer}, micro-batch {m + 1}/{len(mbs)}", {
                    **base, "layer-boundary checkpoints": ckpt.backward(use.layer, m), "d(hidden) buffers": C,
                    "layer activations (1 micro-batch)": act[b]["backward"],
                    "gradient accumulators (fp32: embedding, this layer)": grad[0] + grad[u],
                    "finished gradients (fp32, on the GPU until copied out)": finished_before(u)}))
    # after the schedule, the embedding's backward: a scatter-add of each micro-batch's d(hidden), no weights
    for m in range(len(mbs)):
        phases.append((f"embedding backward, micro-batch {m + 1}/{len(mbs)}", {
            **base, "d(hidden) buffers": C + (2.0 * c[m] if e == 2 else 0.0),
            "gradient accumulators (fp32: embedding, this layer)": grad[0],
            "finished gradients (fp32, on the GPU until copied out)": finished_before(0)}))
    return phases


def peak_phase(phases: list) -> tuple[str, dict[str, float]]:
    """The phase with the largest live total (the first of equals)."""
    return max(phases, key=lambda p: sum(p[1].values()))


def gpu_needed(peak: float, w: Workload) -> float:
    """GPU memory a CUDA run needs for an allocated peak: the caching allocator's reserve and the CUDA context."""
    reserve = (GPU_RESERVE_COMPILED if w.compile else GPU_RESERVE) + \
        (GPU_RESERVE_STREAMS if w.spill_layers or w.offload_units else 0.0)
    return peak * (1 + reserve) + CUDA_CONTEXT
