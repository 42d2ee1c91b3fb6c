"""The planner's meta-device runs make a repeated op's outputs from its first run's metadata (activations._run_op):
the same sizes as running every op's meta kernel, for several families, shapes and layer variants, both on a cold
cache and on one warmed by the same and by other runs."""

from pathlib import Path

import pytest
import torch

from megatrain.models import get_adapter, load_hf_config
from megatrain.planner import activations
from megatrain.planner.activations import head_memory, layer_memory

CONFIGS = Path(__file__).resolve().parent.parent / "bench" / "model-configs"
FAMILIES = ["llama-3.1-8b", "gemma-2-9b", "gpt-oss-20b", "mixtral-8x7b"]  # qwen2's ops: llama's and biases
VARIANTS = [{}, {"seq_tile": 256}, {"seq_tile": 384}, {"attn_block": 256}, {"seq_tile": 256, "attn_block": 512},
            {"stash": True, "plain": False}, {"stash": True, "plain": False, "seq_tile": 256}]


COMBOS = [(packed, cuda, dtype) for packed in (False, True) for cuda in (True, False)
          for dtype in (torch.bfloat16, torch.float32)]


def _all(adapter, rows: int, seq: int) -> list:
    """Each variant under two opposite (packed rows, CUDA kernels, dtype) combinations, rotating through all eight:
    every variant meets both values of each, every combination meets some variant, and all share one cache (the full
    product, 56 layers a shape, cost CI minutes and reached no other code)."""
    out = []
    for i, kw in enumerate(VARIANTS):
        for packed, cuda, dtype in (COMBOS[i % 4], COMBOS[7 - i % 4]):
            out.append(layer_memory(adapter, rows, seq, dtype, packed, cuda_attention=cuda, **kw))
    for cuda in (True, False):
        out.append(head_memory(adapter, rows, seq, rows * (seq - 1), 512, torch.bfloat16, cuda=cuda))
        out.append(head_memory(adapter, rows, seq, rows * (seq - 1) // 3, 700, torch.float32, cuda=cuda))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_repeated_ops_measure_what_their_meta_kernels_measure(family, monkeypatch):
    adapter = get_adapter(load_hf_config(CONFIGS / family))
    shapes = [(2, 1024), (1, 1600)]  # (1600: a remainder tile joined to the last)
    with monkeypatch.context() as m:  # every op through its meta kernel
        m.setattr(activations, "_fresh", lambda func: False)
        fresh = [_all(adapter, rows, seq) for rows, seq in shapes]
    activations._OUTS.clear()
    cold = [_all(adapter, rows, seq) for rows, seq in shapes]  # the cache filled as the runs go
    assert len(activations._OUTS) > 0
    warm = [_all(adapter, rows, seq) for rows, seq in reversed(shapes)][::-1]  # every op seen before
    assert cold == fresh and warm == fresh
    assert all(v > 0 for runs in fresh for one in runs for v in (one.values() if isinstance(one, dict) else [one]))
