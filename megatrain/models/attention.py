"""Causal attention for the layer templates: the contexts (masks) a micro-batch's layers share, and one dispatch.

Unpacked rows with full causal attention run SDPA's causal kernel (FlashAttention on CUDA). Packed documents and
sliding windows need a mask: on CPU an explicit boolean [B, 1, T, T] (exact, small at test sizes); on CUDA a
FlexAttention block mask, evaluated per 128 x 128 block, never a T x T tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import AttnContext

_COMPILED = None
# Distinct input shapes (and masks) FlexAttention is compiled for in one process. Past torch's recompile limit (8)
# dynamo would silently run FlexAttention eagerly, which builds the full T x T score matrix in fp32 (256 GiB at
# 32k tokens and 64 heads: seen on the H200 on 2026-11-25, after a test file's earlier shapes). Above this many,
# the run stops with a clear error instead.
FLEX_SHAPES = 256


def _guarded(compiled):
    def call(*args, **kwargs):
        from torch._dynamo import config

        try:
            with config.patch(recompile_limit=FLEX_SHAPES, fail_on_recompile_limit_hit=True):
                return compiled(*args, **kwargs)
        except Exception as e:
            if type(e).__name__ not in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit"):
                raise
            raise MegatrainError(
                f"FlexAttention was compiled for {FLEX_SHAPES} different row shapes in this run and would now run "
                "uncompiled, building the full T x T score matrix; give the rows fewer distinct lengths "
                "(data.packing: true, or a fixed data.max_seq_len with packing)") from e
    return call


def flex_attention():
    """FlexAttention, compiled (never run uncompiled: that would materialise the full score matrix). Inside a
    compiled layer, the plain function: dynamo traces it into the layer's graph. The compiled wrapper is made only
    outside tracing: made while dynamo traced a layer, it ran uncompiled ever after (seen on CPU and on the H200:
    a later direct call materialised the T x T scores)."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention as plain

    if torch.compiler.is_compiling():
        return plain
    if _COMPILED is None:
        _COMPILED = _guarded(torch.compile(plain, dynamic=False))
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


# ---- attention sinks (gpt_oss) -------------------------------------------------------------------------------------
# A sink is a learned logit s per head that joins every query's softmax denominator but has no value:
# o' = Σ_j exp(x_j) v_j / (Σ_j exp(x_j) + exp(s)). With o the plain attention output and lse = log Σ_j exp(x_j),
# o' = o · Z / (Z + e^s) = o · σ(lse − s). So a kernel that returns its log-sum-exp computes sink attention without
# any T x T tensor, and autograd through o, lse and s gives the exact gradient (d lse/d x_j is the softmax row).

def apply_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """o [B, heads, T, d] and its fp32 log-sum-exp lse [B, heads, T] -> o · σ(lse − sinks) (fp32 factor)."""
    return o * torch.sigmoid(lse - sinks.float()[:, None]).unsqueeze(-1).to(o.dtype)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext, scale: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q·kᵀ·scale + mask)·v, log-sum-exp of the masked scaled scores [B, heads, T] fp32), differentiable in
    both. CUDA: FlexAttention with `ctx`'s block mask (its backward takes the log-sum-exp's gradient). The meta device
    (the planner's memory simulation) stands in the fused kernel's allocations: the output and an fp32 [B, heads, T]."""
    if ctx.block_mask is not None:
        try:
            from torch.nn.attention.flex_attention import AuxRequest

            want = {"return_aux": AuxRequest(lse=True)}
        except ImportError:  # torch before AuxRequest: the older keyword
            want = {"return_lse": True}
        gqa = k.shape[1] != q.shape[1]
        o, aux = flex_attention()(q, k, v, block_mask=ctx.block_mask, scale=scale, enable_gqa=gqa, **want)
        return o, getattr(aux, "lse", aux)
    if q.is_meta:
        return causal_attention(q, k, v, ctx, scale), q.new_empty(q.shape[:-1], dtype=torch.float32)
    raise ValueError("attention with its log-sum-exp needs a FlexAttention block mask (a CUDA context built with "
                     "force_mask); on CPU use sink_attention_explicit")


def sink_attention_explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
                            mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Sink attention as transformers' gpt_oss eager_attention_forward computes it (exact, T x T: CPU): scores,
    mask, the sink logit appended as a last column, minus the row max, softmax in the scores' dtype, sink column
    dropped, times v. mask: bool [B, 1, T, T] (True = may attend), or None for plain causal."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    T = q.shape[2]
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    B, H = q.shape[:2]
    logits = torch.cat([scores, sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(B, H, T, 1)], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, ctx: AttnContext,
                   scale: float) -> torch.Tensor:
    """Causal attention whose softmax denominators also hold exp(sinks[h]) (gpt_oss), within `ctx`'s documents and
    window: on CUDA (and the meta device) from the kernel's log-sum-exp (`apply_sinks`), never a T x T tensor; on
    CPU explicitly, as transformers."""
    if ctx.block_mask is not None or q.is_meta:
        o, lse = attention_with_lse(q, k, v, ctx, scale)
        return apply_sinks(o, lse, sinks)
    return sink_attention_explicit(q, k, v, sinks, ctx.mask, scale)
