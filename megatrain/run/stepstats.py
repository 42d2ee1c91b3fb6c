"""Per-step measurements for the metrics record, and out-of-memory errors turned into one readable message.

`StepStats` brackets each step with Timeline markers (CUDA) and, when the metrics logger asks, returns the
step's MFU (model FLOPs incl. attention over the profile's bf16 peak), GPU and host memory and
the busy shares of the compute, H2D and D2H streams.
"""

from __future__ import annotations

import traceback

import torch

from ..planner.flops import flops_per_token

GiB = 2**30


class StepStats:
    def __init__(self, adapter, seq_len: int, engine, pipeline, peak_flops: float | None):
        self.fpt6, self.fpt_model = flops_per_token(adapter, seq_len)
        self.peak = peak_flops
        self.cuda = engine.device.type == "cuda"
        self.timeline = None
        self._window = None
        if self.cuda:
            from ..runtime.timeline import Timeline

            self.timeline = Timeline()
            engine.timeline = pipeline.timeline = self.timeline

    def begin(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._window = [self.timeline.marker(), None]

    def end(self) -> None:
        """Right after the step's GPU work has been queued."""
        if self.cuda and self._window:
            self._window[1] = self.timeline.marker()

    def __call__(self, record: dict) -> dict:
        from ..planner.sysmem import rss_bytes

        out = {}
        tokens, dt = record.get("tokens"), record.get("step_time_s")
        if tokens and dt:
            if "tflops_6n" not in record:
                out["tflops_6n"] = self.fpt6 * tokens / dt / 1e12
            if self.peak and self.cuda:
                out["mfu"] = self.fpt_model * tokens / dt / self.peak
        out["host_rss_gib"] = rss_bytes() / GiB
        if self.cuda:
            out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
            out["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
            if self._window and self._window[1] is not None:
                shares = self.timeline.shares(*self._window)
                out.update(busy_compute=shares.get("compute", 0.0), busy_h2d=shares.get("h2d", 0.0),
                           busy_d2h=shares.get("d2h", 0.0))
            self._window = None
        return out


# ---- start summary -----------------------------------------------------------------------------------------------
def attach(run, log) -> None:
    """Set the run's per-step stats on the logger, start wandb when asked, and print the start summary."""
    plan = run.plan
    peak = None
    if run.engine.device.type == "cuda":
        from ..planner.profile import peak_bf16_for

        measured = plan.profile.peak_bf16 if plan is not None and plan.profile.measured else None
        peak = measured or peak_bf16_for(torch.cuda.get_device_name(run.engine.device))
    run.stats = StepStats(run.adapter, run.cfg.data.max_seq_len, run.engine, run.pipeline, peak)
    log.stats = run.stats
    if getattr(run.cfg.output, "wandb", False):
        log.enable_wandb(run.cfg.model_dump())
    log.info(start_summary(run))


def start_summary(run) -> str:
    cfg, plan = run.cfg, run.plan
    t = cfg.train
    tokens = t.micro_batch_size * t.grad_accum_steps * cfg.data.max_seq_len
    lines = [f"tokens per step: up to {tokens:,} ({t.grad_accum_steps} micro-batch"
             f"{'es' if t.grad_accum_steps > 1 else ''} of {t.micro_batch_size} rows x {cfg.data.max_seq_len} tokens)"]
    if plan is None:
        lines.append("plan: not available")
        return "\n".join(lines)
    tm = plan.time
    gpu = (f"; GPU peak {plan.gpu_peak / GiB:.1f} GiB allocated ({plan.gpu_needed / GiB:.1f} GiB needed of "
           f"{plan.gpu_limit / GiB:.1f})" if plan.workload.device == "cuda" and plan.gpu_limit else "")
    avail = f" of {plan.host_available / GiB:.1f} GiB available" if plan.host_available else ""
    mfu = f", MFU {tm['mfu'] * 100:.1f}%" if tm.get("mfu") else ""
    src = "measured profile" if plan.profile.measured else "default H200 profile"
    lines.append(f"plan: host RAM {plan.host_total / GiB:.1f} GiB{avail}{gpu}; predicted {tm['step_s']:.2f} s/step, "
                 f"{tm['tokens_per_s']:,.0f} tokens/s, {tm['tflops_6n']:.3g} TFLOP/s (6N){mfu}, bound by "
                 f"{tm['bound']} ({src})")
    return "\n".join(lines)


# ---- out of memory ---------------------------------------------------------------------------------------------
# (file, function) of the innermost megatrain frame -> the plan component being allocated ("*": any function)
GPU_COMPONENTS = [
    (("engine.py", "_layer_backward"), "layer activations (recompute + backward of one micro-batch)"),
    (("engine.py", "_head_loss"), "the LM head chunk + loss"),
    (("engine.py", "_grad_buffer"), "fp32 gradient accumulators"),
    (("engine.py", "_emit"), "fp32 gradient accumulators"),
    (("decoder.py", "make_context"), "rope tables, token ids, masks"),
    (("engine.py", "to"), "the micro-batch transfer"),
    (("engine.py", "__init__"), "the weight slots"),
    (("engine.py", "_fetch"), "the weight slots"),
    (("engine.py", "train_step"), None),  # which part of the step: from the source line
]
STEP_LINES = [("_head_loss", "the LM head chunk + loss"),
              ("_layer_backward", "layer activations (recompute + backward of one micro-batch)"),
              ("index_add_", "the embedding backward"), ("self.layer(", "layer activations of the forward wave, next "
              "to the layer-boundary checkpoints"), ("layer_forward", "layer activations of the forward wave, next to "
              "the layer-boundary checkpoints"), ("F.embedding", "the embedding output")]
HOST_COMPONENTS = [
    (("store.py", "*"), "host store (fp32 master, Adam m and v, streaming copy)"),
    (("offload.py", "__init__"), "gradient landing buffers"),
    (("offload.py", "*"), "CPU optimizer"),
    (("optim.py", "*"), "CPU optimizer"),
]


def _innermost(exc: BaseException, names) -> str | None:
    import os

    chain, e = [], exc
    while e is not None:  # the optimizer thread's error is the cause of the one the trainer sees
        chain.append(e)
        e = e.__cause__
    for e in reversed(chain):  # deepest first
        for f in reversed(traceback.extract_tb(e.__traceback__)):
            if "megatrain" not in f.filename:
                continue
            base = os.path.basename(f.filename)
            for (fname, func), label in names:
                if base == fname and func in ("*", f.name):
                    if label is None:
                        line = f.line or ""
                        return next((text for key, text in STEP_LINES if key in line),
                                    "layer-boundary checkpoints and d(hidden) buffers")
                    return label
    return None


def is_host_allocation_failure(exc: BaseException) -> bool:
    e: BaseException | None = exc
    while e is not None:
        if isinstance(e, MemoryError):
            return True
        text = str(e)
        if isinstance(e, RuntimeError) and not isinstance(e, torch.OutOfMemoryError) and (
                "can't allocate memory" in text or "Cannot allocate memory" in text or "not enough memory" in text):
            return True
        e = e.__cause__
    return False


def oom_message(exc: BaseException, plan, adapter, step: int | None, host: bool = False) -> str:
    """One message: what ran out, in which component, what the plan expected, and what would fit."""
    where = f" at step {step}" if step is not None else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if host:
        comp = _innermost(exc, HOST_COMPONENTS) or "host allocation"
        lines = [f"host RAM ran out{where}, allocating the {comp}: {first}"]
        if plan is not None:
            lines.append(f"the plan expected {plan.host_total / GiB:.1f} GiB of host RAM, "
                         f"{plan.host_available / GiB:.1f} GiB available ({plan.host_source}); other processes "
                         f"may have taken memory since")
    else:
        comp = _innermost(exc, GPU_COMPONENTS) or "GPU allocation"
        lines = [f"GPU out of memory{where}, allocating {comp}: {first[:300]}"]
        if plan is not None and plan.gpu_limit:
            lines.append(f"the plan expected a peak of {plan.gpu_needed / GiB:.1f} GiB ({plan.gpu_peak_phase}) of "
                         f"{plan.gpu_limit / GiB:.1f} GiB; other processes on the GPU, or rows longer than planned, "
                         f"take the rest")
    if plan is not None and adapter is not None:
        from ..planner.plan import suggestions

        target = 0.8 * plan.gpu_needed if not host and plan.gpu_needed else None
        try:
            tips = suggestions(adapter, plan, gpu_target=target)
        except Exception:  # a suggestion is a courtesy: never hide the error behind another
            tips = []
        if tips:
            lines.append("would leave room:" if not host else "what would fit:")
            lines += [f"  {t}" for t in tips]
    return "\n".join(lines)
