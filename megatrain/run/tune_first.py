"""Compile and tune the layers' kernels before the host store exists (`engine.tune_first`).

A compiled run's first step compiles the layer template. The first time an Inductor kernel with several
configurations runs, Inductor benchmarks them. Before it does, it copies aside the buffers the kernel writes: to the
GPU when the GPU's peak so far leaves room, else to page-locked host memory
(`CachingAutotuner.copy_args_to_cpu_if_needed`). torch's caching host allocator keeps those in power-of-two
blocks. For Qwen2.5-7B at 80,896 tokens per micro-batch that is 4 GiB on top of the whole host store: with fp32
streaming, a peak of 12.88 B/param, against 12.30 when Inductor's cache already had the kernels tuned
(bench/autotune_copies.py measures both).

Here the same compiling and tuning runs first, on a copy of the model with only the layers it needs (up to the
first layer of each attention kind, so every kind's graph is compiled), over a store of its own, on the run's first
step (drawn from the loader and put back: the step resumed from, after a resume) and the evaluation batches. It
happens while host RAM holds only that copy. Then the copy is freed and torch's page-locked blocks are returned.
The run's own engine reuses the compiled graphs: Dynamo's guards hold for another adapter of the same shapes
(bench/autotune_copies.py, mode two-engines; tests/test_tune_first.py), so the run compiles and tunes nothing
again for those shapes. A compiled template runs its first micro-batch shape with static graphs and every other
shape with one graph whose token dimension is dynamic (runtime/layer.ShapeCompiled). The copy and the run both
name the first training micro-batch's shape as the static one (layer.expect_first_shape; a fresh run's step-0
evaluation, which runs first, may have other rows), and the copy runs the shapes in the run's order (a fresh run
evaluates step 0 before its first step, a resumed one does not): the graphs it compiles are the ones the run uses.
A later step whose micro-batches have other lengths (unpacked rows, padded to each micro-batch's longest) runs the
dynamic graphs already compiled, if the first step had two shapes or more; else it compiles them once, in that
step.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import time

import torch

from ..data import StepLoader
from ..models import ModelAdapter
from ..planner.tune_copy import copy_adapter, copy_placement
from ..runtime import EngineOptions, HostStore, MicroBatch, RuntimeOptions, build_runtime
from ..runtime.pinned import release_torch_pinned_cache
from ..runtime.layer import expect_first_shape
from ..runtime.store import store_dtypes
from .prefetch import prepare_step

SEED = 20261127  # the copy's weights and tokens: private generators, the run's random state is not touched


class NoUpdate:
    """The copy's optimizer: its gradients land on the host as the run's do (the same copies and waits), and nothing
    is updated, so the copy's store needs no Adam m and v (planner/tune_copy.py counts it so)."""

    def update(self, tile, grad, **kwargs) -> None:
        pass


def first_step(loader: StepLoader, resumed_state: dict | None = None) -> list[MicroBatch]:
    """The run's first step's micro-batches, the loader left where it was (at `resumed_state` after a resume)."""
    if resumed_state is not None:
        loader.load_state_dict(resumed_state)
    state = loader.state_dict()
    try:
        return prepare_step(loader.next_step(), pin=False)
    finally:
        loader.load_state_dict(state)


def distinct(mbs: list[MicroBatch]) -> list[MicroBatch]:
    """One micro-batch of each shape (rows, tokens; packed or not): each compiles its own graphs."""
    out = {}
    for mb in mbs:
        out.setdefault((tuple(mb.input_ids.shape), mb.packed, mb.token_mask is not None), mb)
    return list(out.values())


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim): the copy's smaller allocations (below
    malloc's mmap threshold) would otherwise stay in the process's resident set under the store. False where the
    C library has no malloc_trim."""
    try:
        return bool(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def tune_first(run_adapter: ModelAdapter, device: torch.device, options: EngineOptions, precision: str,
               step: list[MicroBatch], eval_batches=None, resumed: bool = False) -> str:
    """Run the layers' compiling and tuning on a truncated copy of the model (see the module's note) over `step`'s
    micro-batch shapes and the evaluation batches', in the run's order (`resumed`: the run starts with its step,
    else with the step-0 evaluation); return what it did. `options`: the run's engine options (their tiles, stash
    and attention blocks decide the graphs; the rest of the placement does not)."""
    t0 = time.perf_counter()
    layers, adapter = copy_adapter(run_adapter)
    placement = copy_placement(options.placement, layers)
    store = HostStore(adapter, *store_dtypes(precision, placement.stream_dtype), adam_states=False)
    store.init_random(SEED, 0.02)
    runtime = build_runtime(store, device, NoUpdate(), RuntimeOptions(
        engine=EngineOptions(loss_chunk_tokens=options.loss_chunk_tokens, num_slots=options.num_slots,
                             compile_layers=options.compile_layers, placement=placement,
                             head_kernels=options.head_kernels)))
    expect_first_shape(runtime.engine.layer, *step[0].input_ids.shape)  # the static graphs: the training's
    evals = {}  # one batch of each shape, before any is prepared (an evaluation set may have thousands)
    for b in eval_batches or []:
        evals.setdefault((tuple(b["input_ids"].shape), b.get("position_ids") is not None), b)
    work = [(True, mb) for mb in distinct(step)]
    work = work + [(False, b) for b in evals.values()] if resumed else [(False, b) for b in evals.values()] + work
    try:
        for train, mb in work:
            if train:
                runtime.pipeline.begin_step(lr=None)
                runtime.engine.train_step([mb]).loss_sum.item()
                runtime.pipeline.finish_step(lr=0.0, clip_coef=1.0)
            else:
                runtime.engine.eval_loss([MicroBatch.from_labels(mb["input_ids"], mb["labels"],
                                                                 mb.get("position_ids"))])
        runtime.pipeline.drain()
    finally:
        runtime.close()
    del runtime, store
    gc.collect()
    trim_heap()
    released = 0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        released = release_torch_pinned_cache(min_idle=0)
    shapes = len(work)
    return (f"{shapes} shape{'s' if shapes != 1 else ''} on a {layers}-layer copy in {time.perf_counter() - t0:.1f} "
            f"s" + (f", {released / 2**30:.2f} GiB of autotuning copies returned" if released else ""))
