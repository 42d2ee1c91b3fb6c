"""The plan as text: the report `megatrain plan` prints (`render`) and the error `megatrain train` gives when the
run will not fit (`refusal`).

The report has one section per resource, in the order a reader checks them: host RAM by component (memory.py)
against what is available, the GPU's components at its peak phase and what the allocator and the CUDA context add,
disk per checkpoint, the predicted step time with its parts and bound (timing.py), the optimizer's mode (clipping
or not), the share of the step it may use and what it costs, with the other mode's figures beside it, the notes on
where the figures come from, and, when the run does not fit, the problems and what would fit (suggest.py). Nothing
is computed here: every figure is a field of the Plan (estimate.py).
"""

from __future__ import annotations

from .estimate import Plan
from .io_time import io_lines
from .objective import objective_lines
from .rollout_plan import rollout_lines
from .profile import GiB


def _g(x: float) -> str:
    """GiB, with more decimals for small amounts (tiny models)."""
    return f"{x / GiB:8.2f}" if x >= 0.1 * GiB or x == 0 else f"{x / GiB:8.4f}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _flops(x: float) -> str:
    return f"{x / 1e12:.0f} TFLOP/s" if x >= 1e13 else f"{x / 1e12:.3g} TFLOP/s"


def render(p: Plan) -> str:
    """The report `megatrain plan` prints (plan.plan_command)."""
    w, t = p.workload, p.time
    streamed = "fp32 master streamed, cast to bf16" if w.fp32_stream else f"{w.precision} streaming"
    moe = f" ({_count(p.active_params)} active per token)" if p.active_params != p.params else ""
    lines = [f"megatrain plan: {p.model}, {_count(p.params)} parameters{moe}, {streamed} on {w.device}"
             f"{' (compiled layers)' if w.compile else ''}, gradient clipping {'on' if w.clipping else 'off'}",
             f"  step: {w.describe()}"]
    src = p.profile.source
    lines.append(f"  machine profile: {src}" + (f" (measured {p.profile.created} on {p.profile.host})"
                                                if p.profile.measured else ""))
    if p.precision_why:
        lines.append(f"  {p.precision_why}")
    if w.device == "cuda":
        lines.append(f"  placement: {p.placement_keys}")
        lines.append(f"    ({p.why})")
    lines.append("")
    lines.append(f"{'host RAM':<58}{'GiB':>8}")
    for k, v in p.host.items():
        lines.append(f"  {k:<56}{_g(v)}")
    avail = (f"   of {p.host_available / GiB:.2f} available ({p.host_source})" if p.host_available is not None else "")
    lines.append(f"  {'total':<56}{_g(p.host_total)}{avail}")
    lines.append(f"  {'per parameter':<56}{p.host_total / p.params:8.2f} B")
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
    lines += ssd_lines(p) + io_lines(p.io)
    lines.append("")
    lines.append(f"step time (predicted): {t['step_s']:.2f} s, bound by {t['bound']}")
    if w.device == "cuda":
        lines.append(f"  compute {t['compute_s']:.2f} s ({t['rate_source']}), H2D weights {t['h2d_s']:.2f} s, "
                     f"D2H gradients {t['d2h_s']:.2f} s, CPU AdamW {t['optimizer_s']:.2f} s; GPU idle "
                     f"{t['gpu_idle_s']:.2f} s")
    lines += _optimizer_lines(w, t)
    mfu = f", MFU {t['mfu'] * 100:.1f}%" if t.get("mfu") else ""
    active = f", {_flops(t['tflops_6n_active'] * 1e12)} (6·N_active)" if "tflops_6n_active" in t else ""
    lines.append(f"  {t['tokens_per_s']:,.0f} tokens/s, {_flops(t['executed_tflops'] * 1e12)} executed, "
                 f"{_flops(t['tflops_6n'] * 1e12)} (6N){active}{mfu}")
    lines += render_world(p)
    lines += objective_lines(p)
    lines += rollout_lines(p)
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


def ssd_lines(p: Plan) -> list[str]:
    """The SSD tier (memory.disk_path): what lives there, what moves each step, and whether the step hides it."""
    ssd, w = p.ssd, p.workload
    if not ssd:
        return [f"SSD tier: none (memory.disk_path {p.disk_path}: host RAM holds every state)"] if p.disk_path else []
    names = {"v": "Adam v", "m": "Adam m", "master": "fp32 master"}
    free = f"; {p.ssd_free / GiB:.0f} GiB free there" if p.ssd_free is not None else ""
    return [f"SSD tier ({p.disk_path or 'memory.disk_path'}): {', '.join(names[k] for k in w.disk_states)} "
            f"({4 * len(w.disk_states)} B/param), {ssd['resident_bytes'] / GiB:.1f} GiB resident{free}",
            f"  per step: read {ssd['read_bytes'] / GiB:.1f} GiB + write {ssd['write_bytes'] / GiB:.1f} GiB = "
            f"{ssd['disk_s']:.1f} s at {ssd['read_bps'] / 1e9:.2f} GB/s read, {ssd['write_bps'] / 1e9:.2f} GB/s "
            f"write ({ssd.get('source', 'plan.profile')}); hiding it behind the step needs "
            f"{ssd['hidden_bps'] / 1e9:.2f} GB/s read+write"]


def _optimizer_lines(w, t: dict) -> list[str]:
    """The optimizer's mode, the share of the step it may use unseen, and what it costs (timing.py)."""
    if w.device != "cuda":
        mode = "clipping on" if w.clipping else "no clipping (train.max_grad_norm: null)"
        return [f"  optimizer: {mode}; CPU AdamW {t['optimizer_s']:.2f} s, inline after each step's backward"]
    if w.clipping:
        how = (f"clipping on (train.max_grad_norm): CPU AdamW {t['optimizer_s']:.2f} s waits for the step's global "
               f"norm, then runs in forward order within the next step's first forward wave "
               f"({t['optimizer_window_s']:.2f} s of compute), which waits for each unit's update")
        other = "without clipping (train.max_grad_norm: null)"
    else:
        how = (f"no clipping (train.max_grad_norm: null): CPU AdamW {t['optimizer_s']:.2f} s starts as each unit's "
               f"gradient is complete, in backward order, within {t['optimizer_window_s']:.2f} s of backward; the "
               f"next forward waits for the units not yet updated")
        other = "with clipping"
    o = t["other_mode"]
    return [f"  optimizer: {how}; the GPU waits {t['optimizer_wait_s']:.2f} s for it",
            f"  {other}: {o['step_s']:.2f} s a step, GPU idle {o['gpu_idle_s']:.2f} s, waiting "
            f"{o['optimizer_wait_s']:.2f} s for the optimizer, bound by {o['bound']}"]


def render_world(p: Plan) -> list[str]:
    """Several ranks: the global batch, the node's share of the host figures above, the network (world.py)."""
    wd = p.world
    if wd.size == 1:
        return []
    c, t, w = p.comm, p.time, p.workload
    return ["", f"world: {wd.describe()} ranks; {w.tokens_per_step:,} tokens per rank, "
                f"{w.tokens_per_step * wd.size:,} per step in all (train.micro_batch_size and grad_accum_steps are "
                f"per rank)",
            f"  host RAM above is per node: one host store shared by its {wd.ranks_per_node} ranks, the rest per "
            f"rank; GPU memory is per rank",
            f"  gradients per rank and step: reduce-scatter within the node {c['intra_node_bytes_per_rank'] / GiB:.2f}"
            f" GiB, all-reduce across nodes {c['inter_node_bytes_per_rank'] / GiB:.2f} GiB "
            f"({c['inter_node_bytes_per_node'] / GiB:.2f} GiB per node); {c['comm_s']:.2f} s on the links, "
            f"{t['exposed_comm_s']:.2f} s beyond the backward",
            f"  one rank's step {t['rank_step_s']:.2f} s + {t['exposed_comm_s']:.2f} s = {t['step_s']:.2f} s"]


def refusal(plan: Plan) -> str:
    """The one error line `megatrain train` gives when the plan says the run cannot fit."""
    fit = f"; what would fit: {'; '.join(plan.suggestions)}" if plan.suggestions else ""
    return (f"the run will not fit: {'; '.join(plan.problems)}{fit} (`megatrain plan` with the same arguments shows "
            f"the whole plan; plan.check=false runs it anyway)")
