"""Per-step measurements for the metrics record, and the run's start summary.

`StepStats` brackets each step with markers on the runtime's Timeline (CUDA) and, when the metrics logger asks,
returns the step's TFLOP/s, MFU (model FLOPs incl. attention over the profile's bf16 peak), GPU and host memory
and the busy shares of the compute, H2D and D2H streams.
"""

from __future__ import annotations

import torch

from ..planner.flops import active_params, flops_per_token
from ..planner.precision import precision_line
from ..planner.report import ssd_lines
from ..planner.sysmem import rss_bytes

GiB = 2**30
IDLE_GAPS = 3  # the longest idle stretches of the compute stream recorded per step (GPU runs)


class StepStats:
    def __init__(self, adapter, seq_len: int, timeline, peak_flops: float | None):
        """timeline: the runtime's (None on CPU, or when streams are not measured)."""
        self.adapter, self.seq_len = adapter, seq_len
        self.fpt6, self.fpt_model = flops_per_token(adapter, seq_len)
        self.fpt6_active = 6.0 * active_params(adapter) if adapter.moe else None  # MoE: 6·N_active per token
        self.peak = peak_flops
        self.timeline = timeline
        self.cuda = timeline is not None
        self._window = None

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._window = [self.timeline.marker(), None]

    def end(self) -> None:
        """Right after the step's GPU work has been queued."""
        if self.cuda and self._window:
            self._window[1] = self.timeline.marker()

    def __call__(self, record: dict) -> dict:
        out = {}
        tokens, dt = record.get("tokens"), record.get("step_time_s")
        fpt_model = self.fpt_model  # attention over the step's documents (packed) or rows, where the step says
        if record.get("attn_len") and record["attn_len"] != self.seq_len:
            fpt_model = flops_per_token(self.adapter, record["attn_len"])[1]
        if tokens and dt:
            out["tflops_6n"] = self.fpt6 * tokens / dt / 1e12
            if self.fpt6_active:
                out["tflops_6n_active"] = self.fpt6_active * tokens / dt / 1e12
            out["tflops_attn"] = fpt_model * tokens / dt / 1e12
            if self.peak and self.cuda:
                out["mfu"] = fpt_model * tokens / dt / self.peak
        out["host_rss_gib"] = rss_bytes() / GiB
        if self.cuda:
            out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            out["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            # page-locked host memory held by torch's own caching host allocator (pin_memory(), non_blocking
            # copies to host): outside megatrain's PinnedHost and the planner's books
            out["host_pinned_cache_gib"] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) / GiB
            if self._window and self._window[1] is not None:
                shares = self.timeline.shares(*self._window, gaps=IDLE_GAPS)
                out.update(busy_compute=shares.get("compute", 0.0), busy_h2d=shares.get("h2d", 0.0),
                           busy_d2h=shares.get("d2h", 0.0))
                # where the GPU waited: the step's longest idle stretches of the compute stream, each with the
                # work it followed and the work it waited for (metrics.jsonl only: not a scalar)
                out["idle_gaps"] = [{"ms": round(g["ms"], 1), "after": g["after"], "before": g["before"]}
                                    for g in shares.get("gaps", [])]
            self._window = None
        return out


# ---- start summary -----------------------------------------------------------------------------------------------
def attach(run, log) -> StepStats:
    """Set the run's per-step stats on the logger, start wandb when asked, and print the start summary."""
    plan = run.plan
    peak = None
    if run.engine.device.type == "cuda":
        from ..planner.profile import peak_bf16_for

        measured = plan.profile.peak_bf16 if plan is not None and plan.profile.measured else None
        peak = measured or peak_bf16_for(torch.cuda.get_device_name(run.engine.device))
    stats = StepStats(run.adapter, run.cfg.data.max_seq_len, run.runtime.timeline,
                      peak * run.world_size if peak else None)  # MFU of the world's tokens over its GPUs
    log.stats = stats
    log.disk = run.store.disk  # the SSD tier's bytes and rates per step (None: no states on disk)
    if run.cfg.output.wandb:
        log.enable_wandb(run.cfg.model_dump())
    log.info(start_summary(run))
    return stats


def start_summary(run) -> str:
    cfg, plan = run.cfg, run.plan
    t = cfg.train
    pairs = getattr(run, "preference", False)  # micro_batch_size counts pairs: two rows each
    rows = t.micro_batch_size * (2 if pairs else 1)
    tokens = rows * t.grad_accum_steps * cfg.data.max_seq_len
    what = f"{t.micro_batch_size} pairs ({rows} rows)" if pairs else f"{rows} rows"
    lines = [f"tokens per step: up to {tokens:,} ({t.grad_accum_steps} micro-batch"
             f"{'es' if t.grad_accum_steps > 1 else ''} of {what} x {cfg.data.max_seq_len} tokens)"]
    if run.world_size > 1:
        w = run.ranks.world
        lines = [f"global batch: up to {tokens * w.size:,} tokens per step over {w.layout()}, each rank up to "
                 f"{tokens:,} ({t.grad_accum_steps} x {what} x {cfg.data.max_seq_len} tokens: "
                 f"train.micro_batch_size and grad_accum_steps are per rank); one host store per node, each rank's "
                 f"CPU AdamW updates its shard with {run.ranks.threads} thread(s)"]
    lines.append(plan.precision_why if plan is not None and plan.precision_why else
                 precision_line(t.precision, run.engine.device.type))  # which precision, and why
    lines.append(optimizer_summary(cfg, plan))
    if plan is None:
        lines.append("plan: not available")
        return "\n".join(lines)
    tm = plan.time
    gpu = (f"; GPU peak {plan.gpu_peak / GiB:.1f} GiB allocated ({plan.gpu_needed / GiB:.1f} GiB needed of "
           f"{plan.gpu_limit / GiB:.1f})" if plan.workload.device == "cuda" and plan.gpu_limit else "")
    avail = f" of {plan.host_available / GiB:.1f} GiB available" if plan.host_available else ""
    mfu = f", MFU {tm['mfu'] * 100:.1f}%" if tm.get("mfu") else ""
    src = "measured profile" if plan.profile.measured else "default H200 profile" + (
        plan.profile.source[len("defaults"):] if plan.profile.source.startswith("defaults,") else "")
    lines.append(f"plan: host RAM {plan.host_total / GiB:.1f} GiB{avail}{gpu}; predicted {tm['step_s']:.2f} s/step, "
                 f"{tm['tokens_per_s']:,.0f} tokens/s, {tm['tflops_6n']:.3g} TFLOP/s (6N){mfu}, bound by "
                 f"{tm['bound']} ({src})")
    if plan.workload.device == "cuda":
        lines.append(f"placement: {plan.placement_keys} ({plan.why})")
    lines += ssd_lines(plan)  # the SSD tier: what it holds, what moves per step, at which disk rates (and whence)
    return "\n".join(lines)


def optimizer_summary(cfg, plan) -> str:
    """The optimizer's mode, and the plan's figure for what it costs the step."""
    t = cfg.train
    if t.clipping:
        line = (f"optimizer: AdamW, gradient clipping at global norm {t.max_grad_norm}: the updates wait for the "
                f"step's norm and overlap the next step's forward")
    else:
        line = ("optimizer: AdamW, gradient clipping off (train.max_grad_norm: null): each unit's update starts as "
                "soon as its gradient is complete, during backward; the grad norm is still computed and logged")
    if plan is not None and plan.workload.device == "cuda":
        line += f" (plan: the GPU waits {plan.time['optimizer_wait_s']:.2f} s a step for it)"
    return line
