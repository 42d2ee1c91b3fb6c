"""The attention's backward over blocks (memory.attn_block, models/attention.blockwise_causal) on CUDA: the fused
kernels CPU cannot run (those SDPA picks for the row: cuDNN's on Hopper, else the flash op's).

    python3 -m pytest -q -m gpu tests/gpu/test_blockwise_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. Exactness, bf16, 8 query and 2 KV heads of 128 dims over an 8,192-token row, blocks of 1,024 (36 pairs): against
   the float64 truth (the same bf16 inputs, SDPA's math path in float64), the blocked attention's output and its
   d(q), d(k), d(v) are as close as SDPA's default kernel's (within 2x its error: a different kernel, so not bit
   for bit); d(q) written over d(output) when allowed, within what two runs of the blocked backward differ by (the
   fused backwards sum d(q) with atomics).
2. Memory and time at length: Llama-3.1-8B's heads (32 query, 8 KV) over 131,072 and 262,144 tokens (blocks of
   65,536): the backward's allocated peak above its inputs for SDPA's kernel and the blocked one, against what the
   planner's meta device measures for each (planner.activations: the same functions on the meta device; at two
   blocks the blocked one holds more, the fp32 sums of d(k) and d(v), from four it holds less), and each backward's
   time (recorded: profile.BLOCKED_ATTENTION_SLOWDOWN; results/llama-3.1-8b-3l-1m-h200-cli with cuDNN's kernels,
   h100-llama512k with the flash op's).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from gpu_results import write_result

from megatrain.models.attention import blockwise_causal

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GiB = 2**30
H, KH, D = 32, 8, 128


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(T: int, seed: int, heads: int = H, kv: int = KH):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, T, n, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
               for n in (heads, kv, kv))
    do = (torch.randn(1, T, heads, D, device="cuda", generator=g) * 0.1).to(torch.bfloat16).transpose(1, 2)
    return q, k, v, do


def _fused(q, k, v, do, scale):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
    return out, torch.autograd.grad(out, leaves, do)


def _blocked(q, k, v, do, scale, block, in_place=False):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = blockwise_causal(*leaves, scale, block, grad_in_place=in_place)
    return out, torch.autograd.grad(out, leaves, do)


def test_blocked_backward_on_cuda_is_as_exact_as_the_fused_kernel():
    T, block, scale = 8192, 1024, D ** -0.5
    q, k, v, do = _inputs(T, seed=0, heads=8, kv=2)  # float64 math over 8 heads: 4 GiB of scores
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        truth_out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
        truth = torch.autograd.grad(truth_out, leaves, do.double())
    truth_out = truth_out.detach()
    del leaves
    fused_out, fused = _fused(q, k, v, do, scale)
    out, blocked = _blocked(q, k, v, do, scale, block)
    _, again = _blocked(q, k, v, do, scale, block)
    d = do.clone()
    _, in_place = _blocked(q, k, v, d, scale, block, in_place=True)
    res = {"seq": T, "block": block, "heads": 8, "kv_heads": 2,
           "out_rel_fused": rel(fused_out, truth_out), "out_rel_blocked": rel(out, truth_out),
           "in_place_dq_aliases_dout": in_place[0].untyped_storage().data_ptr() == d.untyped_storage().data_ptr()}
    for name, t, f, b, a, i in zip("qkv", truth, fused, blocked, again, in_place):
        res[f"d{name}_rel_fused"], res[f"d{name}_rel_blocked"] = rel(f, t), rel(b, t)
        res[f"d{name}_rel_in_place"], res[f"d{name}_rel_two_runs"] = rel(i, b), rel(a, b)
    write_result("blockwise_exact_cuda", __file__, res)
    print(res)
    assert res["in_place_dq_aliases_dout"], res
    assert res["out_rel_blocked"] <= 2 * res["out_rel_fused"], res
    for name in "qkv":
        assert res[f"d{name}_rel_blocked"] <= 2 * res[f"d{name}_rel_fused"], res
        assert res[f"d{name}_rel_in_place"] <= 2 * res[f"d{name}_rel_two_runs"] + 1e-6, res


def _timed_backward(fn, q, k, v, do, scale):
    """(seconds of the backward, its allocated peak above what was live before it)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fn(leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t = time.perf_counter()
    grads = torch.autograd.grad(out, leaves, do)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() - base
    del grads, out, leaves
    return dt, peak


@pytest.mark.parametrize("T", [131072, 262144])
def test_blocked_backward_memory_and_time_at_length(T):
    from megatrain.planner.activations import LiveBytes, fused_sdpa_meta

    block, scale = 65536, D ** -0.5
    q, k, v, do = _inputs(T, seed=1)

    def fused(leaves):
        return F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)

    def blocked(leaves):
        return blockwise_causal(*leaves, scale, block)

    _timed_backward(fused, q, k, v, do, scale)  # warm-up
    _timed_backward(blocked, q, k, v, do, scale)
    runs = {name: [_timed_backward(fn, q, k, v, do, scale) for _ in range(2)]
            for name, fn in (("fused", fused), ("blocked", blocked))}

    def meta_peak(fn):  # what the planner measures: the same call on the meta device
        mq, mk, mv, mdo = (torch.empty(t.transpose(1, 2).shape, dtype=t.dtype, device="meta").transpose(1, 2)
                           for t in (q, k, v, do))
        leaves = [t.requires_grad_(True) for t in (mq, mk, mv)]
        out = fn(leaves)
        mode = LiveBytes()
        mode.ignore(mq, mk, mv, mdo, out)
        with mode:
            g = torch.autograd.grad(out, leaves, mdo)
            del g
        return mode.peak

    planned = {"fused": meta_peak(lambda lv: fused_sdpa_meta(*lv, is_causal=True, scale=scale, enable_gqa=True)),
               "blocked": meta_peak(blocked)}
    res = {"seq": T, "block": block, "heads": H, "kv_heads": KH}
    for name in ("fused", "blocked"):
        res[f"{name}_backward_s"] = min(r[0] for r in runs[name])
        res[f"{name}_backward_peak_gib"] = max(r[1] for r in runs[name]) / GiB
        res[f"{name}_planned_peak_gib"] = planned[name] / GiB
    res["blocked_over_fused_time"] = res["blocked_backward_s"] / res["fused_backward_s"]
    write_result(f"blockwise_length_cuda_{T}", __file__, res)
    print(res)
    if T >= 4 * block:  # from four blocks on, what the blocks leave out outweighs the fp32 sums of d(k), d(v)
        assert res["blocked_backward_peak_gib"] < res["fused_backward_peak_gib"], res
    for name in ("fused", "blocked"):
        assert abs(res[f"{name}_backward_peak_gib"] - res[f"{name}_planned_peak_gib"]) <= \
            0.1 * res[f"{name}_planned_peak_gib"] + 0.1, res
