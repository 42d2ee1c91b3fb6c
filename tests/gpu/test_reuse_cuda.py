"""The attention kept from the forward for the backward (memory.reuse_attention) on CUDA: what CPU cannot show.

    python3 -m pytest -q -m gpu tests/gpu/test_reuse_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

One Llama-3.1-8B-shaped layer (random weights, bf16) over one 32,768-token row, tiles of 8,192, eager:
1. the kept attention (SDPA's fused kernel, under the saved-tensor hook that swaps q, k, v for notes) holds what
   the planner says, the output and its log-sum-exp (planner.activations.layer_memory's `stash`, within 5%), not q,
   k, v: the hook met the tensors the CUDA kernel saves;
2. the backward that spends it gives d(input) and every weight gradient of the backward that recomputes, at bf16's
   rounding (the fused attention backward accumulates with atomics: two runs of the same backward differ as much,
   measured here too). Both backwards' times are recorded as data, not asserted: what the kept attention saves
   in a run is measured by the long-context benchmarks (docs/long-context.md).
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_results import write_result
from test_tiling_cuda import llama8b_layer, rel

from megatrain.runtime.layer import layer_backward, layer_template

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GiB = 2**30
SEQ, TILE = 32768, 8192


def _backward(layer, w, x, c, dh, unit, stash=None):
    grads = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
    torch.cuda.synchronize()
    t = time.perf_counter()
    dx = layer_backward(layer, w, x, c, dh.clone(), grads, None, stash=stash)
    torch.cuda.synchronize()
    return dx, grads, time.perf_counter() - t


def test_kept_attention_on_cuda():
    from megatrain.planner.activations import layer_memory

    adapter, unit, w, ctx, x, dh = llama8b_layer(seq=SEQ)
    layer = layer_template(adapter, TILE, stash=True)
    planned = layer_memory(adapter, 1, SEQ, torch.bfloat16, False, True, seq_tile=TILE, stash=True)["stash"]
    with torch.no_grad():  # warm-up: kernels chosen, workspaces allocated
        out, st = layer.forward_stash(w, x, ctx)
    _backward(layer, w, x, ctx, dh, unit, st)
    _backward(layer, w, x, ctx, dh, unit)
    del out, st
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.no_grad():
        out, st = layer.forward_stash(w, x, ctx)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    dx_kept, g_kept, t_kept = _backward(layer, w, x, ctx, dh, unit, st)
    dx_again, g_again, t_again = _backward(layer, w, x, ctx, dh, unit)
    dx_twice, g_twice, _ = _backward(layer, w, x, ctx, dh, unit)
    worst = max(rel(a, b) for a, b in zip(g_kept, g_again))
    noise = max(rel(a, b) for a, b in zip(g_twice, g_again))
    res = {"seq": SEQ, "tile": TILE, "stash_gib": held / GiB, "planned_stash_gib": planned / GiB,
           "qkv_output_gib": (2 * SEQ * 4096 + 2 * SEQ * 1024 + SEQ * 4096) * 2 / GiB,
           "dx_rel": rel(dx_kept, dx_again), "dx_rel_same_path": rel(dx_twice, dx_again),
           "weight_grad_rel_max": worst, "weight_grad_rel_same_path": noise,
           "backward_kept_s": t_kept, "backward_recompute_s": t_again}
    write_result("reuse_cuda", __file__, res)
    print(res)
    assert abs(held - planned) <= 0.05 * planned, res
    assert rel(dx_kept, dx_again) <= 2e-2 and worst <= 2e-2, res
