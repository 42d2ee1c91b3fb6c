"""The variable-length attention (models/varlen.py) against the dense masked reference, in float64 on CPU: the
segments read off position_ids, the whole-row function and its backward over block pairs (long packed rows), and
the planner's packed-row terms against what the CUDA path allocates on the meta device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatrain.models.attention import attention_context
from megatrain.models.varlen import segments, varlen_attention


def packed_positions(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = [torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row]
    return torch.stack(rows)


def dense_reference(q, k, v, pos, scale, window=None):
    """softmax with the explicit boolean mask (the CPU path's own, attention_context) through SDPA's math."""
    B, T = pos.shape
    ctx = attention_context(pos, torch.ones(B, T, 1), torch.ones(B, T, 1), packed=True, window=window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def inputs(B, T, h, kvh, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, h, d, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, kvh, d, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, kvh, d, dtype=torch.float64, generator=g).transpose(1, 2).requires_grad_()
    do = torch.randn(B, h, T, d, dtype=torch.float64, generator=g)
    return q, k, v, do


def grads(out, do, *xs):
    return torch.autograd.grad(out, xs, do)


def test_segments_start_at_every_document_and_row():
    pos = packed_positions([[3, 5, 2], [10]])
    cu, longest = segments(pos)
    assert cu.tolist() == [0, 3, 8, 10, 20] and cu.dtype == torch.int32 and longest == 10
    pos[1, 0] = 4  # a row that continues a document: still a row start
    assert segments(pos)[0].tolist() == [0, 3, 8, 10, 20]


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kvh", [4, 2])
def test_varlen_equals_the_dense_masked_reference(kvh, window):
    pos = packed_positions([[7, 12, 1, 4], [24]])
    q, k, v, do = inputs(2, 24, 4, kvh, 8)
    cu, longest = segments(pos)
    out = varlen_attention(q, k, v, cu, longest, 0.3, window)
    ref = dense_reference(q, k, v, pos, 0.3, window)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, do, q, k, v), grads(ref, do, q, k, v)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("block", [5, 8, 16, 40])
@pytest.mark.parametrize("lengths", [[[7, 12, 1, 20]], [[40]], [[3, 30, 7], [9, 9, 9, 13]]])
def test_blockwise_varlen_backward_equals_the_dense_masked_reference(lengths, block):
    """Block pairs: diagonal ones over the documents inside the block, earlier ones one dense rectangle of the
    document they share, or none; documents crossing one, two or no block boundaries."""
    pos = packed_positions(lengths)
    B, T = pos.shape
    q, k, v, do = inputs(B, T, 4, 2, 8, seed=block)
    cu, longest = segments(pos)
    out = varlen_attention(q, k, v, cu, longest, 0.3, block=block)
    ref = dense_reference(q, k, v, pos, 0.3)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, b in zip(grads(out, do, q, k, v), grads(ref, do, q, k, v)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_blockwise_varlen_may_write_dq_over_the_output_gradient():
    pos = packed_positions([[10, 14]])
    q, k, v, do = inputs(1, 24, 4, 2, 8)
    cu, longest = segments(pos)
    ref = grads(dense_reference(q, k, v, pos, 0.3), do, q, k, v)
    buf = do.transpose(1, 2).contiguous().transpose(1, 2)  # laid out as q: d(q) may go over it
    got = grads(varlen_attention(q, k, v, cu, longest, 0.3, block=8, grad_in_place=True), buf, q, k, v)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert got[0].data_ptr() == buf.data_ptr()


def test_cuda_and_meta_contexts_carry_segments_not_masks():
    pos = packed_positions([[3, 5]])
    cpu = attention_context(pos, pos, pos, packed=True, window=None)
    assert cpu.mask is not None and not cpu.varlen  # CPU keeps the explicit mask (CI's reference path)
    from megatrain.models import attention

    rope = torch.ones(2, 16, 8, dtype=torch.bfloat16, device="meta")
    meta_pos = torch.zeros(2, 16, dtype=torch.long, device="meta")
    assert attention_context(meta_pos, rope, rope, packed=True, window=None).mask is not None  # the CPU path's
    attention.META_AS_CUDA[0] = True  # as the planner sets it planning for CUDA (planner/activations.py)
    try:
        meta = attention_context(meta_pos, rope, rope, packed=True, window=None)
    finally:
        attention.META_AS_CUDA[0] = False
    assert meta.mask is None and meta.block_mask is None and meta.varlen and meta.max_seqlen == 16
    assert tuple(meta.cu_seqlens.shape) == (3,)


def test_packed_rows_planned_on_cuda_count_the_segments_not_a_mask():
    """The planner's packed-row context bytes (planner/activations.mask_bytes): on CUDA with the varlen kernel the
    int32 segment offsets `segments` allocates for a row whose every token starts a document (its most); on CPU the
    boolean T x T mask the CPU path allocates."""
    from conftest import tiny_hf_config

    from megatrain.models import get_adapter
    from megatrain.planner.activations import mask_bytes

    adapter = get_adapter(tiny_hf_config("llama"))
    rows, T = 2, 65536  # long rows: the varlen kernel at any head_dim (base.FLEX_PACKED_TOKENS)
    assert adapter.cuda_attention("full", T, True) == ("varlen", "plain")
    cu, _ = segments(torch.zeros(rows, T, dtype=torch.long))
    assert mask_bytes(adapter, rows, T, packed=True, cuda=True) == cu.nbytes
    small = packed_positions([[3, 5], [8]])
    cpu = attention_context(small, small, small, packed=True, window=None)
    assert mask_bytes(adapter, 2, 8, packed=True, cuda=False) == cpu.mask.untyped_storage().nbytes()
    assert mask_bytes(adapter, rows, T, packed=False, cuda=True) == 0
