"""The host memory of `engine.tune_first`'s copy of the model (run/tune_first.py).

Before the run's host store exists, the kernels are compiled and tuned on a copy of the model with the layers up to
the first of each attention kind, over a store of its own (the fp32 master and the streaming copy: its optimizer
updates nothing), on one micro-batch at a time. That phase's host peak is the copy's store, its landing buffers, the
autotuner's page-locked block (which no longer comes in the run's first step) and the runtime. It is below the run's
own peak unless the model has few layers; the plan takes the larger. Where host RAM holds the run's store and the
copy's phase at once (`beside_store`), the store is allocated and filled beside the copy (run/startup.py): the
start's host peak is then the sum, and the plan counts it.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from ..runtime.knobs import knobs
from ..runtime.schedule import Placement
from .workload import Workload


def layers_needed(kinds: list[str]) -> int:
    """Layers of the copy: up to the first layer of each attention kind (each kind compiles its own graphs)."""
    return 1 + max(kinds.index(k) for k in set(kinds))


def truncated_config(hf_config, layers: int):
    c = copy.deepcopy(hf_config)
    c.num_hidden_layers = layers
    if getattr(c, "layer_types", None):
        c.layer_types = list(c.layer_types)[:layers]
    return c


def copy_placement(pl: Placement, layers: int) -> Placement:
    """The copy's placement: the run's values of the knobs that decide the compiled graphs (Knob.graphs: tiles,
    kept attention, attention blocks, streaming dtype), kept attention in at most its layers; nothing is spilled,
    offloaded or grouped."""
    kw = {k.name: getattr(pl, k.name) for k in knobs(Placement) if k.graphs}
    return Placement(**{**kw, "reuse_attention": min(pl.reuse_attention, layers)})


def copy_adapter(adapter):
    """(layers, the copy's adapter): the model truncated to the layers it needs, as run/tune_first.py builds it."""
    from ..models import get_adapter

    layers = layers_needed(adapter.layer_kinds)
    return layers, get_adapter(truncated_config(adapter.hf_config, layers))


def copy_host(adapter, w: Workload) -> tuple[int, dict[str, float]]:
    """(layers, host components) of the copy's phase, as memory.host_memory counts a run's, less Adam m and v: the
    copy's optimizer updates nothing (run/tune_first.py's NoUpdate)."""
    from .memory import STATE_NAMES, host_memory

    layers, small = copy_adapter(adapter)
    cw = replace(w, micro_batches=(max(w.micro_batches),), placement=copy_placement(w.placement, layers),
                 disk_states=(), tune_first=False)
    host = host_memory(small.units(), cw, small.tied)
    for k in ("m", "v"):
        del host[STATE_NAMES[k]]
    return layers, host


def store_states(host: dict[str, float]) -> float:
    """The bytes of the host store's states among a run's host components: the master, Adam m and v, the streaming
    copy, the SSD tier's slots, a reference copy (what is allocated and filled before the first step)."""
    from .memory import SSD_CACHE, STATE_NAMES

    return sum(v for k, v in host.items() if k in STATE_NAMES.values() or k == SSD_CACHE
               or k.startswith("bf16 streaming copy") or "reference" in k)


def beside_store(host: dict[str, float], copy_phase: dict[str, float], available: float | None) -> bool:
    """Whether host RAM holds the store's states and the copy's whole phase (its store, the autotuner's block, the
    process's runtime and data, counted there once) at once; the run's later buffers (landing buffers, pinned
    gradients) come after the copy is freed. Unknown available memory: no."""
    return available is not None and store_states(host) + sum(copy_phase.values()) <= available
