"""Out-of-memory errors turned into one readable message: what ran out, what was being allocated, what the plan
expected, and what would fit.

GPU: the component comes from the phase the engine recorded (`Engine.phase`) when the allocation failed. Host:
from what the run was building (`host_allocation`), or the optimizer thread when its update failed.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..errors import MegatrainError
from ..runtime import OptimizerThreadError, Phase

GiB = 2**30

# Engine.phase.what -> the planner's component being allocated
GPU_COMPONENTS = {
    "weights": "the weight slots",
    "inputs": "the micro-batch transfer, rope tables, token ids, masks",
    "forward": "layer activations of the forward wave, next to the layer-boundary checkpoints",
    "head": "the LM head chunk + loss",
    "gradients": "fp32 gradient accumulators",
    "backward": "layer activations (recompute + backward of one micro-batch)",
    "embedding backward": "the embedding backward",
}


def describe_phase(phase: Phase) -> str:
    where = [f"layer {phase.layer}"] if phase.layer is not None else []
    where += [f"micro-batch {phase.micro + 1}"] if phase.micro is not None else []
    return f"{phase.what}" + (f" ({', '.join(where)})" if where else "")


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


@contextmanager
def host_allocation(component: str, plan, adapter):
    """Around a large host allocation outside the step (the store, the runtime's pinned buffers): a failure to
    allocate becomes one message naming `component`; other errors pass unchanged."""
    try:
        yield
    except (RuntimeError, MemoryError) as e:
        if is_host_allocation_failure(e):
            raise MegatrainError(oom_message(e, plan, adapter, step=None, component=component)) from None
        raise


def raise_if_out_of_memory(e: BaseException, *, phase: Phase | None, plan, adapter, step: int) -> None:
    """Inside a step: a GPU out-of-memory error, or a host allocation failure (the optimizer thread's included),
    becomes a MegatrainError with one message; anything else is left for the caller to re-raise."""
    if isinstance(e, torch.OutOfMemoryError):
        comp = GPU_COMPONENTS.get(phase.what, "GPU allocation") if phase is not None else "GPU allocation"
        raise MegatrainError(oom_message(e, plan, adapter, step, component=comp, gpu=True)) from None
    if is_host_allocation_failure(e):
        comp = "CPU optimizer (its update of a unit)" if isinstance(e, OptimizerThreadError) else "host allocation"
        raise MegatrainError(oom_message(e, plan, adapter, step, component=comp)) from None


def oom_message(exc: BaseException, plan, adapter, step: int | None, *, component: str, gpu: bool = False) -> str:
    """One message: what ran out, in which component, what the plan expected, and what would fit."""
    where = f" at step {step}" if step is not None else ""
    root = exc
    while root.__cause__ is not None:  # the optimizer thread's error is the cause of the one the trainer sees
        root = root.__cause__
    first = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    if gpu:
        lines = [f"GPU out of memory{where}, allocating {component}: {first[:300]}"]
        if plan is not None and plan.gpu_limit:
            lines.append(f"the plan expected a peak of {plan.gpu_needed / GiB:.1f} GiB ({plan.gpu_peak_phase}) of "
                         f"{plan.gpu_limit / GiB:.1f} GiB; other processes on the GPU, or rows longer than planned, "
                         f"take the rest")
    else:
        lines = [f"host RAM ran out{where}, allocating the {component}: {first}"]
        if plan is not None:
            avail = f", {plan.host_available / GiB:.1f} GiB available ({plan.host_source})" \
                if plan.host_available is not None else ""
            lines.append(f"the plan expected {plan.host_total / GiB:.1f} GiB of host RAM{avail}; other processes "
                         f"may have taken memory since")
    if plan is not None and adapter is not None:
        from ..planner import suggestions

        target = 0.8 * plan.gpu_needed if gpu and plan.gpu_needed else None
        try:
            tips = suggestions(adapter, plan, gpu_target=target)
        except Exception:  # a suggestion is a courtesy: never hide the error behind another
            tips = []
        if tips:
            lines.append("would leave room:" if gpu else "what would fit:")
            lines += [f"  {t}" for t in tips]
    return "\n".join(lines)
