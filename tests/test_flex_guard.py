"""FlexAttention and its block mask never run uncompiled: past the shape limit the run stops with a clear error.

Uncompiled, FlexAttention builds the full T x T score matrix in fp32 (256 GiB asked for at
32k tokens after a test file's earlier shapes had used up dynamo's default recompile limit of 8). Here, on CPU with
the limit set to 2: two shapes compile and equal SDPA, the third raises MegatrainError naming the remedy.
"""

import pytest
import torch
import torch.nn.functional as F

from megatrain.errors import MegatrainError
from megatrain.models import attention


def test_flex_attention_stops_instead_of_running_uncompiled(monkeypatch):
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(attention, "FLEX_SHAPES", 2)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(11)

    def causal(b, h, q, k):
        return q >= k

    for T in (16, 32, 48):
        q, k, v = (torch.randn(1, 2, T, 16, generator=gen) for _ in range(3))
        bm = create_block_mask(causal, None, None, T, T, device="cpu")
        if T < 48:
            o = attention.flex_attention()(q, k, v, block_mask=bm)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-6)
        else:
            with pytest.raises(MegatrainError, match="2 different row shapes.*packing"):
                attention.flex_attention()(q, k, v, block_mask=bm)
    torch._dynamo.reset()


def test_flex_attention_stays_compiled_after_a_compiled_layer_traced_it(monkeypatch):
    """A compiled layer that calls flex_attention() first, then a direct call (as the probe, the tests and a layer
    that falls back to eager do): the direct call must compile its own frame. The wrapper made while dynamo traced
    the layer used to run FlexAttention uncompiled from then on (on the H200: 64 GiB of scores asked for)."""
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(attention, "_COMPILED", None)
    torch._dynamo.reset()
    T = 64
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, T, 16, generator=gen) for _ in range(3))
    bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device="cpu")

    def layer(q, k, v):
        return attention.flex_attention()(q, k, v, block_mask=bm)

    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(torch.compile(layer, dynamic=False)(q, k, v), ref, rtol=1e-5, atol=1e-6)
    frames = counters["frames"]["ok"]
    torch.testing.assert_close(attention.flex_attention()(q, k, v, block_mask=bm), ref, rtol=1e-5, atol=1e-6)
    assert counters["frames"]["ok"] > frames, "the direct call ran FlexAttention uncompiled"
    torch._dynamo.reset()


def test_the_block_mask_stops_instead_of_building_the_full_grid(monkeypatch):
    """create_block_mask(_compile=True) past dynamo's recompile limit ran eagerly, evaluating the mask over the whole
    T x T grid in int64 (128 GiB asked for at 131,072 tokens after a benchmark's earlier shapes): attention_context
    calls it through the same guard. Each mask function is compiled apart; past the limit: MegatrainError."""
    from torch.nn.attention.flex_attention import create_block_mask

    monkeypatch.setattr(attention, "FLEX_SHAPES", 2)
    torch._dynamo.reset()
    T = 256

    def causal(b, h, q, kv):
        return q >= kv

    def window(b, h, q, kv):
        return (q >= kv) & (kv > q - 16)

    def halves(b, h, q, kv):
        return (q >= kv) & ((q < T // 2) == (kv < T // 2))

    build = attention._guarded(create_block_mask)
    for n, allowed in enumerate((causal, window, halves)):
        if n < 2:
            bm = build(allowed, None, None, T, T, device="cpu", _compile=True)
            dense = create_block_mask(allowed, None, None, T, T, device="cpu")  # eager: the reference
            assert torch.equal(bm.to_dense(), dense.to_dense())
        else:
            with pytest.raises(MegatrainError, match="2 different row shapes.*packing"):
                build(allowed, None, None, T, T, device="cpu", _compile=True)
    torch._dynamo.reset()
