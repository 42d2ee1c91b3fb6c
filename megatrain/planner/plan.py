"""The planner: host RAM, GPU memory, disk and step time of a run, from config.json and the config alone.

Nothing is loaded or allocated. Sizes follow the code that will allocate them:

    host    HostStore tiles (each unit padded to ALIGN_ELEMS elements; fp32 master, m, v, and a bf16 streaming
            copy in bf16 mode), the OptimizerPipeline's two pinned landing buffers of `landing_piece` elements,
            and the runtime (python, torch, CUDA; calibrated on the H200 runs).
    GPU     walked phase by phase through the engine's schedule (forward wave, head, backward wave, embedding
            backward, and the next step's forward while the last step's gradients are still being copied out):
            weight slots, layer-boundary checkpoints, d(hidden) buffers, fp32 gradients, rope tables, and one
            micro-batch's layer or LM-head work, measured by running the real template on the meta device
            (megatrain.planner.activations). The peak is the largest phase; its components are reported.
    time    a small event simulation of one steady-state step: H2D weight copies into the slot ring, compute
            per unit at the profile's rates, the CPU AdamW of the last step (D2H pieces, then the update)
            that each unit of the forward waits for. The update is a pipeline over units in forward order
            (embedding first: all of it lands and is updated before layer 0 may start): the copy of piece k+1
            overlaps the update of piece k, through two landing buffers; updates run at ADAMW_IN_STEP of the
            probe's rate. A layer rate probed only in the other compile mode is converted by COMPILED_SPEEDUP.
            The bound: the CPU optimizer (or the gradients' copy-out) when the forward waited for it past the
            middle of the step, else the busiest resource.

Executed FLOPs per token: 8 per layer parameter (forward, recompute, backward), 6 per LM-head parameter,
attention 8·T·heads·head_dim per layer (causal: forward 2·T·d, recompute the same, backward twice that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from ..runtime.optimizer_pipeline import landing_piece as _landing_piece
from ..runtime.optimizer_pipeline import offloaded_units
from ..runtime.schedule import slot_numel as _slot_numel
from ..runtime.schedule import step_schedule
from ..runtime.store import padded_numel
from .profile import COMPILED_SPEEDUP, GiB, Profile

RUNTIME_HOST = {"cuda": 1.5 * GiB, "cpu": 0.6 * GiB}  # peak RSS beyond the store's buffers (H200 runs)
GPU_WORKSPACE = int(0.25 * GiB)  # cuBLAS/cuDNN workspaces in the caching allocator
# caching-allocator fragmentation, reserved / allocated on the H200 runs: eager 1.07-1.09 (1.29 with spill and
# offload, whose record_stream delays reuse); compiled 1.18-1.49
GPU_RESERVE = 0.10
GPU_RESERVE_COMPILED = 0.35
GPU_RESERVE_STREAMS = 0.20  # added with spill or offload
CUDA_CONTEXT = int(0.6 * GiB)  # outside the caching allocator
COMPILED_ACTIVATIONS = 0.67  # compiled / eager layer backward peak, fitted to the 2026-11-21 compiled runs
PENDING = "needs engine support (not implemented yet)"
OFFLOADED = "gradients offloaded during backward (pinned)"
SPILLED = "layer-boundary checkpoint spill (pinned)"


# ---- what the run asks of the engine ----------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    micro_batches: tuple[int, ...]  # sequences in each micro-batch of one optimizer step
    seq_len: int  # tokens per row (an upper bound when rows are padded only to the batch's longest)
    device: str = "cuda"
    precision: str = "bf16"  # streaming dtype; the engine computes in it too
    loss_chunk_tokens: int = 0
    num_slots: int = 2
    compile: bool = False
    packed: bool = False
    targets_per_row: int | None = None  # default seq_len - 1 (every position but the last predicts a token)
    spill_layers: int = 0  # Engine(spill_layers): the lowest N layers' checkpoints live in pinned host memory
    offload_units: int = 0  # OptimizerPipeline(offload_units): the first N units done in backward (head, last
    #                         layer, ...) send their fp32 gradients to pinned host memory during backward
    checkpoint_every: int = 1  # keep every K-th layer boundary, recompute the rest in backward (PENDING)
    head_kernels: bool = True  # CUDA: the fused cross-entropy kernel and the in-GEMM accumulation of the head
    #                            (False: the eager head of the first H200 runs, for bench/plan_vs_measured.py)

    @property
    def tokens_per_step(self) -> int:
        return sum(self.micro_batches) * self.seq_len

    @property
    def elem(self) -> int:
        return 2 if self.precision == "bf16" else 4

    def describe(self) -> str:
        sizes: dict[int, int] = {}
        for b in self.micro_batches:
            sizes[b] = sizes.get(b, 0) + 1
        mbs = " + ".join(f"{n}x{b}" for b, n in sizes.items())
        return (f"{len(self.micro_batches)} micro-batch{'es' if len(self.micro_batches) > 1 else ''} ({mbs} rows) "
                f"x {self.seq_len} tokens = {self.tokens_per_step:,} tokens per step")


# ---- sizes of what the runtime allocates: its own functions --------------------------------------------------
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


def compiled_runtime_host(tokens_per_micro_batch: int) -> float:
    """Extra peak RSS of a torch.compile'd run: 0.3 GiB at 32k tokens per micro-batch, 4.4 GiB from 81k on
    (2026-11-21 runs; the cause, in torch.compile's host side, is not pinned down)."""
    share = min(1.0, max(0.0, (tokens_per_micro_batch - 32768) / (80896 - 32768)))
    return (0.3 + 4.1 * share) * GiB


def default_loss_chunk(vocab: int) -> int:
    from ..runtime.lmhead import default_chunk

    return default_chunk(vocab)  # the Engine's


# ---- the plan ---------------------------------------------------------------------------------------------
@dataclass
class Plan:
    model: str
    params: int
    workload: Workload
    profile: Profile
    host: dict[str, float]  # component -> bytes
    pinned: float
    host_available: float | None
    host_source: str
    gpu: dict[str, float]  # components at the peak phase (empty on a CPU device)
    gpu_peak: float  # allocated bytes at the peak (what torch.cuda.max_memory_allocated reports)
    gpu_peak_phase: str
    gpu_needed: float  # peak + allocator reserve + CUDA context
    gpu_limit: float | None
    gpu_limit_source: str
    disk_per_checkpoint: float
    disk_free: float | None
    time: dict[str, float]
    notes: list[str] = field(default_factory=list)
    checkpoint_copies: int = 0
    config_keys: set = field(default_factory=set)  # the config's keys (engine.spill_layers, ...) for suggestions
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def step_s(self) -> float:
        return self.time["step_s"]

    def summary(self) -> dict:
        """The plan's figures for the run's start summary and metrics."""
        return {"plan_host_gib": self.host_total / GiB, "plan_gpu_peak_gib": self.gpu_peak / GiB,
                "plan_step_s": self.step_s, "plan_tokens_per_s": self.time["tokens_per_s"],
                "plan_bound": self.time["bound"]}

    def report(self) -> str:
        return render(self)


def _model_name(adapter) -> str:
    return f"{adapter.model_type}"


def make_plan(adapter, w: Workload, profile: Profile, *, host_available: float | None = None,
              host_source: str = "", gpu_limit: float | None = None, gpu_limit_source: str = "",
              disk_free: float | None = None, checkpoint_copies: int = 0, suggest: bool = True,
              config_keys: frozenset = frozenset()) -> Plan:
    """checkpoint_copies: checkpoints on disk at once at most (0: no saves, the disk is not checked)."""
    units = adapter.units()
    params = sum(u.numel for u in units)
    notes = []
    if not profile.measured:
        notes.append("no machine profile: rates are the H200 defaults (DESIGN.md, bench 2026-11-21); "
                     "run `megatrain probe` on the training machine for its own")
    if w.checkpoint_every > 1:
        notes.append(f"a checkpoint interval is modelled but {PENDING}")
    host = host_memory(units, w)
    pinned = host.get("bf16 streaming copy (pinned)", 0) + host.get("gradient landing buffers (pinned)", 0) + \
        host.get(OFFLOADED, 0) + host.get(SPILLED, 0)
    if w.precision == "fp32" and w.device == "cuda":
        pinned += host["fp32 master weights"]  # in fp32 mode the master is what streams, registered as pinned
    phases = gpu_phases(adapter, units, w, notes, profile)
    name, comps = max(phases, key=lambda p: sum(p[1].values()))
    peak = sum(comps.values())
    if w.device == "cuda":
        reserve = (GPU_RESERVE_COMPILED if w.compile else GPU_RESERVE) + \
            (GPU_RESERVE_STREAMS if w.spill_layers or w.offload_units else 0.0)
        needed = peak * (1 + reserve) + CUDA_CONTEXT
        gpu = comps
    else:  # the device is the host: its activations and gradients are host RAM
        host["device work (activations, gradients; peak)"] = peak
        needed, gpu = 0.0, {}
    plan = Plan(_model_name(adapter), params, w, profile, host, pinned, host_available, host_source, gpu,
                peak if w.device == "cuda" else 0.0, name, needed, gpu_limit, gpu_limit_source,
                12.0 * params + 16 * 2**20, disk_free, step_time(adapter, units, w, profile), notes)
    if " taken as x" in plan.time["rate_source"]:
        notes.append(f"layer rate: the profile has this layer shape {'eager' if w.compile else 'compiled'} only "
                     f"({plan.time['rate_source']}); converted by COMPILED_SPEEDUP={COMPILED_SPEEDUP}, the "
                     f"compiled/eager ratio of the H200 runs (`megatrain probe --compile both` measures both)")
    plan.checkpoint_copies = checkpoint_copies
    plan.config_keys = set(config_keys)
    _check(plan)
    if suggest and not plan.fits:
        plan.suggestions = suggestions(adapter, plan)
    return plan


def _check(plan: Plan) -> None:
    if plan.host_available is not None and plan.host_total > plan.host_available:
        plan.problems.append(f"host RAM: needs {plan.host_total / GiB:.1f} GiB, {plan.host_available / GiB:.1f} GiB "
                             f"available ({plan.host_source})")
    if plan.workload.device == "cuda" and plan.gpu_limit is not None and plan.gpu_needed > plan.gpu_limit:
        plan.problems.append(f"GPU memory: needs {plan.gpu_needed / GiB:.1f} GiB at the peak ({plan.gpu_peak_phase}; "
                             f"{plan.gpu_peak / GiB:.1f} GiB allocated), {plan.gpu_limit / GiB:.1f} GiB available "
                             f"({plan.gpu_limit_source})")
    n = plan.checkpoint_copies
    if n and plan.disk_free is not None and n * plan.disk_per_checkpoint > plan.disk_free:
        plan.problems.append(f"disk: {n} checkpoint{'s' if n > 1 else ''} of {plan.disk_per_checkpoint / GiB:.1f} GiB "
                             f"(checkpoint.keep + the one being written), {plan.disk_free / GiB:.1f} GiB free in "
                             f"the output folder")


# ---- host ---------------------------------------------------------------------------------------------------
def host_memory(units, w: Workload) -> dict[str, float]:
    elems = padded_elems(u.numel for u in units)
    out = {"fp32 master weights": 4.0 * elems, "Adam m (fp32)": 4.0 * elems, "Adam v (fp32)": 4.0 * elems}
    if w.precision == "bf16":
        out["bf16 streaming copy" + (" (pinned)" if w.device == "cuda" else "")] = 2.0 * elems
    if w.device == "cuda":
        out["gradient landing buffers (pinned)"] = 2 * 4.0 * landing_piece(units)
        if w.offload_units:
            out[OFFLOADED] = 4.0 * sum(units[i].numel for i in offloaded(units, w.offload_units))
        layers = sum(1 for u in units if u.kind == "layer")
        if w.spill_layers and layers:
            hidden = units[0].specs[0].shape[1]  # the embedding is [vocab, hidden]
            out[SPILLED] = float(min(w.spill_layers, layers) * w.tokens_per_step * hidden * w.elem)
    # one step's rows as int64 (input ids, labels, positions), the pinned copies sent to the device, the
    # tokenizer and sampler index; the tokenised data itself stays in memory-mapped Arrow files (page cache)
    out["data (one step's batches, tokenizer)"] = 64.0 * w.tokens_per_step + 0.25 * GiB
    runtime = RUNTIME_HOST[w.device]
    if w.compile and w.device == "cuda":
        runtime += compiled_runtime_host(max(w.micro_batches) * w.seq_len)
    out["runtime (python, torch" + (", CUDA" if w.device == "cuda" else "") + ")"] = runtime
    return out


# ---- GPU ------------------------------------------------------------------------------------------------------
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
    import torch

    from . import activations as actsim

    dtype = torch.bfloat16 if w.precision == "bf16" else torch.float32
    V = adapter.vocab_size
    chunk = w.loss_chunk_tokens or default_loss_chunk(V)
    targets = w.seq_len - 1 if w.targets_per_row is None else w.targets_per_row
    out = {}
    cache = adapter.__dict__.setdefault("_plan_activation_cache", {})  # suggestions re-plan the same shapes
    for b in sorted(set(w.micro_batches)):
        key = (b, w.seq_len, dtype, w.packed, w.device, chunk, targets, w.head_kernels)
        if key in cache:
            out[b] = dict(cache[key])
            out[b]["backward"] *= COMPILED_ACTIVATIONS if w.compile else 1.0
            continue
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


def gpu_phases(adapter, units, w: Workload, notes: list[str], prof: Profile | None = None) -> list:
    """(phase, {component: bytes}) for every point of the step where the live total can peak."""
    e, T, H = w.elem, w.seq_len, adapter.hidden_size
    mbs = list(w.micro_batches)
    L = sum(1 for u in units if u.kind == "layer")
    c = [b * T * H * e for b in mbs]  # one layer boundary of one micro-batch
    C = float(sum(c))
    grad = [4.0 * u.numel for u in units]  # fp32, forward order: embed, layers, head
    g_embed, g_layer = grad[0], grad[1:-1]
    off = set(offloaded(units, w.offload_units))
    kept = [0.0 if i in off else g for i, g in enumerate(grad)]  # finished gradients that stay on the GPU
    # Engine.train_step drops its reference to each gradient once the sink has it, so an offloaded unit's device
    # gradient is freed as soon as its copy to host ends (kept[] is 0 for those).
    k_head, k_layer = kept[-1], kept[1:-1]
    cuda = w.device == "cuda"
    slots = float(w.num_slots * slot_numel(units, adapter.tied) * e) if cuda else 0.0
    per_token_ctx = 2 * adapter.head_dim * e + 4 * 8  # cos, sin; input ids, positions, target index, targets
    ctx = float(sum(b * T for b in mbs) * per_token_ctx + (sum(b * T * T for b in mbs) if w.packed else 0))
    base = {"weight slots": slots, "rope tables, token ids, masks": ctx, "workspace": GPU_WORKSPACE if cuda else 0}
    act = _activation_sizes(adapter, w, notes, prof)
    K = max(1, w.checkpoint_every)
    S = min(w.spill_layers, L)  # layers 0 .. S-1 keep their checkpoints in host memory

    def ckpt_fwd(l: int) -> float:  # boundary sets on the GPU while layer l runs forward (its input included)
        if K > 1:
            return (l // K + 1 + (1 if l % K else 0)) * C
        return (l + 1 - min(l + 1, S)) * C + (C if l < S else 0.0)  # a spilled input lives until layer l is done

    def ckpt_bwd(l: int, m: int) -> float:  # while micro-batch m of layer l runs backward
        own = sum(c[m:])
        if K > 1:
            return math.ceil(L / K) * C + (l % K) * C + own
        prefetched = C if 0 < l <= S else 0.0  # layer l-1's spilled checkpoints, brought back behind this layer
        return max(0, l - S) * C + own + prefetched

    phases = []
    prev = w.device == "cuda"  # on CPU the update runs inline: no gradients survive into the next step
    for l in range(L):
        left = sum(k_layer[l + 1:]) + k_head if prev else 0.0
        for m, b in enumerate(mbs):
            phases.append((f"forward, layer {l}, micro-batch {m + 1}/{len(mbs)}", {
                **base, "layer-boundary checkpoints": ckpt_fwd(l), "layer outputs so far": float(sum(c[:m])),
                "layer activations (1 micro-batch)": act[b]["forward"],
                "gradients of the last step (awaiting copy-out)": left}))
    for m, b in enumerate(mbs):
        phases.append((f"LM head, micro-batch {m + 1}/{len(mbs)}", {
            **base, "layer-boundary checkpoints": ckpt_fwd(L - 1) - (C if L - 1 < S else 0.0),
            "layer outputs so far": C, "d(hidden) buffers": float(sum(c[:m])),
            "LM head chunk + loss (1 micro-batch)": act[b]["head"],
            "embedding + head gradients (fp32)": g_embed + grad[-1]}))
    for l in reversed(range(L)):
        done = k_head + sum(k_layer[l + 1:])
        for m, b in enumerate(mbs):
            phases.append((f"backward, layer {l}, micro-batch {m + 1}/{len(mbs)}", {
                **base, "layer-boundary checkpoints": ckpt_bwd(l, m), "d(hidden) buffers": C,
                "layer activations (1 micro-batch)": act[b]["backward"],
                "gradient accumulators (fp32: embedding, this layer)": g_embed + g_layer[l],
                "finished gradients (fp32, on the GPU until copied out)": done}))
    done = k_head + sum(k_layer)
    for m in range(len(mbs)):
        phases.append((f"embedding backward, micro-batch {m + 1}/{len(mbs)}", {
            **base, "d(hidden) buffers": C + (2.0 * c[m] if e == 2 else 0.0),
            "gradient accumulators (fp32: embedding, this layer)": g_embed,
            "finished gradients (fp32, on the GPU until copied out)": done}))
    return phases


# ---- time ---------------------------------------------------------------------------------------------------
def executed_flops(adapter, units, w: Workload) -> dict[str, float]:
    """FLOPs per step, as executed (recompute included)."""
    tokens = w.tokens_per_step
    targets = sum(w.micro_batches) * (w.seq_len - 1 if w.targets_per_row is None else w.targets_per_row)
    layer_params = sum(u.numel for u in units if u.kind == "layer")
    L = adapter.num_layers
    attn_fwd = 2.0 * w.seq_len * adapter.num_heads * adapter.head_dim  # per token per layer, causal
    K = max(1, w.checkpoint_every)
    extra = (K - 1) / K  # share of layers whose forward is run once more to rebuild their checkpoint
    return {"forward": (2.0 * layer_params + L * attn_fwd) * tokens,
            "backward": ((6.0 + 2.0 * extra) * layer_params + L * attn_fwd * (3 + extra)) * tokens,
            "head": 6.0 * adapter.vocab_size * adapter.hidden_size * targets}


def step_time(adapter, units, w: Workload, prof: Profile) -> dict[str, float]:
    fl = executed_flops(adapter, units, w)
    total = sum(fl.values())
    tokens = w.tokens_per_step
    from .flops import flops_per_token

    f6, fmodel = flops_per_token(adapter, w.seq_len)
    micro = max(w.micro_batches)
    rate, how = prof.layer_rate(adapter, micro, w.seq_len, w.compile)
    attn = 2.0 * w.seq_len * adapter.num_heads * adapter.head_dim * tokens  # one layer's attention forward, causal
    x = (max(1, w.checkpoint_every) - 1) / max(1, w.checkpoint_every)
    if rate is not None:  # measured on this layer shape: matmuls and attention together
        # measured only in the other compile mode: converted by the compiled/eager ratio of the H200 runs
        mode = 1.0 if rate.compile == w.compile else COMPILED_SPEEDUP if w.compile else 1.0 / COMPILED_SPEEDUP
        if mode != 1.0:
            how += f", {'compiled' if w.compile else 'eager'} taken as x{mode:.2f} that rate"

        def layer_s(P: int, forward: bool) -> float:
            if forward:
                return (2.0 * P * tokens + attn) / (rate.forward_flops * mode)
            return ((6.0 + 2 * x) * P * tokens + (3 + x) * attn) / (rate.backward_flops * mode)
    else:
        speed = COMPILED_SPEEDUP if w.compile else 1.0
        r_mm, r_attn = prof.layer_flops * speed, prof.attention_flops * speed
        how = ("the profile's largest probed layer's rate" if prof.layer_rates else "default rate") + \
            (" (compiled)" if w.compile else "")

        def layer_s(P: int, forward: bool) -> float:
            if forward:
                return 2.0 * P * tokens / r_mm + attn / r_attn
            return (6.0 + 2 * x) * P * tokens / r_mm + (3 + x) * attn / r_attn
    out = {"executed_flops": total, "rate_source": how}
    if w.device == "cpu":
        compute = total / prof.cpu_flops
        opt = sum(u.numel for u in units) / prof.adamw_params_per_s
        step = compute + opt
        out.update(step_s=step, compute_s=compute, h2d_s=0.0, d2h_s=0.0, optimizer_s=opt,
                   bound="CPU compute" if compute >= opt else "CPU optimizer")
    else:
        out.update(_simulate(adapter, units, w, prof, layer_s, fl["head"] / prof.head_flops))
    step = out["step_s"]
    out["tokens_per_s"] = tokens / step
    out["executed_tflops"] = total / step / 1e12
    out["tflops_6n"] = f6 * tokens / step / 1e12
    out["mfu"] = fmodel * tokens / step / prof.peak_bf16 if prof.peak_bf16 and w.device == "cuda" else None
    return out


# The CPU AdamW inside a training step runs at this share of the probe's rate (measured alone on an idle machine):
# in a step it shares the cores with the training thread and host memory with the PCIe copies. On the 19 H200
# runs of 2026-11-21, the GPU idle time each measured (the forward of unit u waiting for unit u's update) implies
# 0.44-0.72 of the probe's 4.55 Gparam/s, median 0.62 (2.8 Gparam/s), in runs of 33k to 262k tokens per step.
ADAMW_IN_STEP = 0.62


def _simulate(adapter, units, w: Workload, prof: Profile, layer_s, head_s: float) -> dict[str, float]:
    """One steady-state step: the last step's gradients start to leave at t=0 (its end)."""
    e = w.elem
    n = len(units)
    L = n - 2
    schedule = [list(use.units) for use in step_schedule(n, adapter.tied)]  # the engine's own
    S = min(w.spill_layers, L)
    C = w.tokens_per_step * adapter.hidden_size * e
    off = set(offloaded(units, w.offload_units))

    # the CPU optimizer of the last step, in forward order, piece by piece (OptimizerPipeline)
    piece = landing_piece(units)
    d2h_rate = prof.bidir_bps
    adam = prof.adamw_params_per_s * ADAMW_IN_STEP
    ready = [0.0] * n
    chain = [(0.0, 0.0)] * n  # (copy-out, AdamW) seconds spent until unit i is ready
    d2h_end, upd_end, prev_upd_end = 0.0, 0.0, 0.0
    d2h_busy = opt_busy = copied = 0.0
    for i, u in enumerate(units):
        for a in range(0, u.numel, piece):
            k = min(piece, u.numel - a)
            start = max(d2h_end, prev_upd_end)  # issued when the update before last has freed its buffer
            copy = 4.0 * k / d2h_rate
            d2h_busy += copy  # offloaded units were copied during the last backward: no wait now
            d2h_end = start + (0.0 if i in off else copy)
            copied += 0.0 if i in off else copy
            prev_upd_end = upd_end
            upd_end = max(upd_end, d2h_end) + k / adam
            opt_busy += k / adam
        ready[i] = upd_end
        chain[i] = (copied, opt_busy)

    h2d_end = 0.0
    comp_end: list[float] = []
    holds: list[list[int] | None] = [None] * w.num_slots
    h2d_busy = comp_busy = 0.0
    paced, paced_by = 0.0, (0.0, 0.0)  # when the GPU last resumed after waiting for an update; that chain's work
    for k, use in enumerate(schedule):
        forward = k <= L + 1
        slot = k % w.num_slots
        others = max([h2d_end] + ([comp_end[k - w.num_slots]] if k >= w.num_slots else []))
        waits = max(use, key=lambda i: ready[i]) if forward else None
        start = max(others, ready[waits] if forward else 0.0)
        if holds[slot] != use:  # the engine skips the copy when the slot still holds these weights
            rate = d2h_rate if forward else prof.h2d_bps
            t = sum(units[i].numel for i in use) * e / rate
            if not forward and 0 < use[0] - 1 <= S:
                t += C / rate  # the spilled checkpoints of the layer below come back behind these weights
            h2d_end = start + t
            h2d_busy += t
        fetched = holds[slot] != use
        holds[slot] = use
        if k == 0:
            dt = 0.0  # embedding lookup
        elif k <= L:
            dt = layer_s(units[use[0]].numel, True)
        elif k == L + 1:
            dt = head_s
        else:
            dt = layer_s(units[use[0]].numel, False)
        begin = max(comp_end[-1] if comp_end else 0.0, h2d_end if fetched else 0.0)
        if fetched and forward and ready[waits] > others and begin > (comp_end[-1] if comp_end else 0.0):
            paced, paced_by = begin, chain[waits]
        comp_end.append(begin + dt)
        comp_busy += dt
    d2h_busy += S * C / d2h_rate  # spilled checkpoints going out during the forward
    step = comp_end[-1]
    shares = {"compute": comp_busy, "H2D (weights)": h2d_busy, "D2H (gradients)": d2h_busy,
              "CPU AdamW": opt_busy}
    bound = max(shares, key=shares.get)
    if paced > step - paced:  # the GPU waited for the last step's update until past the middle of the step
        bound = "D2H (gradients)" if paced_by[0] > paced_by[1] else "CPU AdamW"
    bound_name = {"compute": "GPU compute", "H2D (weights)": "PCIe (weights in)", "D2H (gradients)":
                  "PCIe (gradients out)", "CPU AdamW": "CPU optimizer"}[bound]
    return {"step_s": step, "compute_s": comp_busy, "h2d_s": h2d_busy, "d2h_s": d2h_busy, "optimizer_s": opt_busy,
            "gpu_idle_s": step - comp_busy, "bound": bound_name}


# ---- what would fit ---------------------------------------------------------------------------------------------
def _memory_ok(p: Plan, gpu_target: float | None) -> bool:
    """Host and GPU fit (the disk is a separate matter: another folder or fewer kept checkpoints)."""
    if any(x.startswith(("host RAM", "GPU memory")) for x in p.problems):
        return False
    return gpu_target is None or p.workload.device != "cuda" or p.gpu_needed <= gpu_target


def suggestions(adapter, plan: Plan, gpu_target: float | None = None) -> list[str]:
    """Config changes that would fit, least disruptive first. gpu_target: GPU bytes to get under instead of the
    plan's limit (after an out-of-memory error: a share of the predicted peak)."""
    w = plan.workload
    per_step, micro = sum(w.micro_batches), max(w.micro_batches)
    out: list[str] = []
    memory_problem = not _memory_ok(plan, gpu_target)
    if gpu_target is None and plan.gpu_limit:
        gpu_target = 0.95 * plan.gpu_limit  # a suggestion keeps 5% of the GPU in hand

    def trial(cand: Workload) -> Plan | None:
        p = make_plan(adapter, cand, plan.profile, host_available=plan.host_available, host_source=plan.host_source,
                      gpu_limit=plan.gpu_limit if gpu_target is None else None, suggest=False,
                      config_keys=frozenset(plan.config_keys))
        return p if _memory_ok(p, gpu_target) else None

    def line(p: Plan, change: str) -> str:
        what = f"host {p.host_total / GiB:.0f} GiB" + (f", GPU {p.gpu_needed / GiB:.0f} GiB"
                                                        if p.workload.device == "cuda" else "")
        return f"{change}  ({what}, {p.step_s:.1f} s/step predicted)"

    if memory_problem:
        b = micro // 2  # 1. smaller micro-batches, the same rows per step
        while b >= 1:
            sizes = tuple([b] * (per_step // b) + ([per_step % b] if per_step % b else []))
            if p := trial(replace(w, micro_batches=sizes)):
                out.append(line(p, f"train.micro_batch_size={b} train.grad_accum_steps={-(-per_step // b)} "
                                   f"(the same rows per step)"))
                break
            b //= 2
        if w.device == "cuda":  # 2. checkpoints and gradients to pinned host memory, the fewest that fit
            L = adapter.num_layers
            for knobs in (("spill_layers",), ("offload_units",), ("spill_layers", "offload_units")):
                found = _smallest(trial, w, knobs, {"spill_layers": L, "offload_units": L + 2})
                if found:
                    p, change = found
                    out.append(line(p, " ".join(_knob(plan, k, v) for k, v in change.items())))
                    break
        if w.precision == "bf16" and (p := trial(replace(w, precision="fp32"))):  # 3. 12 B/param of host RAM
            out.append(line(p, "train.precision=fp32 (12 B/param of host RAM instead of 14; fp32 compute)"))
        T = w.seq_len // 2  # 4. shorter rows, when nothing above fits
        while T >= 128 and not out:
            if p := trial(replace(w, seq_len=T)):
                out.append(line(p, f"data.max_seq_len={T}"))
                break
            T //= 2
        for K in (2, 4, 8):  # 5. not built yet
            if not out and (p := trial(replace(w, checkpoint_every=K))):
                out.append(line(p, f"keep every {K}th layer-boundary checkpoint — {PENDING}"))
        if not out:
            if any(x.startswith("host RAM") for x in plan.problems):
                floor = 12.0 * plan.params + sum(v for k, v in plan.host.items()
                                                 if k.startswith(("gradient landing", "runtime", "data")))
                out.append(f"nothing smaller fits: fp32 master weights and Adam m and v alone take 12 B/param, "
                           f"{floor / GiB:.0f} GiB with the runtime; use a machine with more host RAM (or a "
                           f"smaller model)")
            else:
                out.append("nothing smaller fits on this GPU: even one row per micro-batch exceeds it; use a GPU "
                           "with more memory (or a smaller model)")
    if any(x.startswith("disk") for x in plan.problems):
        if plan.checkpoint_copies > 1:
            out.append(f"checkpoint.keep=1 ({2 * plan.disk_per_checkpoint / GiB:.0f} GiB while a new one is written)")
        out.append(f"output.dir on a file system with {plan.checkpoint_copies * plan.disk_per_checkpoint / GiB:.0f} "
                   f"GiB free, or fewer saves (checkpoint.every=0, checkpoint.at_end=false)")
    return out


def _smallest(trial, w: Workload, knobs: tuple[str, ...], top: dict[str, int]):
    """The smallest setting of `knobs` (the last one searched with the others at their top) that fits."""
    fixed = {k: top[k] for k in knobs[:-1]}
    last = knobs[-1]
    if not trial(replace(w, **fixed, **{last: top[last]})):
        return None
    lo, hi = getattr(w, last), top[last]  # fits at hi, not at lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trial(replace(w, **fixed, **{last: mid})):
            hi = mid
        else:
            lo = mid
    change = {**fixed, last: hi}
    return trial(replace(w, **change)), change


CONFIG_KEYS = {"spill_layers": "engine.spill_layers", "offload_units": "engine.offload_grad_units"}


def _knob(plan: Plan, name: str, value: int) -> str:
    what = {"spill_layers": f"(the lowest {value} layers' checkpoints in pinned host memory)",
            "offload_units": f"(the last {value} units' gradients to pinned host memory during backward)"}[name]
    key = CONFIG_KEYS[name]
    if key in plan.config_keys:
        return f"{key}={value} {what}"
    return f"{name}={value} {what} — an Engine/OptimizerPipeline argument, not a config key yet"


# ---- the report ---------------------------------------------------------------------------------------------------
def _g(x: float) -> str:
    """GiB, with more decimals for small amounts (tiny models)."""
    return f"{x / GiB:8.2f}" if x >= 0.1 * GiB or x == 0 else f"{x / GiB:8.4f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _flops(x: float) -> str:
    return f"{x / 1e12:.0f} TFLOP/s" if x >= 1e13 else f"{x / 1e12:.3g} TFLOP/s"


def render(p: Plan) -> str:
    w, t = p.workload, p.time
    lines = [f"megatrain plan: {p.model}, {_count(p.params)} parameters, {w.precision} streaming on {w.device}"
             f"{' (compiled layers)' if w.compile else ''}",
             f"  step: {w.describe()}"]
    src = p.profile.source if p.profile.measured else "defaults"
    lines.append(f"  machine profile: {src}" + (f" (measured {p.profile.created} on {p.profile.host})"
                                                if p.profile.measured else ""))
    lines.append("")
    lines.append(f"{'host RAM':<58}{'GiB':>8}")
    for k, v in p.host.items():
        lines.append(f"  {k:<56}{_g(v)}")
    avail = (f"   of {p.host_available / GiB:.2f} available ({p.host_source})" if p.host_available is not None else "")
    lines.append(f"  {'total':<56}{_g(p.host_total)}{avail}")
    lines.append(f"  {'of which pinned':<56}{_g(p.pinned)}")
    if w.device == "cuda":
        lines.append("")
        lines.append(f"GPU memory at the peak: {p.gpu_peak_phase}")
        for k, v in p.gpu.items():
            if v:
                lines.append(f"  {k:<56}{_g(v)}")
        lines.append(f"  {'allocated (torch.cuda.max_memory_allocated)':<56}{_g(p.gpu_peak)}")
        lim = (f"   of {p.gpu_limit / GiB:.2f} ({p.gpu_limit_source})" if p.gpu_limit is not None else "")
        lines.append(f"  {'needed (+ allocator reserve, CUDA context)':<56}{_g(p.gpu_needed)}{lim}")
    lines.append("")
    free = f"; {p.disk_free / GiB:.0f} GiB free in the output folder" if p.disk_free is not None else ""
    lines.append(f"disk per checkpoint: {p.disk_per_checkpoint / GiB:.1f} GiB (fp32 master + Adam m + v, "
                 f"12 B/param){free}")
    lines.append("")
    lines.append(f"step time (predicted): {t['step_s']:.2f} s, bound by {t['bound']}")
    if w.device == "cuda":
        lines.append(f"  compute {t['compute_s']:.2f} s ({t['rate_source']}), H2D weights {t['h2d_s']:.2f} s, "
                     f"D2H gradients {t['d2h_s']:.2f} s, CPU AdamW {t['optimizer_s']:.2f} s (overlapped with the "
                     f"next forward); GPU idle {t['gpu_idle_s']:.2f} s")
    mfu = f", MFU {t['mfu'] * 100:.1f}%" if t.get("mfu") else ""
    lines.append(f"  {t['tokens_per_s']:,.0f} tokens/s, {_flops(t['executed_tflops'] * 1e12)} executed, "
                 f"{_flops(t['tflops_6n'] * 1e12)} (6N){mfu}")
    for n in p.notes:
        lines.append(f"note: {n}")
    if p.problems:
        lines.append("")
        lines.append("DOES NOT FIT:")
        lines += [f"  {x}" for x in p.problems]
        if p.suggestions:
            lines.append("would fit:")
            lines += [f"  {x}" for x in p.suggestions]
    else:
        lines.append("fits.")
    return "\n".join(lines)


# ---- from a validated Config ------------------------------------------------------------------------------
def workload_from_config(cfg, adapter, device: str) -> Workload:
    t, eng = cfg.train, cfg.engine
    compile_mode = getattr(eng, "compile", "off")
    return Workload(
        micro_batches=(t.micro_batch_size,) * t.grad_accum_steps, seq_len=cfg.data.max_seq_len, device=device,
        precision=t.precision, loss_chunk_tokens=eng.loss_chunk_tokens, num_slots=eng.num_slots,
        compile=compile_mode == "on" or (compile_mode == "auto" and device == "cuda"), packed=cfg.data.packing,
        spill_layers=getattr(eng, "spill_layers", 0), offload_units=getattr(eng, "offload_grad_units", 0))


def _checkpoint_copies(cfg) -> int:
    """Checkpoints on disk at once at most, from the checkpoint section when there is one (0: no saves)."""
    ck = getattr(cfg, "checkpoint", None)
    if ck is None:
        return 0
    every, keep, at_end = getattr(ck, "every", 0), getattr(ck, "keep", 0), getattr(ck, "at_end", False)
    saves = (cfg.train.steps // every if every else 0) + (1 if at_end else 0)
    return min(saves, keep + 1) if keep else saves


def plan_for_config(cfg, adapter, device: str, profile: Profile | None = None) -> Plan:
    """The plan of `megatrain plan` and of the check `megatrain train` runs before loading weights."""
    from . import sysmem
    from .profile import load_profile, this_host

    plan_cfg = getattr(cfg, "plan", None)
    prof = profile or load_profile(getattr(plan_cfg, "profile", None))
    w = workload_from_config(cfg, adapter, device)
    # host RAM: the configured amount, else this machine's (cgroup-aware), else (planning for the profiled
    # machine from elsewhere) what the profile recorded
    host_gb = getattr(plan_cfg, "host_memory_gb", None)
    if host_gb:
        host_avail, host_src = host_gb * GiB, "plan.host_memory_gb"
    elif prof.measured and prof.host and prof.host != this_host() and prof.host_available_bytes:
        host_avail, host_src = float(prof.host_available_bytes), f"free on {prof.host} when probed"
    else:
        hm = sysmem.host_memory()
        host_avail, host_src = float(hm.available), f"free now; {hm.source}"
    gpu_limit, gpu_src = None, ""
    if device == "cuda":
        budget = getattr(cfg.engine, "gpu_memory_budget_gb", None)
        import torch

        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            gpu_limit, gpu_src = float(free), f"free on {torch.cuda.get_device_name()}"
        else:
            gpu_limit = float(prof.gpu_total_bytes)
            gpu_src = f"{prof.gpu_name}, from the profile" if prof.measured else f"{prof.gpu_name}"
        if budget and budget * GiB < gpu_limit:
            gpu_limit, gpu_src = budget * GiB, "engine.gpu_memory_budget_gb"
    keys = frozenset(f"{section}.{k}" for section in ("engine", "train", "data")
                     for k in type(getattr(cfg, section)).model_fields)
    plan = make_plan(adapter, w, prof, host_available=host_avail, host_source=host_src, gpu_limit=gpu_limit,
                     gpu_limit_source=gpu_src, disk_free=sysmem.disk_free(cfg.output.dir),
                     checkpoint_copies=_checkpoint_copies(cfg), config_keys=keys)
    plan.model = f"{adapter.model_type} ({cfg.model.path})"
    if w.device == "cuda" and not torch_cuda_available():
        plan.notes.append("no GPU on this machine: planned for the profile's GPU (train.device=cpu plans a CPU run)")
    return plan


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def target_device(cfg, profile: Profile | None = None) -> str:
    """The device `megatrain plan` plans for: train.device, or with 'auto' the GPU when there is one here or
    the profile describes one (planning for the training machine from elsewhere), else the CPU."""
    choice = cfg.train.device
    if choice != "auto":
        return choice
    if torch_cuda_available():
        return "cuda"
    return "cuda" if profile is not None and profile.measured and profile.gpu_total_bytes else "cpu"


def refusal(plan: Plan) -> str:
    """The one error `megatrain train` gives when the plan says the run cannot fit."""
    lines = ["the run will not fit (megatrain plan CONFIG shows the whole plan):"]
    lines += [f"  {p}" for p in plan.problems]
    if plan.suggestions:
        lines.append("what would fit:")
        lines += [f"  {s}" for s in plan.suggestions]
    lines.append("(plan.check=false runs it anyway)")
    return "\n".join(lines)


def plan_command(cfg) -> int:
    """`megatrain plan CONFIG`: print the plan; exit status 1, with the reason, when the run will not fit."""
    import sys

    from ..models import get_adapter, load_hf_config
    from .profile import load_profile

    adapter = get_adapter(load_hf_config(cfg.model.path))
    prof = load_profile(getattr(getattr(cfg, "plan", None), "profile", None))
    plan = plan_for_config(cfg, adapter, target_device(cfg, prof), prof)
    print(plan.report())
    if not plan.fits:
        print("megatrain: the run will not fit: " + "; ".join(plan.problems), file=sys.stderr)
        return 1
    return 0


def check_before_run(cfg, adapter, device: str) -> Plan | None:
    """`megatrain train`'s check, before any weight is loaded: raises MegatrainError when the run cannot fit.
    Returns the plan (None when it could not be computed: the run goes ahead, with a warning)."""
    import warnings

    from ..errors import MegatrainError

    try:
        plan = plan_for_config(cfg, adapter, device)
    except MegatrainError:
        raise
    except Exception as e:  # the planner must never be the reason a valid run cannot start
        warnings.warn(f"megatrain: the plan could not be computed ({type(e).__name__}: {e}); running unchecked")
        return None
    if not plan.fits and getattr(getattr(cfg, "plan", None), "check", True):
        raise MegatrainError(refusal(plan))
    return plan
