"""The step: a host store of every persistent tensor, a GPU that streams one unit at a time through weight slots,
and a CPU optimizer that overlaps the GPU. Modules, one job each:

    schedule.py            one step's order of work as data (Placement -> Uses: which units, which pass, which
                           checkpoints are kept, spilled or rebuilt, where each gradient goes); the planner simulates it
    knobs.py               Knob: each Placement field's config key, bounds and doc, declared with the field
    accumulators.py        gradient accumulators kept across wave groups, on the GPU or parked in host memory
    engine.py              executes the schedule: slots, streams, events, waves (its docstring: the protocol)
    forward_only.py        the engine's forward-only uses: eval loss, sequence log-probs, next-token logits
    layer.py               one layer's forward and recompute + backward for one micro-batch, its per-token parts
                           over tiles of tokens with a sequence tile (Placement.seq_tile)
    lmhead.py, ce_triton.py  the chunked LM-head loss with its backward; the fused cross-entropy kernel (CUDA)
    objective.py           the loss: sft, or a preference objective (dpo, ipo, simpo, orpo) over row log-probs
    head_objective.py      a preference objective's LM head: row log-probs, then the weighted cross-entropy
    microbatch.py          a micro-batch's tensors in, a step's loss and norm out
    store.py               HostStore: per-unit tiles of fp32 master, Adam m and v, the streaming copy (and a
                           preference objective's frozen reference copy)
    tile.py                LayerTile: one unit's views of those states, what the optimizer updates
    disk_tier.py           the SSD tier: states host RAM cannot hold in per-unit files, read ahead, written behind
    disk_files.py          its scratch folders (locked; a dead run's removed), the O_DIRECT probe, the request loop
    disk_probe.py          the disk's read and write rates, measured as the tier moves data (memory.disk_path)
    pinned.py              PinnedHost: the one owner of page-locked (cudaHostRegister'ed) host memory
    optimizer_pipeline.py  gradients to host, CPU AdamW overlapped with the next forward, updates in order
    adamw.py               the CPU AdamW kernel per tile, the pieces it updates a tile in, clipping,
                           learning-rate schedules
    activation_spill.py    layer-boundary activations parked in pinned host memory
    timeline.py            busy shares of the CUDA streams

    build.py               build_runtime: wires them for the trainer, the benchmarks and the tests

The names below are imported from their modules when first used (`from megatrain.runtime import Engine`): the
package itself imports nothing, so torch-free modules of it (knobs.py, schedule.py) load without torch (the config
reads Placement's keys from them before anything needs torch). The runtime sees tensors only: it never
imports the command line, the config or the data files' code.
"""

from __future__ import annotations

from importlib import import_module

_HOME = {"CpuAdamW": "adamw", "CollectGrads": "engine", "Engine": "engine", "EngineOptions": "engine",
         "Phase": "engine", "HeadKernels": "lmhead", "MicroBatch": "microbatch", "StepOutput": "microbatch",
         "SFT": "objective", "Objective": "objective", "OptimizerPipeline": "optimizer_pipeline",
         "OptimizerThreadError": "optimizer_pipeline", "PinnedHost": "pinned", "Placement": "schedule",
         "Use": "schedule", "grads_to_host": "schedule", "step_schedule": "schedule", "HostStore": "store",
         "store_dtypes": "store", "Timeline": "timeline", "Runtime": "build", "RuntimeOptions": "build",
         "build_runtime": "build"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_HOME)
