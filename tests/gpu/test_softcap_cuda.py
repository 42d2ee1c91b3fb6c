"""GPU test of Gemma 2's soft-capped attention at its real head_dim (256): FlexAttention with megatrain's score
(models/attention.softcap_score) and kernel options (flex_kernel_options: Hopper's tuned tiles) over rows packed
with documents, against float64 math with cap·tanh and a mask per document: its output and gradients within what
FlexAttention's own defaults with torch.tanh reach (bf16 inputs both).

    python3 -m pytest -q -m gpu tests/gpu/test_softcap_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from megatrain.models.attention import (attention_context, causal_attention, flex_attention, flex_kernel_options,
                                        softcap_score)

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

CAP, H, KVH, D = 50.0, 8, 4, 256


def packed(B: int, T: int, lengths: list[int]) -> torch.Tensor:
    pos = torch.cat([torch.arange(n) for n in lengths])
    assert len(pos) == T
    return pos.expand(B, T).contiguous()


def reference(q, k, v, do, lengths: list[int], scale: float):
    """float64 output and gradients of capped causal attention within each document."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    kk, vv = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
    outs, lo = [], 0
    for n in lengths:
        s = q[:, :, lo:lo + n] @ kk[:, :, lo:lo + n].transpose(-1, -2) * scale
        s = CAP * torch.tanh(s / CAP)
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=s.device).tril(), float("-inf"))
        outs.append(torch.softmax(s, -1) @ vv[:, :, lo:lo + n])
        lo += n
    o = torch.cat(outs, 2)
    o.backward(do.double())
    return o.detach(), q.grad, k.grad, v.grad


def test_softcap_flex_equals_float64():
    dev = torch.device("cuda")
    B, lengths = 2, [700, 300, 1024, 24, 1000]
    T = sum(lengths)
    g = torch.Generator(device=dev).manual_seed(0)
    q = (torch.randn(B, H, T, D, device=dev, generator=g) * 4).bfloat16().requires_grad_()  # scores past the bend
    k, v = (torch.randn(B, KVH, T, D, device=dev, generator=g).bfloat16().requires_grad_() for _ in range(2))
    do = torch.randn(B, H, T, D, device=dev, generator=g).bfloat16()
    scale = D ** -0.5
    pos = packed(B, T, lengths).to(dev)
    cos = torch.ones(B, T, D, device=dev, dtype=torch.bfloat16)
    ctx = attention_context(pos, cos, cos, packed=True, window=None, force_mask=True, head_dim=D,
                            flex_options=flex_kernel_options("softcap", D, dev))
    want = reference(q, k, v, do, lengths, scale)

    def errors(run):
        q.grad = k.grad = v.grad = None
        o = run()
        o.backward(do)
        return [float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip((o, q.grad, k.grad, v.grad), want)]

    ours = errors(lambda: causal_attention(q, k, v, ctx, scale, score_mod=softcap_score(CAP)))
    plain = errors(lambda: flex_attention()(q, k, v, score_mod=lambda s, b, h, i, j: torch.tanh(s / CAP) * CAP,
                                            block_mask=ctx.block_mask, scale=scale, enable_gqa=True))
    for name, e, base in zip(("output", "dq", "dk", "dv"), ours, plain):
        assert e <= max(1.25 * base, 1e-3), (name, e, base)
        assert e < 2e-2, (name, e)  # bf16 inputs: a few units of bf16's 2⁻⁸
