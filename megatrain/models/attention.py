"""Causal attention for the layer templates: the contexts (masks) a micro-batch's layers share, and one dispatch.

Unpacked rows with full causal attention run SDPA's causal kernel (FlashAttention on CUDA). Packed documents and
sliding windows: on CPU an explicit boolean [B, 1, T, T] mask (exact, small at test sizes); on CUDA the
variable-length flash kernel over the documents (models/varlen.py: segment offsets, no mask), or a FlexAttention
block mask, evaluated per 128 x 128 block, never a T x T tensor, where the score is not plain (Gemma 2's
soft-capping, gpt-oss's sinks) or where it measured faster (base.prefers_flex).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import AttnContext, prefers_flex
from .varlen import meta_segments, segments

_COMPILED = None
# Distinct input shapes (and masks) FlexAttention and its block mask are compiled for in one process. Past torch's
# recompile limit (8) dynamo would silently run them eagerly: FlexAttention then builds the full T x T score matrix
# in fp32 (256 GiB at 32k tokens and 64 heads), create_block_mask an int64 T x T grid (128 GiB at 131,072 tokens;
# both seen on the H200 after a benchmark's earlier shapes). Above this many, the run stops with a clear error.
FLEX_SHAPES = 256
# Whether attention_context on the meta device stands in the CUDA path (the variable-length kernel's segments) or
# the CPU's explicit mask (by default): the planner's memory simulation sets it to the device it plans for.
META_AS_CUDA = [False]
# FlexAttention's kernel_options where its defaults measured slower, by (score, head_dim), on Hopper (sm90: these
# tiles need its 227 KiB of shared memory per block). Gemma 2's soft-capped scores at head_dim 256 ran forward +
# backward 1.25x faster on 8 warps (forward 128 x 64 tiles in one stage, backward 64 x 64 in two) than on the
# defaults' 4 (bench/attention_kernels.py --softcap times both). ROWS_GUARANTEED_SAFE gave NaN over packed rows.
FLEX_OPTIONS_SM90 = {
    ("softcap", 256): {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 1,
                       "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                       "bwd_num_warps": 8, "bwd_num_stages": 2},
}


def _guarded(compiled):
    """`compiled` (a torch.compile'd function, or one that compiles inside) called with the recompile limit at
    FLEX_SHAPES, failing past it instead of running eagerly: a MegatrainError naming the remedy."""
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


def softcap_score(cap: float):
    """FlexAttention's score_mod for soft-capped scores, cap·tanh(s/cap), written as cap·(2·sigmoid(2s/cap) − 1):
    the same function (equal within fp32 rounding, tests/test_attention_softcap.py), which Triton computes with one
    exponential where its tanh (libdevice's) made the capped kernels 1.2x slower (bench/attention_kernels.py
    --softcap)."""
    two_over_cap = 2.0 / cap

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * (2 * torch.sigmoid(score * two_over_cap) - 1)

    return softcap


def flex_kernel_options(score: str, head_dim: int, device: torch.device) -> dict | None:
    """The kernel_options FlexAttention runs with for scores of `score` at `head_dim` on `device` (FLEX_OPTIONS_SM90
    on Hopper), or None: its own defaults."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        return None
    opts = FLEX_OPTIONS_SM90.get((score, head_dim))
    return dict(opts) if opts else None


def attention_context(position_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, packed: bool,
                      window: int | None, force_mask: bool = False, head_dim: int | None = None,
                      flex_options: dict | None = None) -> AttnContext:
    """An AttnContext: causal attention, within documents when rows are packed, over the last `window` positions
    (the query's own included, as transformers' sliding_window_overlay: kv > q - window) when a window is given.
    Unpacked rows no longer than the window need no mask (plain causal SDPA) unless `force_mask` (attention that
    SDPA cannot run, as soft-capped scores, needs one); `flex_options`: FlexAttention's kernel_options for that
    attention (flex_kernel_options)."""
    B, T = position_ids.shape
    if window is not None and T <= window:
        window = None  # the window reaches back further than the row: plain causal
    if not packed and window is None and not force_mask:
        return AttnContext(cos=cos, sin=sin, mask=None)
    if not force_mask and cos.dtype in (torch.bfloat16, torch.float16) and \
            (position_ids.is_meta and META_AS_CUDA[0] or position_ids.is_cuda and not prefers_flex(head_dim, T)):
        # the variable-length kernel (bf16, fp16: fp32 runs keep FlexAttention): a segment per document (packed)
        # or per row (a window only). The meta device stands it in for FlexAttention too: the same saved tensors,
        # and an fp32 d(q) accumulator FlexAttention's backward does not allocate (an upper bound)
        if position_ids.is_meta:
            cu, longest = meta_segments(B, T, position_ids.device)
        elif packed:
            cu, longest = segments(position_ids)
        else:
            cu, longest = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=position_ids.device), T
        return AttnContext(cos=cos, sin=sin, mask=None, window=window, cu_seqlens=cu, max_seqlen=longest)
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
        block = _guarded(create_block_mask)(allowed, B if packed else None, None, T, T, device=position_ids.device,
                                            _compile=True)
        return AttnContext(cos=cos, sin=sin, mask=None, block_mask=block, window=window, flex_options=flex_options)
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
    computes it explicitly elsewhere) changes the scaled scores before the mask. Plain causal rows longer than
    `ctx.attn_block` run `blockwise_causal` (the backward over blocks of queries and keys), which writes d(q) over
    the d(output) its backward is given: the layer's backward (runtime/layer.py) hands it a buffer it does not read
    again, as autograd does its own."""
    gqa = k.shape[1] != q.shape[1]
    if ctx.varlen and score_mod is None:
        from .varlen_call import varlen_call  # torch.compiler.disable imports dynamo: only when called

        return varlen_call(q, k, v, ctx, scale)
    if ctx.mask is None and ctx.block_mask is None and score_mod is None and 0 < ctx.attn_block < q.shape[2] \
            and not torch.compiler.is_compiling():
        return blockwise_causal(q, k, v, scale, ctx.attn_block, grad_in_place=True)
    if ctx.block_mask is not None:
        return flex_attention()(q, k, v, score_mod=score_mod, block_mask=ctx.block_mask, scale=scale,
                                enable_gqa=gqa, kernel_options=ctx.flex_options)
    if score_mod is not None:
        raise ValueError("a score_mod needs a FlexAttention block mask (a CUDA context built with force_mask)")
    if ctx.mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, scale=scale, enable_gqa=gqa)


# ---- plain causal attention whose backward runs over blocks (memory.attn_block) --------------------------------
# The fused flash backward over a whole row allocates, besides d(q), d(k), d(v), an fp32 accumulator for d(q) as
# large as q in fp32 and, with grouped KV heads, d(k) and d(v) expanded to every query head: at 524,288 tokens of a
# 32-head, 8-KV-head layer 8 + 4 + 4 GiB on top of q, k, v, the output and d(output). Its gradients decompose over
# blocks of queries (i) and keys (j <= i): with P = exp(q_i·k_jᵀ·scale − lse_i) and D_i = rowsum(dO_i ∘ O_i), where
# O and lse are the whole row's output and log-sum-exp,
#     dV_j += P_ijᵀ·dO_i,   dS_ij = P_ij ∘ (dO_i·V_jᵀ − D_i),   dQ_i += dS_ij·K_j·scale,   dK_j += dS_ijᵀ·Q_i·scale
# which is exactly what a fused backward kernel computes for one (q block, k block) pair when it is given the
# row's O_i and lse_i (a diagonal pair causal, a pair below the diagonal unmasked): the pieces ring attention sums.
# So the backward runs the kernel pair by pair, summing in fp32, and its working set is one pair's plus the fp32
# sums of d(k) and d(v) (kv heads only) and of one block's d(q). The forward is the kernel over the whole row (it
# needs no more than q, k, v and its output). What differs from the fused kernel: each pair's gradient is rounded
# to the input dtype before the fp32 sum (the fused kernel sums in fp32 and rounds once). In
# bf16, 8,192 tokens in blocks of 1,024, against a float64 truth: d(q), d(k), d(v) off by 2.6e-3, 3.4e-3, 3.3e-3,
# SDPA's by 2.5e-3, 3.0e-3, 2.9e-3 (tests/gpu/test_blockwise_cuda.py). On CUDA the kernels are the ones SDPA
# itself picks for the whole row (`blocked_kernel`): cuDNN's fused attention on Hopper, whose backward takes the row's
# output and log-sum-exp the same way, else the flash op. On the H200 the blocked forward + backward with cuDNN runs
# at SDPA's speed (537 / 530 TFLOP/s against 541 / 530 at 131,072 / 262,144 tokens in blocks of 65,536); the flash
# op's ran 323 / 320 (bench/blocked_attention.py; planner/calibration.py: BLOCKED_ATTENTION_SLOWDOWN).


def blocked_kernel(q, k, v, scale: float) -> str:
    """Which fused kernel the blocked attention runs on CUDA: "cudnn" where SDPA itself would run cuDNN's attention
    for this causal row (Hopper), else "flash" (the flash op, which takes grouped KV heads as they are)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        return "cudnn" if int(choice) == int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION) else "flash"
    except (AttributeError, RuntimeError, TypeError):  # a private probe: where it moved or refuses, the flash op
        return "flash"


def _flash_forward(q, k, v, scale: float, causal: bool):
    """(output [B, heads, T, d] laid out [B, T, heads, d] as the kernels write it, fp32 log-sum-exp [B, heads, T],
    what the CUDA backward needs besides them: the kernel's name first)."""
    if q.is_meta:  # the planner's memory simulation: the kernel's allocations
        B, h, T, d = q.shape
        return (q.new_empty(B, T, h, d).transpose(1, 2), q.new_empty(B, h, T, dtype=torch.float32), ())
    if q.is_cuda:
        if q.dtype not in (torch.bfloat16, torch.float16):  # the planner refuses memory.attn_block for such runs
            raise ValueError(f"the attention blocked for its backward runs a fused kernel, which takes bf16 or "
                             f"fp16 on CUDA, not {q.dtype} (memory.attn_block: 0)")
        if blocked_kernel(q, k, v, scale) == "cudnn":
            o, lse, cq, ck, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
                q, k, v, None, True, 0.0, causal, False, scale=scale)
            return o, lse.reshape(q.shape[:3]), ("cudnn", cq, ck, seed, offset)  # its lse: [B, heads, T, 1]
        o, lse, cq, ck, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale)
        return o, lse, ("flash", cq, ck, seed, offset)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return o, lse, ()


def _flash_backward(do, q, k, v, o, lse, scale: float, causal: bool, extra):
    """(dq, dk, dv) of one block pair from the row's output and log-sum-exp slices (kv heads for dk, dv)."""
    if q.is_meta:  # what the CUDA kernel allocates: an fp32 d(q) accumulator, per-query-head d(k), d(v) with
        B, h, Tq, d = q.shape  # grouped KV heads, then its outputs
        work = [q.new_empty(B, Tq, h, d, dtype=torch.float32), q.new_empty(B, h, Tq, dtype=torch.float32)]
        if k.shape[1] != h:
            work += [k.new_empty(B, k.shape[2], h, d), k.new_empty(B, k.shape[2], h, d)]
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        del work
        return out
    if q.is_cuda:
        kernel, cq, ck, seed, offset = extra
        if kernel == "cudnn":  # no bias: None reaches the op as the undefined tensor autograd passes
            return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                do, q, k, v, o, lse.unsqueeze(-1), seed, offset, None, cq, ck, q.shape[2], k.shape[2], 0.0, causal,
                scale=scale)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do, q, k, v, o, lse, cq, ck, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, o, lse, 0.0, causal,
                                                                                scale=scale)


def attention_blocks(T: int, block: int) -> list[tuple[int, int]]:
    """[start, end) blocks of `block` tokens over a row of T (the last one shorter)."""
    return [(s, min(s + block, T)) for s in range(0, T, block)]


def blockwise_backward(do, q, k, v, o, lse, block: int, pair, dq=None):
    """d(q), d(k), d(v) of causal attention from the row's output `o` and log-sum-exp `lse` [B, heads, T] and
    d(output) `do`, over (query block, key block) pairs of `block` tokens: `pair(do_i, q_i, k_j, v_j, o_i, lse_i,
    causal)` gives one pair's (dq, dk, dv) (kv heads for dk, dv), summed here in fp32 (see above). The results are
    laid out [B, T, heads, d] as q, k, v are; `dq`: where d(q) goes (a buffer laid out so; block i is written once
    block i's pairs are done, so it may be `do` itself)."""
    B, h, T, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    if dq is None:
        dq = q.new_empty(B, T, h, d).transpose(1, 2)
    dk = torch.zeros(B, T, k.shape[1], d, dtype=acc, device=k.device).transpose(1, 2)
    dv = torch.zeros(B, T, v.shape[1], d, dtype=acc, device=v.device).transpose(1, 2)
    blocks = attention_blocks(T, block)
    for i, (qs, qe) in enumerate(blocks):
        do_i, q_i, o_i, lse_i = do[:, :, qs:qe], q[:, :, qs:qe], o[:, :, qs:qe], lse[:, :, qs:qe].contiguous()
        dq_i = None
        for j, (ks, ke) in enumerate(blocks[:i + 1]):
            gq, gk, gv = pair(do_i, q_i, k[:, :, ks:ke], v[:, :, ks:ke], o_i, lse_i, i == j)
            dq_i = gq.to(acc) if dq_i is None else dq_i.add_(gq)
            dk[:, :, ks:ke].add_(gk)
            dv[:, :, ks:ke].add_(gv)
            del gq, gk, gv
        dq[:, :, qs:qe] = dq_i
        del dq_i, lse_i
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _BlockwiseCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, block: int, grad_in_place: bool):
        o, lse, extra = _flash_forward(q, k, v, scale, True)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale, ctx.block, ctx.extra, ctx.in_place = scale, block, extra, grad_in_place
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        scale, extra = ctx.scale, ctx.extra
        # d(q) over d(output) when allowed and laid out as q: block i's d(output) is read by block i's pairs only
        same = do.dtype == q.dtype and do.shape == q.shape and do.transpose(1, 2).is_contiguous()

        def pair(do_i, q_i, k_j, v_j, o_i, lse_i, causal):
            return _flash_backward(do_i, q_i, k_j, v_j, o_i, lse_i, scale, causal, extra)

        dq, dk, dv = blockwise_backward(do, q, k, v, o, lse, ctx.block, pair,
                                        dq=do if ctx.in_place and same else None)
        return dq, dk, dv, None, None, None


def blockwise_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block: int,
                     grad_in_place: bool = False) -> torch.Tensor:
    """Causal attention (grouped KV heads shared) over q [B, heads, T, d], k and v [B, kv_heads, T, d], the flash
    kernel's forward over the whole row, its backward over (query block, key block) pairs of `block` tokens (see
    above): CUDA, CPU and the meta device (the kernel's allocations, for the planner). `grad_in_place`: the
    backward may write d(q) over the d(output) it is given (one row-sized buffer less; its caller must not read
    that gradient again)."""
    return _BlockwiseCausal.apply(q, k, v, scale, int(block), bool(grad_in_place))


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
