"""Variable-length causal attention: packed documents (and sliding windows) on CUDA without a mask.

A micro-batch's rows are laid end to end as one sequence of B·T tokens, cut into segments where a document starts
(position 0) or a row starts: `cu_seqlens` (int32, the segments' start offsets and the total last). FlashAttention-2's
variable-length kernel (torch.ops.aten._flash_attention_forward / _backward with cum_seq_q/k) attends causally
within each segment, grouped-query heads natively, a window through window_size_left = W - 1: no T x T mask, no
block mask, and no work on the masked-out pairs. It runs where a layer's score is plain (not Gemma 2's soft-capping,
not gpt-oss's sinks: those keep FlexAttention) (bench/attention_kernels.py).

`varlen_attention` is an autograd.Function over the aten forward and backward ops: CUDA runs them; the meta device
(the planner's memory simulation) allocates what they allocate; CPU (tests, no such kernel) computes the same
function segment by segment with SDPA, exactly (float64 where asked).

Long packed rows (memory.attn_block) run the backward over (query block, key block) pairs, as plain rows do
(models/attention.blockwise_backward): documents are contiguous, so a query block i and an earlier key block j share
at most one document, the one that holds both the last key of j and the first query of i; the pair is one dense
rectangle of it (a non-causal pair call on sub-slices) or nothing. A diagonal pair is the varlen kernel over the
documents inside the block.
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F


def segments(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens int32 [segments + 1] over the rows laid end to end, the longest segment) of position_ids [B, T]:
    a segment starts at every position 0 and at every row's first token. One host sync (the longest segment)."""
    B, T = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1)
    cu = torch.cat([idx, idx.new_full((1,), B * T)]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def meta_segments(B: int, T: int, device) -> tuple[torch.Tensor, int]:
    """What `segments` returns on the meta device (shapes only): one segment per row."""
    return torch.empty(B + 1, dtype=torch.int32, device=device), T


def _window_args(window: int | None) -> dict:
    return {} if window is None else {"window_size_left": int(window) - 1, "window_size_right": 0}


def _pairs(cu_q, cu_k):
    return list(zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]))


def _seg(t, s, e):
    """Rows s:e of a flat [N, heads, d] tensor as [1, heads, e - s, d]."""
    return t[s:e].transpose(0, 1)[None]


def _reference(q, k, v, cu_q, cu_k, scale: float, window: int | None, causal: bool):
    """The varlen function on CPU with a window, segment by segment through SDPA's math (exact; no log-sum-exp)."""
    out = torch.empty_like(q)
    for qs, qe, ks, ke in _pairs(cu_q, cu_k):
        i, j = torch.arange(qe - qs)[:, None], torch.arange(ke - ks)[None, :]
        mask = (i >= j) if causal else torch.ones(qe - qs, ke - ks, dtype=torch.bool)
        if window is not None:
            mask = mask & (j > i - window)
        o = F.scaled_dot_product_attention(_seg(q, qs, qe), _seg(k, ks, ke), _seg(v, ks, ke), attn_mask=mask,
                                           scale=scale, enable_gqa=k.shape[1] != q.shape[1])
        out[qs:qe] = o[0].transpose(0, 1)
    return out


def varlen_forward(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, window: int | None = None,
                   causal: bool = True):
    """(output [N, heads, d], fp32 log-sum-exp [heads, N], what the backward needs besides) for flat q [N, heads, d],
    k, v [M, kv_heads, d] and segment offsets `cu_q`, `cu_k` (segment s: queries cu_q[s]:cu_q[s+1] over keys
    cu_k[s]:cu_k[s+1]). CPU: the CPU flash kernel per segment (a window: SDPA's math, no log-sum-exp)."""
    if q.is_meta:
        return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32), ()
    if q.is_cuda:
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, **_window_args(window))
        return o, lse, (rng, unused)
    if window is not None:
        return _reference(q, k, v, cu_q, cu_k, scale, window, causal), None, ()
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=acc)
    for qs, qe, ks, ke in _pairs(cu_q, cu_k):
        o, l = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            _seg(q, qs, qe), _seg(k, ks, ke), _seg(v, ks, ke), 0.0, causal, scale=scale)
        out[qs:qe], lse[:, qs:qe] = o[0].transpose(0, 1), l[0]
    return out, lse, ()


def varlen_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, window: int | None,
                    extra, causal: bool = True):
    """(dq, dk, dv) of varlen_forward (flat layouts) for d(output) `do`, from its output `o` and log-sum-exp `lse`
    (which may be another call's: a block pair's slices of the whole row's, as blockwise_varlen gives)."""
    if q.is_meta:  # the kernel's allocations: an fp32 d(q) accumulator (and its row sums) padded by 128 rows per
        N, h, d = q.shape  # segment, per-query-head d(k), d(v) with grouped KV heads, then its outputs
        pad = N + 128 * (cu_q.shape[0] - 1)
        work = [q.new_empty(pad, h, d, dtype=torch.float32), q.new_empty(h, pad, dtype=torch.float32)]
        if k.shape[1] != h:
            work += [k.new_empty(k.shape[0], h, d), k.new_empty(k.shape[0], h, d)]
        out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        del work
        return out
    if q.is_cuda:
        rng, unused = extra
        return torch.ops.aten._flash_attention_backward(
            do.contiguous(), q, k, v, o, lse.contiguous(), cu_q, cu_k, max_q, max_k, 0.0, causal, rng, unused,
            scale=scale, **_window_args(window))
    if lse is None:  # a window on CPU: autograd through the reference
        with torch.enable_grad():
            qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
            out = _reference(qq, kk, vv, cu_q, cu_k, scale, window, causal)
            return torch.autograd.grad(out, (qq, kk, vv), do)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for qs, qe, ks, ke in _pairs(cu_q, cu_k):
        g = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _seg(do, qs, qe), _seg(q, qs, qe), _seg(k, ks, ke), _seg(v, ks, ke), _seg(o, qs, qe),
            lse[:, qs:qe][None].contiguous(), 0.0, causal, scale=scale)
        for acc, gi, s, e in zip((dq, dk, dv), g, (qs, ks, ks), (qe, ke, ke)):
            acc[s:e] += gi[0].transpose(0, 1)
    return dq, dk, dv


def flat(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, d] -> [B·T, heads, d] (a view when t is a transpose of a [B, T, heads, d] buffer)."""
    B, h, T, d = t.shape
    return t.transpose(1, 2).reshape(B * T, h, d)


def blockwise_varlen_backward(do, q, k, v, o, lse, bounds: list[int], block: int, scale: float, extra, dq=None):
    """d(q), d(k), d(v) (flat layouts) of causal attention within the segments `bounds` (cu_seqlens as a list) from
    the whole sequence's output `o` and log-sum-exp `lse` [heads, N], over (query block, key block) pairs of `block`
    tokens (see the module docstring), each pair's gradients summed in fp32 as models/attention.blockwise_backward
    does. `dq`: where d(q) goes (block i written once its pairs are done: it may be `do` itself)."""
    N = q.shape[0]
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.empty_like(q) if dq is None else dq
    dk, dv = torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)
    blocks = [(s, min(s + block, N)) for s in range(0, N, block)]

    def offsets(cut: list[int]) -> torch.Tensor:
        return torch.tensor(cut, dtype=torch.int32).to(q.device, non_blocking=True)

    for i, (qs, qe) in enumerate(blocks):
        cut = [qs] + [b for b in bounds if qs < b < qe] + [qe]  # the diagonal pair: the segments inside block i
        longest = max(b - a for a, b in zip(cut, cut[1:]))
        cu = offsets([c - qs for c in cut])
        pairs = [(qs, qe, qs, qe, cu, cu, longest, longest, True)]
        seg = bisect.bisect_right(bounds, qs) - 1  # the only segment reaching back from block i into earlier ones
        first, end = bounds[seg], bounds[seg + 1]
        if first < qs:
            q1 = min(qe, end)
            for ks, ke in blocks[:i]:
                if ke > first:  # a dense rectangle: those queries see every key of it
                    k0 = max(ks, first)
                    pairs.append((qs, q1, k0, ke, offsets([0, q1 - qs]), offsets([0, ke - k0]), q1 - qs, ke - k0,
                                  False))
        dq_i = torch.zeros(qe - qs, *q.shape[1:], dtype=acc, device=q.device)
        for q0, q1, k0, k1, cu_q, cu_k, max_q, max_k, causal in pairs:
            gq, gk, gv = varlen_backward(do[q0:q1], q[q0:q1], k[k0:k1], v[k0:k1], o[q0:q1], lse[:, q0:q1], cu_q,
                                         cu_k, max_q, max_k, scale, None, extra, causal)
            dq_i[q0 - qs:q1 - qs].add_(gq)
            dk[k0:k1].add_(gk)
            dv[k0:k1].add_(gv)
            del gq, gk, gv
        dq[qs:qe] = dq_i
        del dq_i
    return dq, dk.to(k.dtype), dv.to(v.dtype)


class _Varlen(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float, window, block: int, grad_in_place: bool):
        B, h, T, d = q.shape
        qf, kf, vf = flat(q), flat(k), flat(v)
        o, lse, extra = varlen_forward(qf, kf, vf, cu, cu, max_len, max_len, scale, window)
        ctx.save_for_backward(qf, kf, vf, o, *(() if lse is None else (lse,)))
        ctx.cu, ctx.max_len, ctx.scale, ctx.window, ctx.extra, ctx.shape = cu, max_len, scale, window, extra, (B, T)
        ctx.block, ctx.in_place = block, grad_in_place
        return o.view(B, T, h, d).transpose(1, 2)

    @staticmethod
    def backward(ctx, do):
        qf, kf, vf, o, *lse = ctx.saved_tensors
        B, T = ctx.shape
        dof = flat(do)
        if ctx.block:  # over block pairs (see the module docstring); the meta device: one document per row
            bounds = list(range(0, B * T + 1, T)) if ctx.cu.is_meta else ctx.cu.tolist()
            same = do.dtype == qf.dtype and do.transpose(1, 2).is_contiguous()  # dof: a view of do
            dq, dk, dv = blockwise_varlen_backward(dof, qf, kf, vf, o, lse[0], bounds, ctx.block, ctx.scale, ctx.extra,
                                                   dq=dof if ctx.in_place and same else None)
        else:
            dq, dk, dv = varlen_backward(dof, qf, kf, vf, o, lse[0] if lse else None, ctx.cu, ctx.cu, ctx.max_len,
                                         ctx.max_len, ctx.scale, ctx.window, ctx.extra)
        return (*(g.view(B, T, *g.shape[1:]).transpose(1, 2) for g in (dq, dk, dv)), None, None, None, None, None,
                None)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                     scale: float, window: int | None = None, block: int = 0, grad_in_place: bool = False
                     ) -> torch.Tensor:
    """Causal attention within the segments `cu` (see `segments`) of q [B, heads, T, d] over k, v [B, kv_heads, T,
    d], over the last `window` positions (the query's own included) when given. Returns [B, heads, T, d].
    `block` (0 < block < T, no window): the backward over pairs of blocks of that many tokens (memory.attn_block);
    `grad_in_place`: it may write d(q) over the d(output) it is given (as models/attention.blockwise_causal)."""
    blocked = window is None and 0 < block < q.shape[2]
    return _Varlen.apply(q, k, v, cu, int(max_len), float(scale), window, int(block) if blocked else 0,
                         bool(grad_in_place))
