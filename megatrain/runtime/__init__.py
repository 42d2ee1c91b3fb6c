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

`build_runtime` wires them for the trainer, the benchmarks and the tests. The runtime sees tensors only: it never
imports the command line, the config or the data files' code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adamw import CpuAdamW
from .engine import CollectGrads, Engine, EngineOptions, Phase
from .lmhead import HeadKernels
from .microbatch import MicroBatch, StepOutput
from .objective import SFT, Objective
from .optimizer_pipeline import OptimizerPipeline, OptimizerThreadError
from .pinned import PinnedHost
from .schedule import Placement, Use, grads_to_host, step_schedule
from .store import HostStore, store_dtypes
from .timeline import Timeline


@dataclass(frozen=True)
class RuntimeOptions:
    engine: EngineOptions = field(default_factory=EngineOptions)  # its placement: schedule.Placement
    adam_threads: int | None = None  # intra-op threads of the optimizer worker (default: torch's)
    threaded_optimizer: bool | None = None  # default: on CUDA
    measure_streams: bool = True  # a Timeline of the streams' busy shares (CUDA)


@dataclass
class Runtime:
    store: HostStore
    engine: Engine
    pipeline: OptimizerPipeline
    pinned: PinnedHost
    timeline: Timeline | None

    def close(self) -> None:
        """Stop the optimizer worker, then unregister every pinned buffer (the store's included) and remove the SSD
        tier's scratch files (the store's RAM states stay readable)."""
        try:
            self.pipeline.close()
        finally:
            self.pinned.close()
            self.store.close()


def build_runtime(store: HostStore, device: torch.device | str, optimizer: CpuAdamW,
                  options: RuntimeOptions = RuntimeOptions()) -> Runtime:
    """The engine and the optimizer pipeline around a filled store: the store's streaming copy (the master in fp32
    mode) is pinned on CUDA, and the engine's gradient sink is the pipeline."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    pinned = PinnedHost(cuda)
    pipeline = None
    try:
        pinned.register(store.stream, "host store's streaming copy")
        timeline = Timeline() if cuda and options.measure_streams else None
        to_host = grads_to_host(len(store.tiles), options.engine.placement)
        pipeline = OptimizerPipeline(store, optimizer, device, pinned, threaded=options.threaded_optimizer,
                                     to_host=tuple(to_host), threads=options.adam_threads, timeline=timeline)
        engine = Engine(store, store.adapter, device, pipeline, options.engine, timeline=timeline, pinned=pinned)
    except BaseException:
        if pipeline is not None:
            pipeline.close()
        pinned.close()
        raise
    return Runtime(store, engine, pipeline, pinned, timeline)


__all__ = ["CollectGrads", "CpuAdamW", "Engine", "EngineOptions", "HeadKernels", "HostStore", "MicroBatch", "Objective",
           "OptimizerPipeline", "OptimizerThreadError", "Phase", "PinnedHost", "Placement", "Runtime",
           "RuntimeOptions", "SFT", "StepOutput", "Timeline", "Use", "build_runtime", "step_schedule", "store_dtypes"]
