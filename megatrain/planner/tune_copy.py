"""The host memory of `engine.tune_first`'s copy of the model (run/tune_first.py).

Before the run's host store exists, the kernels are compiled and tuned on a copy of the model with the layers up to
the first of each attention kind, over a store of its own, on one micro-batch at a time. That phase's host peak is
the copy's store, its landing buffers, the autotuner's page-locked block (which no longer comes in the run's first
step) and the runtime. It is below the run's own peak unless the model has few layers; the plan takes the larger.
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
    """(layers, host components) of the copy's phase, as memory.host_memory counts a run's."""
    from .memory import host_memory

    layers, small = copy_adapter(adapter)
    cw = replace(w, micro_batches=(max(w.micro_batches),), placement=copy_placement(w.placement, layers),
                 disk_states=(), tune_first=False)
    return layers, host_memory(small.units(), cw, small.tied)
