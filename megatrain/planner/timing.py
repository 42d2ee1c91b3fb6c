"""Step time of a run, from config.json, the workload and the machine profile.

    FLOPs   `executed_flops`: what one step executes, recompute included: 8 per layer parameter per token
            (forward, recompute, backward), 6 per LM-head parameter per target, attention 8·T·heads·head_dim per
            layer per token (causal: forward 2·T·d, recompute the same, backward twice that).
    rates   a layer rate the probe measured at this shape (profile.py), converted by COMPILED_SPEEDUP when it
            was probed only in the other compile mode; else the profile's matmul and attention rates.
    time    `_simulate`, a small event simulation of one steady-state CUDA step that walks the runtime's own
            `step_schedule` (runtime/schedule.py), as Engine.train_step (runtime/engine.py) executes it: H2D
            weight copies into the slot ring (skipped when the slot still holds those weights), compute per use at
            the profile's rates, and the CPU AdamW of the last step that each forward use waits for
            (OptimizerPipeline, runtime/optimizer_pipeline.py): a pipeline over units in forward order, piece by
            piece through two landing buffers of `landing_piece` elements (embedding first: all of it lands and
            is updated before layer 0 may start), the copy of piece k+1 overlapping the update of piece k;
            offloaded units (`offloaded_units`) were copied during the last backward. Updates run at ADAMW_IN_STEP
            of the probe's rate. A CPU run is compute plus an inline update.
    bound   the CPU optimizer (or the gradients' copy-out) when the forward waited for it past the middle of the
            step, else the busiest resource.
"""

from __future__ import annotations

from ..runtime.optimizer_pipeline import landing_piece, offloaded_units, update_order
from ..runtime.schedule import step_schedule
from .flops import flops_per_token
from .profile import COMPILED_SPEEDUP, Profile
from .workload import Workload

# The CPU AdamW inside a training step runs at this share of the probe's rate (measured alone on an idle machine):
# in a step it shares the cores with the training thread and host memory with the PCIe copies. On the 19 H200
# runs of 2026-11-21, the GPU idle time each measured (the forward of unit u waiting for unit u's update) implies
# 0.44-0.72 of the probe's 4.55 Gparam/s, median 0.62 (2.8 Gparam/s), in runs of 33k to 262k tokens per step.
ADAMW_IN_STEP = 0.62


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
    """Seconds per step and its parts, throughput, and the bound (see the module docstring)."""
    fl = executed_flops(adapter, units, w)
    total = sum(fl.values())
    tokens = w.tokens_per_step
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


def _simulate(adapter, units, w: Workload, prof: Profile, layer_s, head_s: float) -> dict[str, float]:
    """One steady-state step: the last step's gradients start to leave at t=0 (its end)."""
    e = w.elem
    n = len(units)
    L = n - 2
    S = min(w.spill_layers, L)  # layers 0 .. S-1 keep their checkpoints in pinned host memory
    C = w.tokens_per_step * adapter.hidden_size * e
    off = set(offloaded_units(n, w.offload_units))

    # the CPU optimizer of the last step, in forward order (OptimizerPipeline.order), piece by piece
    piece = landing_piece(max(u.numel for u in units))
    d2h_rate = prof.bidir_bps
    adam = prof.adamw_params_per_s * ADAMW_IN_STEP
    ready = [0.0] * n
    chain = [(0.0, 0.0)] * n  # (copy-out, AdamW) seconds spent until unit i is ready
    d2h_end, upd_end, prev_upd_end = 0.0, 0.0, 0.0
    d2h_busy = opt_busy = copied = 0.0
    for i in update_order(n):
        u = units[i]
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

    # the step's uses, as the engine executes them; use k goes to slot k % num_slots (the engine's slot ring)
    h2d_end = 0.0
    comp_end: list[float] = []
    holds: list[tuple[int, ...] | None] = [None] * w.num_slots
    h2d_busy = comp_busy = 0.0
    paced, paced_by = 0.0, (0.0, 0.0)  # when the GPU last resumed after waiting for an update; that chain's work
    for k, use in enumerate(step_schedule(n, adapter.tied)):
        slot = k % w.num_slots
        others = max([h2d_end] + ([comp_end[k - w.num_slots]] if k >= w.num_slots else []))
        waits = max(use.units, key=lambda i: ready[i]) if use.forward else None  # Engine: wait_for_update
        start = max(others, ready[waits] if use.forward else 0.0)
        fetched = holds[slot] != use.units  # the engine skips the copy when the slot still holds these weights
        if fetched:
            rate = d2h_rate if use.forward else prof.h2d_bps
            t = sum(units[i].numel for i in use.units) * e / rate
            if use.kind == "backward" and 0 < use.layer <= S:
                t += C / rate  # the spilled checkpoints of the layer below come back behind these weights
            h2d_end = start + t
            h2d_busy += t
        holds[slot] = use.units
        if use.kind == "embed":
            dt = 0.0  # the lookup
        elif use.kind == "head":
            dt = head_s
        else:
            dt = layer_s(units[use.units[0]].numel, use.kind == "forward")
        begin = max(comp_end[-1] if comp_end else 0.0, h2d_end if fetched else 0.0)
        if fetched and use.forward and ready[waits] > others and begin > (comp_end[-1] if comp_end else 0.0):
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
