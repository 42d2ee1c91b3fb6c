"""Causal attention for the layer templates: the contexts (masks) a micro-batch's layers share, and one dispatch.

Unpacked rows with full causal attention run SDPA's causal kernel (FlashAttention on CUDA). Packed documents and
sliding windows need a mask: on CPU an explicit boolean [B, 1, T, T] (exact, small at test sizes); on CUDA a
FlexAttention block mask, evaluated per 128 x 128 block, never a T x T tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttnContext

_COMPILED = None


def flex_attention():
    """FlexAttention, compiled once: uncompiled it would materialise the full score matrix."""
    global _COMPILED
    if _COMPILED is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def attention_context(position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: bool,
                      window: int | None, force_mask: bool = False) -> AttnContext:
    """An AttnContext: causal attention, within documents when rows are packed, over the last `window` positions
    (the query's own included, as transformers' sliding_window_overlay: kv > q - window) when a window is given.
    Unpacked rows no longer than the window need no mask (plain causal SDPA) unless `force_mask` (attention that
    SDPA cannot run, as soft-capped scores, needs one)."""
    B, T = position_ids.shape
    if window is not None and T <= window:
        window = None  # the window reaches back further than the row: plain causal
    if not packed and window is None and not force_mask:
        return AttnContext(cos=cos, sin=sin, mask=None)
    # A new document starts wherever the position restarts at 0: attend only within it, causally.
    doc = torch.cumsum((position_ids == 0).int(), dim=1) if packed else None
    if position_ids.is_cuda:
        # FlexAttention: block-sparse, fused, GQA-aware; the mask is evaluated per 128x128 block, never as a
        # T x T tensor. (Its backward does not run on CPU, where the explicit mask below is exact and small.)
        from torch.nn.attention.flex_attention import create_block_mask

        if packed and window is not None:
            def allowed(b, h, q, kv):
                return (doc[b, q] == doc[b, kv]) & (q >= kv) & (kv > q - window)
        elif packed:
            def allowed(b, h, q, kv):
                return (doc[b, q] == doc[b, kv]) & (q >= kv)
        elif window is not None:
            def allowed(b, h, q, kv):
                return (q >= kv) & (kv > q - window)
        else:
            def allowed(b, h, q, kv):
                return q >= kv

        # _compile: evaluated block by block; eagerly it would build the T x T grid (measured: +8 GiB at 32k)
        block = create_block_mask(allowed, B if packed else None, None, T, T, device=position_ids.device,
                                  _compile=True)
        return AttnContext(cos=cos, sin=sin, mask=None, block_mask=block, window=window)
    q = torch.arange(T, device=position_ids.device)
    mask = (q[:, None] >= q[None, :])[None, None]
    if window is not None:
        mask = mask & (q[None, :] > q[:, None] - window)[None, None]
    if packed:
        mask = mask & (doc[:, :, None] == doc[:, None, :])[:, None]
    return AttnContext(cos=cos, sin=sin, mask=mask.expand(B, 1, T, T), window=window)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, scale: float,
                     score_mod=None) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask)·v for q [B, heads, T, d], k and v [B, kv_heads, T, d] (grouped-query heads
    shared), causal, within `ctx`'s documents and window. `score_mod` (FlexAttention's, CUDA only: the caller
    computes it explicitly elsewhere) changes the scaled scores before the mask."""
    gqa = k.shape[1] != q.shape[1]
    if ctx.block_mask is not None:
        return flex_attention()(q, k, v, score_mod=score_mod, block_mask=ctx.block_mask, scale=scale,
                                enable_gqa=gqa)
    if score_mod is not None:
        raise ValueError("a score_mod needs a FlexAttention block mask (a CUDA context built with force_mask)")
    if ctx.mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, scale=scale, enable_gqa=gqa)
