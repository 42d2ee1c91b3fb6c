"""Packed rows on CUDA through the variable-length flash kernel (models/varlen.py): exactness against float64 and
FlexAttention, its backward over block pairs, and memory at length (the kernels' speed is a benchmark:
bench/attention_kernels.py, and packed runs through `megatrain train` beside plain ones).

    python3 -m pytest -q -s -m gpu tests/gpu/test_varlen_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. Exactness, bf16, 8 query and 2 KV heads of 128 dims, one 8,192-token row of documents 200-3,000 tokens long:
   against the float64 truth (the same bf16 inputs, the dense document mask, SDPA's math in float64), the varlen
   output and d(q), d(k), d(v) are within 2x FlexAttention's error (the kernel it replaces); so are the backward
   over blocks of 1,024 (documents crossing block boundaries) and a window of 512 inside the documents.
2. Memory at 131,072 tokens, Llama-3.1-8B's heads, 9 documents: the varlen backward's allocated peak above its
   inputs, whole and over blocks of 65,536, against what the planner's meta device measures for the same calls.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from gpu_results import write_result

from megatrain.models.attention import attention_context, causal_attention
from megatrain.models.varlen import segments, varlen_attention

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GiB = 2**30


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def packed_positions(T: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    g, parts, t = torch.Generator().manual_seed(seed), [], 0
    while t < T:
        n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), T - t)
        parts.append(torch.arange(n))
        t += n
    return torch.cat(parts)[None].cuda()


def _inputs(T, heads, kv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, T, n, d, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
               for n in (heads, kv, kv))
    do = (torch.randn(1, T, heads, d, device="cuda", generator=g) * 0.1).to(torch.bfloat16).transpose(1, 2)
    return q, k, v, do


def _run(fn, q, k, v, do):
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return out.detach(), torch.autograd.grad(out, leaves, do)


@pytest.mark.parametrize("window,block", [(None, 0), (None, 1024), (512, 0)])
def test_varlen_is_as_exact_as_flex(window, block):
    T, d = 8192, 128
    pos = packed_positions(T, 200, 3000, seed=0)
    q, k, v, do = _inputs(T, 8, 2, d, seed=1)
    scale = d ** -0.5
    cos = torch.ones(1, T, d, device="cuda", dtype=torch.bfloat16)
    i = torch.arange(T, device="cuda")
    doc = torch.cumsum((pos == 0).int(), dim=1)[0]
    mask = (i[:, None] >= i[None, :]) & (doc[:, None] == doc[None, :])
    if window is not None:
        mask &= i[None, :] > i[:, None] - window
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        truth_out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale, enable_gqa=True)
        truth = torch.autograd.grad(truth_out, leaves, do.double())
    truth_out = truth_out.detach()
    del leaves, mask
    flex_ctx = attention_context(pos, cos, cos, packed=True, window=window, force_mask=True)
    ctx = attention_context(pos, cos, cos, packed=True, window=window).with_attn_block(block)
    assert ctx.varlen and flex_ctx.block_mask is not None
    flex_out, flex = _run(lambda *x: causal_attention(*x, flex_ctx, scale), q, k, v, do)
    out, got = _run(lambda *x: causal_attention(*x, ctx, scale), q, k, v, do)
    res = {"seq": T, "window": window, "block": block, "documents": int((pos == 0).sum()),
           "out_rel_flex": rel(flex_out, truth_out), "out_rel_varlen": rel(out, truth_out)}
    for name, t, f, b in zip("qkv", truth, flex, got):
        res[f"d{name}_rel_flex"], res[f"d{name}_rel_varlen"] = rel(f, t), rel(b, t)
    write_result(f"varlen_exact_cuda_w{window}_b{block}", __file__, res)
    print(res)
    for name in ("out", "dq", "dk", "dv"):
        assert res[f"{name}_rel_varlen"] <= 2 * res[f"{name}_rel_flex"], res


@pytest.mark.parametrize("block", [0, 65536])
def test_varlen_backward_memory_at_length(block):
    from megatrain.planner.activations import LiveBytes

    T, H, KH, d = 131072, 32, 8, 128
    pos = packed_positions(T, 8192, 24000, seed=2)
    cu, longest = segments(pos)
    q, k, v, do = _inputs(T, H, KH, d, seed=3)
    scale = d ** -0.5

    def attend(*leaves):
        return varlen_attention(*leaves, cu, longest, scale, block=block)

    def backward():
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attend(*leaves)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t = time.perf_counter()
        g = torch.autograd.grad(out, leaves, do)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        del g, out, leaves
        return dt, torch.cuda.max_memory_allocated() - base

    backward()
    runs = [backward() for _ in range(2)]
    mq, mk, mv, mdo = (torch.empty(t.transpose(1, 2).shape, dtype=t.dtype, device="meta").transpose(1, 2)
                       for t in (q, k, v, do))
    leaves = [t.requires_grad_(True) for t in (mq, mk, mv)]
    mcu = torch.empty(2, dtype=torch.int32, device="meta")
    out = varlen_attention(*leaves, mcu, T, scale, block=block)
    mode = LiveBytes()
    mode.ignore(mq, mk, mv, mdo, out)
    with mode:
        g = torch.autograd.grad(out, leaves, mdo)
        del g
    res = {"seq": T, "block": block, "documents": int(cu.numel() - 1), "backward_s": min(r[0] for r in runs),
           "backward_peak_gib": max(r[1] for r in runs) / GiB, "planned_peak_gib": mode.peak / GiB}
    write_result(f"varlen_memory_cuda_b{block}", __file__, res)
    print(res)
    assert res["backward_peak_gib"] <= res["planned_peak_gib"] * 1.05 + 0.25, res


def test_engine_packed_step_on_varlen_is_as_exact_as_on_flex(tmp_path, monkeypatch):
    """A packed training step through the engine (build_runtime, as the trainer builds it), bf16, one row of
    32,768 tokens (8 documents: the varlen kernel, models/base.FLEX_PACKED_TOKENS) against the fp32 step (which
    runs FlexAttention): loss and gradients within 2x the bf16 step's error with FlexAttention forced."""
    import megatrain.models.base as base
    from test_packing_cuda import model_dir, runtime, step

    d = model_dir(tmp_path, 2, 512)
    T, n_docs = 32768, 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 4096, (1, T), generator=g)
    labels = ids.clone()
    labels[0, ::T // n_docs] = -100
    pos = torch.arange(T // n_docs).repeat(n_docs)[None]

    def run(dtype):
        rt = runtime(d, dtype)
        try:
            out = step(rt, [(ids, labels, pos)])
            rt.pipeline.drain()
            return out
        finally:
            rt.close()

    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref_loss, ref = run(torch.float32)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    var_loss, var = run(torch.bfloat16)
    monkeypatch.setattr(base, "FLEX_PACKED_TOKENS", 1 << 40)  # FlexAttention at every length
    flex_loss, flex = run(torch.bfloat16)
    res = {"tokens": T, "documents": n_docs,
           "loss_rel_varlen": abs(var_loss - ref_loss) / abs(ref_loss), "grad_rel_varlen": rel(var, ref),
           "loss_rel_flex": abs(flex_loss - ref_loss) / abs(ref_loss), "grad_rel_flex": rel(flex, ref)}
    write_result("varlen_engine_cuda", __file__, res)
    print(res)
    assert res["grad_rel_varlen"] <= 2 * res["grad_rel_flex"], res
    assert res["loss_rel_varlen"] <= 2 * res["loss_rel_flex"] + 1e-6, res
