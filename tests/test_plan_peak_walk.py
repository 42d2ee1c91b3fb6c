"""The search's walk (memory.gpu_peak: peak only, a wave group's forward uses summed in one loop, early stop) gives
what the report's walk (memory.gpu_phases: a phase per use) gives, placement by placement, to the last bit."""

import random
from contextlib import nullcontext

import pytest
from conftest import tiny_hf_config

from megatrain.models import get_adapter
from megatrain.planner.memory import Over, gpu_peak, gpu_phases
from megatrain.planner.tally import sized
from megatrain.planner.workload import Workload
from megatrain.runtime.schedule import Placement


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("gemma2", False)])
def test_the_peak_walk_is_the_phases_largest_total(family, tied):
    adapter = get_adapter(tiny_hf_config(family, tied=tied, layers=7, vocab=1001))
    units = sized(adapter.units())
    L = len(units) - 2
    rng = random.Random(f"{family}{tied}")
    for _ in range(25):
        pl = Placement(checkpoint_every=rng.choice([1, 2, 3]), keep_top_layers=rng.choice([0, 2]),
                       spill_layers=rng.randint(0, L), grads_to_host=rng.randint(0, L + 2),
                       wave_groups=rng.choice([1, 2, 3]), group_grads=rng.choice(["gpu", "host"]),
                       reuse_attention=rng.choice([0, 0, 3]) if family != "gemma2" else 0,
                       seq_tile=rng.choice([0, 16]))
        w = Workload(tuple(rng.choice([1, 2, 3]) for _ in range(rng.choice([1, 3, 4]))), rng.choice([32, 64]),
                     placement=pl, clipping=rng.choice([True, False]), compile=rng.choice([True, False]))
        peak = max(sum(c.values()) for _, c in gpu_phases(adapter, units, w, []))
        assert gpu_peak(adapter, units, w) == peak, pl
        limit = peak * rng.choice([0.3, 0.8, 1.0, 1.2])  # stopped at the first phase above it, if any
        with pytest.raises(Over) if peak > limit else nullcontext():
            gpu_peak(adapter, units, w, over=lambda total: total > limit)

