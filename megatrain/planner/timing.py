"""Step time of a run, from config.json, the workload and the machine profile.

    FLOPs   `executed_flops`: what one step executes, read off the schedule: per layer parameter and token 2 in
            a forward or rebuild use, 6 in a backward use (recompute + backward); attention 2·T·heads·head_dim per
            layer and token forward (causal), 3x that in backward (2x when the layer kept its attention from the
            forward wave: Placement.reuse_attention); 6 per LM-head parameter per target.
    rates   a layer rate the probe measured at this shape (profile.py), converted by COMPILED_SPEEDUP when it
            was probed only in the other compile mode; else the profile's matmul and attention rates (flash's),
            plus for each layer on FlexAttention or the varlen kernel on CUDA (packed rows, a window shorter than
            the row, a score SDPA cannot apply: ModelAdapter.cuda_attention) the time its kernel takes beyond
            SDPA's over the same FLOPs at the rows' span (`kernel_extra`), and for
            the layers whose attention runs blocked for its backward (Placement.attn_block: `blocked_share`) the
            attention at 1/BLOCKED_ATTENTION_SLOWDOWN of the rate. A probed layer rate is used only for rows near
            its own length (Profile.layer_rate) and not for blocked attention (the probe ran the fused kernel).
    time    `_simulate`, a small event simulation of one steady-state CUDA step that walks the runtime's own
            `step_schedule` (runtime/schedule.py) with the workload's placement, as Engine.train_step
            (runtime/engine.py) executes it: per use, H2D weight copies into the slot ring (skipped when the slot
            still holds those weights; only uses that stream weights advance the ring), behind them on the same
            stream the spilled inputs fetched back and the wave groups' accumulators coming back from host; compute
            per use at the profile's rates over the group's tokens (rebuild uses at the forward rate); the copies
            out that overlap the compute (spilled inputs, gradients sent to host, parked accumulators) bound the
            step from below; and the CPU AdamW of the last step that each forward use of the first wave group waits
            for (OptimizerPipeline, runtime/optimizer_pipeline.py): a pipeline over units in forward order, piece
            by piece through two landing buffers of `landing_piece` elements (embedding first: all of it lands and
            is updated before layer 0 may start), the copy of piece k+1 overlapping the update of piece k; units
            whose gradients went to host (`grads_to_host`) were copied during the last backward. Updates run at
            ADAMW_IN_STEP of the probe's rate. A CPU run is compute plus an inline update.
            Without clipping (`Workload.clipping` False: train.max_grad_norm null) there is no norm to wait for: a
            unit's update is queued as soon as its gradient is complete in the last group's backward (head, last
            layer, ..., embedding), the worker taking them in that order through the same landing buffers (a
            piece's copy issued ahead only when its gradient is already queued), those copies sharing the bus with
            the backward's weights, and the engine's thread held while DEVICE_GRADS gradients wait on the GPU
            (`_UpdatesInBackward`). The next step's forward waits for the units still being updated when the
            backward ends (the embedding's, queued last, at least): simulated once to find those, then the
            steady-state step with them.
            `optimizer_wait_s`: the step minus the same step with instantaneous updates (what the optimizer costs);
            `optimizer_window_s`: the GPU time it may use unseen (with clipping the first forward wave; without,
            the backward from the first gradient queued). `other_mode`: the same figures with clipping turned
            the other way.
    SSD     with states on the SSD tier (`Workload.disk_states`) every one of them is read before its unit's update and
            written after it: `ssd_time`. The tier's cache holds only a few pieces ahead, so its reads and writes
            overlap only the part of the step the updates overlap (`optimizer_window_s`: the first forward wave with
            clipping, the backward without), one disk doing both: reads at the profile's disk_read_bps, then
            writes at disk_write_bps. When that takes longer than the step, the disk sets the step.
    bound   the CPU optimizer (or the gradients' copy-out) when the forward waited for it past the middle of the
            step (with clipping), or when it made the GPU wait and was busy from the first gradient to the last
            update (without), else the busiest resource.
"""

from __future__ import annotations

from ..runtime.adamw import landing_piece
from ..runtime.optimizer_pipeline import DEVICE_GRADS, update_order
from ..runtime.schedule import ScheduleVisitor, grads_to_host, kept, stashes, step_schedule, walk
from .calibration import (ADAMW_IN_STEP, BLOCKED_ATTENTION_SLOWDOWN, COMPILED_SPEEDUP, FP32_SLOWDOWN,
                          MOE_DEFAULT_SHARE, SATURATED)
from .flops import attention_span, flops_per_token
from .kernel_time import kernel_extra
from .profile import Profile
from .workload import Workload


def blocked_share(adapter, w: Workload) -> float:
    """The share of the layers whose attention runs blocked (Placement.attn_block: plain causal rows longer than the
    block, on the layers that run the flash kernel; models/attention.causal_attention): 0 when none does."""
    if w.device != "cuda" or not 0 < w.placement.attn_block < w.seq_len:
        return 0.0
    kinds = adapter.layer_kinds  # (packed rows: the variable-length kernel's, windowed layers not blocked)
    return sum(adapter.cuda_attention(k, w.seq_len, w.packed)[0] in ("flash", "varlen") and k != "sliding"
               for k in kinds) / len(kinds)


def _use_tokens(w: Workload) -> list[int]:
    """Tokens of each wave group."""
    return [sum(w.micro_batches[m] for m in g) * w.seq_len for g in w.groups]


def executed_flops(adapter, units, w: Workload) -> dict[str, float]:
    """FLOPs per step, as executed, from the step's schedule: per layer parameter and token 2 in a forward or
    rebuild use, 6 in a backward use (recompute + backward); attention 2·T·heads·head_dim per layer and token
    forward (causal), 3x that in backward; 6 per LM-head parameter and target."""
    count = _Flops(adapter, units, w)
    walk(step_schedule(len(units), adapter.tied, w.placement, len(count.toks)), count)
    out = count.out
    targets = sum(w.micro_batches) * (w.seq_len - 1 if w.targets_per_row is None else w.targets_per_row)
    out["head"] = 6.0 * adapter.vocab_size * adapter.hidden_size * targets
    return out


class _Flops(ScheduleVisitor):
    """executed_flops' walk: the layer uses' FLOPs by kind (the head's are counted per target, apart)."""

    def __init__(self, adapter, units, w: Workload):
        self.adapter, self.units, self.w, self.toks = adapter, units, w, _use_tokens(w)
        self.attn_fwd = 2.0 * attention_span(adapter, w.span_len) * adapter.num_heads * adapter.head_dim  # a token's
        self.out = {"forward": 0.0, "rebuild": 0.0, "backward": 0.0}

    def _layer(self, use, per_param: float, attention: int) -> float:
        """per_param FLOPs per active parameter, `attention` times the attention's forward, per token."""
        P, t = self.adapter.active_numel(self.units[use.units[0]]), self.toks[use.group]
        return (per_param * P + attention * self.attn_fwd) * t

    def _none(self, use) -> None:  # the embedding's lookup and scatter-add; the head's FLOPs are counted per target
        pass

    embed = head = embed_backward = _none

    def forward(self, use) -> None:
        self.out["forward"] += self._layer(use, 2.0, 1)

    def rebuild(self, use) -> None:
        self.out["rebuild"] += self._layer(use, 2.0, 1)

    def backward(self, use) -> None:  # with the attention kept from the forward wave, its forward is not rerun
        self.out["backward"] += self._layer(use, 6.0, 2 if stashes(use.layer, self.w.placement, len(self.units) - 2)
                                            else 3)


def step_time(adapter, units, w: Workload, prof: Profile, other_mode: bool = True) -> dict[str, float]:
    """Seconds per step and its parts, throughput, the bound (module docstring); other_mode: the other clipping mode"""
    fl = executed_flops(adapter, units, w)
    total = sum(fl.values())
    tokens = w.tokens_per_step
    f6, fmodel = flops_per_token(adapter, w.span_len)
    micro = max(w.micro_batches)
    rate, how = prof.layer_rate(adapter, micro, w.seq_len, w.compile)
    blocked = blocked_share(adapter, w)
    if blocked and rate is not None:  # the probe ran the fused kernel: time the blocked attention apart
        rate, how = None, "the probed layer ran the attention's fused backward"
    attn_tok = 2.0 * attention_span(adapter, w.span_len) * adapter.num_heads * adapter.head_dim  # a layer's, a token's
    # a layer on FlexAttention or the varlen kernel: what that kernel takes beyond SDPA's, on top of either rate (a
    # probe, like the profile's attention rate, ran SDPA's kernel over plain rows)
    xf, xb = kernel_extra(adapter, w) if w.device == "cuda" else (0.0, 0.0)
    if rate is not None:  # measured on this layer shape: matmuls and attention together
        # measured only in the other compile mode: converted by the compiled/eager ratio of the H200 runs
        mode = 1.0 if rate.compile == w.compile else COMPILED_SPEEDUP if w.compile else 1.0 / COMPILED_SPEEDUP
        if mode != 1.0:
            how += f", {'compiled' if w.compile else 'eager'} taken as x{mode:.2f} that rate"

        def layer_s(P: int, forward: bool, tokens: int, stashed: bool = False) -> float:  # one layer use over
            #                                                                            `tokens` tokens
            if forward:
                return (2.0 * P + attn_tok) * tokens / (rate.forward_flops * mode) + xf * tokens
            if stashed:  # the attention forward not rerun: its share at the forward rate taken off
                return (6.0 * P + 3 * attn_tok) * tokens / (rate.backward_flops * mode) - \
                    attn_tok * tokens / (rate.forward_flops * mode) + (xb - xf) * tokens
            return (6.0 * P + 3 * attn_tok) * tokens / (rate.backward_flops * mode) + xb * tokens
    else:
        speed = COMPILED_SPEEDUP if w.compile else 1.0
        r_mm, r_attn = prof.layer_flops * speed, prof.attention_rate(round(w.span_len)) * speed
        how = ("matmuls at the profile's largest probed layer's rate, attention at its rate for these rows "
               f"({how})" if prof.layer_rates else "default rate") + (" (compiled)" if w.compile else "")
        if blocked:  # the pair loop's cost over SDPA's whole-row kernel (profile.BLOCKED_ATTENTION_SLOWDOWN)
            r_attn /= 1.0 + blocked * (BLOCKED_ATTENTION_SLOWDOWN - 1.0)
            how += (f", the attention blocked for its backward (memory.attn_block) at 1/{BLOCKED_ATTENTION_SLOWDOWN}"
                    " of it (BLOCKED_ATTENTION_SLOWDOWN)")
        if adapter.moe:
            r_mm, r_attn = r_mm * MOE_DEFAULT_SHARE, r_attn * MOE_DEFAULT_SHARE
            how += f", MoE layers at {MOE_DEFAULT_SHARE:.2f} of it (fitted to one run; probe the layer)"

        def layer_s(P: int, forward: bool, tokens: int, stashed: bool = False) -> float:
            if forward:
                return (2.0 * P / r_mm + attn_tok / r_attn + xf) * tokens
            return (6.0 * P / r_mm + (2 if stashed else 3) * attn_tok / r_attn + (xb - xf if stashed else xb)) * tokens
    if xb:
        how += ", FlexAttention's or the varlen kernel's time beyond SDPA's kernel's (KERNEL_RATE, SDPA_RATE)"
    head_s = fl["head"] / prof.head_flops
    if w.precision == "fp32" and w.device == "cuda":  # the engine computes in fp32 (no TF32): every rate above is
        #                                              a bf16 tensor-core rate, not probed in fp32
        bf16_layer_s = layer_s
        how += f"; fp32 compute taken as 1/{FP32_SLOWDOWN:.1f} of it (not probed)"
        head_s *= FP32_SLOWDOWN

        def layer_s(P: int, forward: bool, tokens: int, stashed: bool = False) -> float:
            return bf16_layer_s(P, forward, tokens, stashed) * FP32_SLOWDOWN
    out = {"executed_flops": total, "rate_source": how, "clipping": w.clipping}
    if w.device == "cpu":  # the updates run inline, on the cores that compute, in either mode
        compute = total / (prof.cpu_bf16_flops if w.precision == "bf16" else prof.cpu_flops)
        out["rate_source"] = ("one layer measured here at start" if w.precision in prof.cpu_measured else
                              "the profile's CPU matmul rate") + f", {w.precision}"
        opt = sum(u.numel for u in units) / prof.adamw_params_per_s
        step = compute + opt
        out.update(step_s=step, compute_s=compute, h2d_s=0.0, d2h_s=0.0, optimizer_s=opt,
                   bound="CPU compute" if compute >= opt else "CPU optimizer", optimizer_wait_s=opt,
                   optimizer_window_s=0.0)
    else:
        out.update(_simulate(adapter, units, w, prof, layer_s, head_s, w.clipping))
        if other_mode:  # the other mode, for the report: what turning clipping off (or on) would change
            other = _simulate(adapter, units, w, prof, layer_s, head_s, not w.clipping)
            if w.disk_states:
                ssd_time(other, units, w, prof)
            out["other_mode"] = {k: other[k] for k in ("step_s", "gpu_idle_s", "optimizer_wait_s", "bound")}
    if w.disk_states:
        ssd_time(out, units, w, prof)
    step = out["step_s"]
    out["tokens_per_s"] = tokens / step
    out["executed_tflops"] = total / step / 1e12
    out["tflops_6n"] = f6 * tokens / step / 1e12
    if adapter.moe:  # 6·N_active·tokens besides 6·N_total·tokens
        out["tflops_6n_active"] = 6.0 * sum(adapter.active_numel(u) for u in units) * tokens / step / 1e12
    out["mfu"] = fmodel * tokens / step / prof.peak_bf16 if prof.peak_bf16 and w.device == "cuda" else None
    return out


def ssd_time(out: dict, units, w: Workload, prof: Profile) -> None:
    """Add the SSD tier to a step's figures (`out`, from _simulate or the CPU model), in place: `ssd` (bytes read
    and written per step, the disk's seconds, the bytes per second that would hide it) and, when the disk is
    slower than the rest, the step it sets."""
    from .memory import ssd_traffic

    io = ssd_traffic(units, w)
    disk_s = io["read"] / prof.disk_read_bps + io["written"] / prof.disk_write_bps
    if w.device == "cuda":  # overlaps the updates' window only: the rest of the compute runs with the disk idle
        rest = out["compute_s"] - out["optimizer_window_s"]
        window = max(out["step_s"] - rest, 1e-9)
        paced = disk_s + rest
    else:  # inline updates: the reads ahead and writes behind overlap the CPU AdamW only
        window = max(out["optimizer_s"], 1e-9)
        paced = out["step_s"] - out["optimizer_s"] + max(out["optimizer_s"], disk_s)
    out["ssd"] = {"resident_bytes": io["resident"], "read_bytes": io["read"], "write_bytes": io["written"],
                  "disk_s": disk_s, "hidden_bps": (io["read"] + io["written"]) / window,
                  "read_bps": prof.disk_read_bps, "write_bps": prof.disk_write_bps, "source": prof.disk_source}
    if paced > out["step_s"]:
        out["gpu_idle_s"] = out.get("gpu_idle_s", 0.0) + paced - out["step_s"]
        out["optimizer_wait_s"] = out.get("optimizer_wait_s", 0.0) + paced - out["step_s"]
        out["step_s"], out["bound"] = paced, "SSD (optimizer states)"


def _simulate(adapter, units, w: Workload, prof: Profile, layer_s, head_s: float, clipping: bool) -> dict:
    """One steady-state step (t = 0: the end of the last step's GPU work), and what the optimizer costs it: the
    same step with instantaneous updates gives the GPU's wait for them."""
    n = len(units)
    d2h_rate = prof.bidir_bps
    adam = prof.adamw_params_per_s * ADAMW_IN_STEP
    piece = landing_piece(max(u.numel for u in units))
    free = _walk(adapter, units, w, prof, layer_s, head_s, [0.0] * n, None, clipping)
    if clipping:  # the last step's updates, in forward order, overlap this step's first forward wave
        ready, chain, opt_busy, d2h_busy = _updates_in_forward_order(units, w, piece, d2h_rate, adam)
        step = _walk(adapter, units, w, prof, layer_s, head_s, ready, chain, clipping)
        window = free["first_forward_s"]
        worker = None
    else:  # updates start during this step's backward; the next forward waits for those not done at its end
        first = _UpdatesInBackward(piece, d2h_rate, adam)
        ends = _walk(adapter, units, w, prof, layer_s, head_s, [0.0] * n, None, clipping, first)["gpu_end"]
        worker = _UpdatesInBackward(piece, d2h_rate, adam)
        ready = [max(0.0, first.done[i] - ends) for i in range(n)]
        step = _walk(adapter, units, w, prof, layer_s, head_s, ready, None, clipping, worker)
        opt_busy, d2h_busy = worker.busy, worker.d2h_busy
        window = step["gpu_end"] - worker.first
    d2h_busy += step["side_d2h"]
    total = max(step["gpu_end"], step["side_d2h"])
    shares = {"compute": step["compute"], "H2D (weights)": step["h2d"], "D2H (gradients)": d2h_busy,
              "CPU AdamW": opt_busy}
    bound = max(shares, key=shares.get)
    wait = max(0.0, total - max(free["gpu_end"], free["side_d2h"]))
    if clipping:
        paced, paced_by = step["paced"], step["paced_by"]
        if paced > total - paced:  # the GPU waited for the last step's update until past the middle of the step
            bound = "D2H (gradients)" if paced_by[0] > paced_by[1] else "CPU AdamW"
    elif wait > 0 and worker.busy + worker.copy_wait >= SATURATED * (worker.done[0] - worker.first):
        # the worker never idled from the head's gradient on: its chain, not the GPU, ends the step
        bound = "D2H (gradients)" if worker.copy_wait > worker.busy else "CPU AdamW"
    bound_name = {"compute": "GPU compute", "H2D (weights)": "PCIe (weights in)", "D2H (gradients)":
                  "PCIe (gradients out)", "CPU AdamW": "CPU optimizer"}[bound]
    return {"step_s": total, "compute_s": step["compute"], "h2d_s": step["h2d"], "d2h_s": d2h_busy,
            "optimizer_s": opt_busy, "gpu_idle_s": total - step["compute"], "bound": bound_name,
            "optimizer_wait_s": wait, "optimizer_window_s": window}


def _updates_in_forward_order(units, w: Workload, piece: int, d2h_rate: float, adam: float):
    """A clipped step's updates (OptimizerPipeline.finish_step), in forward order, piece by piece: when each unit is
    ready, the (copy-out, AdamW) seconds spent until then, and the worker's AdamW and copy seconds."""
    n = len(units)
    to_host = set(grads_to_host(n, w.placement))
    ready = [0.0] * n
    chain = [(0.0, 0.0)] * n  # (copy-out, AdamW) seconds spent until unit i is ready
    d2h_end, upd_end, prev_upd_end = 0.0, 0.0, 0.0
    d2h_busy = opt_busy = copied = 0.0
    for i in update_order(n):
        numel = units[i].numel
        for a in range(0, numel, piece):
            k = min(piece, numel - a)
            start = max(d2h_end, prev_upd_end)  # issued when the update before last has freed its buffer
            copy = 0.0 if i in to_host else 4.0 * k / d2h_rate  # sent to host during the last backward
            d2h_busy += copy
            d2h_end = start + copy
            copied += copy
            prev_upd_end = upd_end
            upd_end = max(upd_end, d2h_end) + k / adam
            opt_busy += k / adam
        ready[i] = upd_end
        chain[i] = (copied, opt_busy)
    return ready, chain, opt_busy, d2h_busy


class _UpdatesInBackward:
    """The OptimizerPipeline's worker without clipping, in time: units queued as their gradients are complete (`put`),
    piece by piece through the landing buffers; a piece's copy issued when the worker begins the piece before if it
    is queued by then, else once it is; the engine's `put` held until the gradient DEVICE_GRADS before it landed."""

    def __init__(self, piece: int, d2h_rate: float, adam: float):
        self.piece, self.d2h_rate, self.adam = piece, d2h_rate, adam
        self.began = self.ended = self.d2h_end = 0.0  # the worker's last piece: began handling it, update ended
        self.landed: list[float] = []  # when each gradient held on the device left it, in put order
        self.done: dict[int, float] = {}  # unit -> its update written
        self.first: float | None = None  # the first gradient queued
        self.busy = self.d2h_busy = self.copy_wait = 0.0

    def put(self, unit: int, numel: int, at: float, host_copy_s: float | None) -> float:
        """The unit's gradient is complete at `at` (host_copy_s: the seconds of its copy to host, for a unit sent
        there). Returns when the engine's put returns: no compute is queued before then."""
        held = host_copy_s is None
        gate = self.landed[-DEVICE_GRADS] if held and len(self.landed) >= DEVICE_GRADS else 0.0
        queued = max(at, gate)
        self.first = queued if self.first is None else self.first
        landed = queued
        for a in range(0, numel, self.piece):
            k = min(self.piece, numel - a)
            issue = self.began if queued <= self.began else max(self.ended, queued)
            if held:
                copy = 4.0 * k / self.d2h_rate
                copied = max(issue, self.d2h_end) + copy
                self.d2h_end = copied
                self.d2h_busy += copy
            else:
                copied = at + host_copy_s
            began = max(self.ended, issue)
            landed = max(began, copied)
            self.copy_wait += landed - began
            self.began, self.ended = began, landed + k / self.adam
            self.busy += k / self.adam
        if held:
            self.landed.append(landed)
        self.done[unit] = self.ended
        return gate


def _walk(adapter, units, w: Workload, prof: Profile, layer_s, head_s: float, ready: list[float], chain,
          clipping: bool, worker: _UpdatesInBackward | None = None) -> dict:
    """The step's uses, as the engine executes them (t = 0: the last step's end); the slot ring advances on uses
    that stream weights. ready: when each unit's last update is written (its forward in the first group waits).
    chain: the (copy-out, AdamW) seconds behind each ready time (clipping), to name the bound. worker: without
    clipping, the updates this step queues as its gradients are complete."""
    times = _StepTimes(adapter, units, w, prof, layer_s, head_s, ready, chain, clipping, worker)
    walk(step_schedule(len(units), adapter.tied, w.placement, len(times.toks)), times)
    return {"gpu_end": times.comp_end[-1], "compute": times.comp_busy, "h2d": times.h2d_busy,
            "side_d2h": times.side_d2h, "paced": times.paced, "paced_by": times.paced_by,
            "first_forward_s": times.first_forward}


class _StepTimes(ScheduleVisitor):
    """_walk's visitor: per use, `enter` queues its weights (and a spilled input fetched ahead) on the H2D stream,
    the kind's method what else it brings in and its compute seconds (`dt`), `leave` places both on the timeline
    with the copies out that overlap the compute."""

    def __init__(self, adapter, units, w: Workload, prof: Profile, layer_s, head_s: float, ready: list[float], chain,
                 clipping: bool, worker: _UpdatesInBackward | None):
        self.adapter, self.units, self.w, self.prof = adapter, units, w, prof
        self.layer_s, self.head_s, self.ready, self.chain = layer_s, head_s, ready, chain
        self.clipping, self.worker = clipping, worker
        self.toks, self.d2h_rate = _use_tokens(w), prof.bidir_bps
        self.parks = len(self.toks) > 1 and w.placement.group_grads == "host"
        self.comp_end, self.ring = [], []  # compute end of every use; of each weight use, in ring order
        self.holds: list[tuple[int, ...] | None] = [None] * w.num_slots
        self.h2d_end = self.h2d_busy = self.comp_busy = self.side_d2h = self.first_forward = 0.0
        self.paced, self.paced_by = 0.0, (0.0, 0.0)  # the GPU's last resume after waiting for an update; its chain
        self.back_early: set = set()  # (group, layer) of spilled inputs already on their way back
        self.host = 0.0  # the engine's thread, held by a put (no clipping): nothing is queued before

    def enter(self, use) -> None:
        w, ready, ring = self.w, self.ready, self.ring
        self.C = C = self.toks[use.group] * self.adapter.hidden_size * w.elem  # one layer boundary of the group
        first = use.group == 0
        self.waits = max(use.units, key=lambda i: ready[i]) if use.forward and first else None  # wait_for_update
        self.t_in, self.fetched = 0.0, False  # bytes-time on the H2D stream for this use; weights copied
        if use.units:
            slot = len(ring) % w.num_slots
            free = ring[len(ring) - w.num_slots] if len(ring) >= w.num_slots else 0.0
            self.fetched = self.holds[slot] != use.units  # the engine skips the copy when the slot holds these
            # the bus is shared with the gradients' copy-out: in the first forward (clipping), in the last
            # group's backward (no clipping)
            shared = (use.forward and first) if self.clipping else (use.group == len(self.toks) - 1 and not use.forward)
            rate = self.d2h_rate if shared else self.prof.h2d_bps
            if self.fetched:
                self.t_in += sum(self.units[i].numel for i in use.units) * w.stream_elem / rate
            self.holds[slot] = use.units
        else:
            free = 0.0
        if use.fetch is not None:
            self.t_in += C / self.prof.h2d_bps  # the next block's spilled input, behind these weights
        self.others = max(self.h2d_end, free)

    def _spilled_at_use(self, use) -> None:  # a spilled input not fetched ahead (the top block's): loaded at its use
        if kept(use.layer, self.w.placement, len(self.units) - 2) == "host" and \
                (use.group, use.layer) not in self.back_early:
            self.t_in += self.C / self.prof.h2d_bps
            self.back_early.add((use.group, use.layer))

    def _back_from_host(self, use, units: tuple[int, ...]) -> None:  # parked accumulators, one use ahead
        if self.parks and use.group > 0:
            self.t_in += sum(4.0 * self.units[i].numel for i in units) / self.prof.h2d_bps

    def embed(self, use) -> None:
        self.dt = 0.0  # the lookup

    def forward(self, use) -> None:
        self.dt = self.layer_s(self.adapter.active_numel(self.units[use.units[0]]), True, self.toks[use.group], False)

    def head(self, use) -> None:
        self._back_from_host(use, use.units)
        self.dt = self.head_s * self.toks[use.group] / sum(self.toks)

    def rebuild(self, use) -> None:
        self._spilled_at_use(use)
        self.dt = self.layer_s(self.adapter.active_numel(self.units[use.units[0]]), True, self.toks[use.group], False)

    def backward(self, use) -> None:
        self._spilled_at_use(use)
        self._back_from_host(use, use.units)
        self.dt = self.layer_s(self.adapter.active_numel(self.units[use.units[0]]), False, self.toks[use.group],
                               stashes(use.layer, self.w.placement, len(self.units) - 2))

    def embed_backward(self, use) -> None:
        if self.adapter.tied:
            self._back_from_host(use, (0,))
        self.dt = 0.0

    def leave(self, use) -> None:
        t_in, dt, waits, ready = self.t_in, self.dt, self.waits, self.ready
        if use.fetch is not None:
            self.back_early.add((use.group, use.fetch))
        if t_in:
            start = max(self.others, ready[waits] if waits is not None else 0.0)
            self.h2d_end = start + t_in
            self.h2d_busy += t_in
        # copies out that overlap the compute: spilled inputs, finished gradients to host, parked accumulators
        if use.keep == "host":
            self.side_d2h += self.C / self.d2h_rate
        out_s = 4.0 * self.units[use.grad_unit].numel / self.d2h_rate if use.grad in ("host", "group-host") else 0.0
        self.side_d2h += out_s
        prev = self.comp_end[-1] if self.comp_end else 0.0
        begin = max(prev, self.h2d_end if t_in else 0.0, self.host)
        if self.chain is not None and waits is not None and self.fetched and ready[waits] > self.others and \
                begin > prev:
            self.paced, self.paced_by = begin, self.chain[waits]
        self.comp_end.append(begin + dt)
        if use.units:
            self.ring.append(begin + dt)
        self.comp_busy += dt
        if use.forward and use.group == 0:
            self.first_forward += dt
        if self.worker is not None and use.grad in ("gpu", "host"):  # complete: its update is queued now
            unit = use.grad_unit
            self.host = max(self.host, self.worker.put(unit, self.units[unit].numel, begin + dt,
                                                       out_s if use.grad == "host" else None))
