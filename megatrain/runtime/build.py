"""build_runtime: the engine and the optimizer pipeline around a filled store (the runtime package's wiring)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .adamw import CpuAdamW
from .engine import Engine, EngineOptions
from .optimizer_pipeline import OptimizerPipeline
from .pinned import PinnedHost
from .schedule import grads_to_host
from .store import HostStore
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
                  options: RuntimeOptions = RuntimeOptions(), make_pipeline=None,
                  pinned_as: str = "host store's streaming copy") -> Runtime:
    """The engine and the optimizer pipeline around a filled store: the store's streaming copy (the master in fp32
    mode) is pinned on CUDA, and the engine's gradient sink is the pipeline. make_pipeline(pinned, to_host,
    timeline): another pipeline than OptimizerPipeline (a torchrun rank's ShardedPipeline: distributed/session.py);
    pinned_as: how the pinned copy is named in errors."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    pinned = PinnedHost(cuda)
    pipeline = None
    try:
        pinned.register(store.stream, pinned_as)
        timeline = Timeline() if cuda and options.measure_streams else None
        to_host = tuple(grads_to_host(len(store.tiles), options.engine.placement))
        pipeline = make_pipeline(pinned, to_host, timeline) if make_pipeline else \
            OptimizerPipeline(store, optimizer, device, pinned, threaded=options.threaded_optimizer, to_host=to_host,
                              threads=options.adam_threads, timeline=timeline)
        engine = Engine(store, store.adapter, device, pipeline, options.engine, timeline=timeline, pinned=pinned)
    except BaseException:
        if pipeline is not None:
            pipeline.close()
        pinned.close()
        raise
    return Runtime(store, engine, pipeline, pinned, timeline)
