"""One decoder layer as the engine runs it, for one micro-batch: its forward (the forward wave, rebuilds) and its
backward (recompute from the layer's input checkpoint, local autograd, fp32 gradient accumulation). Plain functions
and one small class, so the engine, the probe (which times them) and the planner (which measures their memory on
the meta device) all run the same code.

Sequence tiling (`memory.seq_tile`, Placement.seq_tile): a layer is attention over the whole row plus work done
token by token. The adapter splits it (models/decoder.py): `qkv` (norm, q/k/v projections, q/k norms, rope), `attend`
(the attention over the row), `attn_out` (o_proj, post-norms, residual), then `mlp_part` (norm, MLP or routed
experts, residual). With a tile of t tokens every per-token piece runs over the micro-batch's B·T tokens t at a time:
the forward computes q, k, v tile by tile into [B·T, heads, head_dim] buffers, attends, then runs attn_out and the
MLP tile by tile into the output. The backward (TiledLayer.backward) recomputes q, k, v without autograd, runs the
attention with autograd over them, then per tile recomputes attn_out + MLP and backpropagates it (d(attention
output), and d(input) through the residual), runs the attention's backward, and per tile recomputes q, k, v and
backpropagates them. The layer's working set is the attention's q, k, v, output and their gradients plus one tile:
never [B·T, intermediate], nor the norms' fp32 copies of [B·T, hidden]. d(input) is written over d(output), which
is spent tile by tile.

What is exactly the same as the whole layer, in fp32 on CPU: the output and d(input), bit for bit. Each tile's rows
are the same rows of the whole GEMMs (CPU BLAS computes a row of a product independently of the other rows once a
product has more than a few rows; `token_tiles` never makes a tile of fewer than half a tile), and d(input) sums the
residual's gradient and q, k, v's in the order the whole layer's autograd does (the residual enters through a node
made last, which autograd runs first). The weight gradients are sums over tokens, reduced tile by tile instead of in
one GEMM: the same sums in another order (relative difference ~2e-7 in fp32; tests/test_tiling.py measures it). A
MoE layer's experts run over the tokens routed to them: a tile gives an expert fewer rows, and CPU BLAS computes a
product of a few rows with another kernel, so there the tiled output can differ from the whole one in the last bit.
An adapter whose attention does not split (it overrides attention_part or attention_block) runs its attention part
whole and only the MLP part over tiles.
"""

from __future__ import annotations

from typing import Callable

import torch


def token_tiles(n: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) ranges over n tokens: tiles of `tile` tokens, a remainder shorter than half a tile joined to the
    last one; one range when `tile` is 0 or covers them all."""
    if not tile or tile >= n:
        return [(0, n)]
    starts = list(range(0, n, tile))
    if n - starts[-1] < (tile + 1) // 2:
        starts.pop()
    return list(zip(starts, starts[1:] + [n]))


def _whole_backward(layer_fn: Callable, w, checkpoint, ctx, dh, grad_views, extra_grad) -> torch.Tensor:
    params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    x = checkpoint.detach().requires_grad_(True)
    with torch.enable_grad():
        out = layer_fn(params, x, ctx)
        outs, douts = (out, dh) if not isinstance(out, tuple) else \
            ((out[0], out[1]), (dh, extra_grad)) if extra_grad is not None else (out[0], dh)
        grads = torch.autograd.grad(outs, [x, *params.values()], douts)
    for acc, g in zip(grad_views, grads[1:]):
        acc.add_(g)
    return grads[0]


class TiledLayer:
    """A layer template whose per-token parts run over tiles of `tile` tokens. Called like `layer_forward` (without
    autograd: the forward wave and rebuilds); `layer_backward` runs its `backward`. A micro-batch of at most one tile
    runs the adapter's layer_forward. An adapter whose attention does not split (`splits_attention`) runs its
    attention part whole and only its MLP part over tiles."""

    def __init__(self, adapter, tile: int, compile: bool = False):
        def maybe_compiled(fn):
            return torch.compile(fn, dynamic=False) if compile else fn

        self.tile, self.moe = int(tile), bool(adapter.moe)
        self.split_attention = bool(getattr(adapter, "splits_attention", False))
        self.whole = maybe_compiled(adapter.layer_forward)
        self.attention = maybe_compiled(adapter.attention_part)
        self.mlp = maybe_compiled(adapter.mlp_part)
        self.reduce = adapter.mlp_reduce
        if self.split_attention:
            self.qkv = maybe_compiled(adapter.qkv)
            self.attn_out = maybe_compiled(adapter.attn_out)
            self.attend = adapter.attend  # the attention kernel itself (flash, FlexAttention) is not compiled again

            def token_part(w, h, o, token_mask):  # attention's per-token end, then the MLP part
                return adapter.mlp_part(w, adapter.attn_out(w, h, o), token_mask)

            self.token_part = maybe_compiled(token_part)

    @staticmethod
    def _mask(ctx, s: int, e: int):
        return None if ctx.token_mask is None else ctx.token_mask.reshape(-1)[s:e]

    @staticmethod
    def _rope(ctx):
        """cos, sin per token, [B·T, rotary dims]."""
        return ctx.cos.reshape(-1, ctx.cos.shape[-1]), ctx.sin.reshape(-1, ctx.sin.shape[-1])

    def _heads(self, w, x: torch.Tensor, ctx, ranges) -> tuple[torch.Tensor, ...]:
        """q, k, v [B·T, heads, head_dim] of the micro-batch x [B, T, H], computed tile by tile (no autograd)."""
        H = x.shape[-1]
        flat, (cos, sin) = x.reshape(-1, H), self._rope(ctx)
        bufs = None
        for s, e in ranges:
            parts = self.qkv(w, flat[s:e], cos[s:e], sin[s:e])
            if bufs is None:
                bufs = tuple(p.new_empty((flat.shape[0], *p.shape[1:])) for p in parts)
            for b, p in zip(bufs, parts):
                b[s:e] = p
            del parts
        return bufs

    @staticmethod
    def _rows(t: torch.Tensor, B: int, T: int) -> torch.Tensor:
        """A [B·T, heads, d] buffer as attention reads it, [B, heads, T, d] (as attention_block's transposes)."""
        return t.view(B, T, *t.shape[1:]).transpose(1, 2)

    def _combine(self, out, outs: list, s: int, e: int, flat_out: torch.Tensor):
        if self.moe:
            y, p, c = out
            outs.append((p, c))
            flat_out[s:e] = y
        else:
            flat_out[s:e] = out

    def _finish(self, result: torch.Tensor, outs: list):
        if not self.moe:
            return result
        counts = outs[0][1]
        for _, c in outs[1:]:
            counts = counts + c  # whole numbers below 2^24: exact in fp32
        return self.reduce((result, torch.cat([p for p, _ in outs]), counts))

    def __call__(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx):
        if torch.is_grad_enabled():
            raise RuntimeError("TiledLayer's forward writes its tiles in place: call it without autograd "
                               "(layer_backward recomputes with autograd)")
        B, T, H = h.shape
        ranges = token_tiles(B * T, self.tile)
        if len(ranges) == 1:
            return self.whole(w, h, ctx)
        outs: list = []
        if not self.split_attention:
            mid = self.attention(w, h, ctx)
            flat = mid.view(-1, H)
            for s, e in ranges:  # each tile's output replaces its input, which nothing reads again
                self._combine(self.mlp(w, flat[s:e], self._mask(ctx, s, e)), outs, s, e, flat)
            return self._finish(mid, outs)
        q, k, v = self._heads(w, h, ctx, ranges)
        o = self.attend(self._rows(q, B, T), self._rows(k, B, T), self._rows(v, B, T), ctx)
        del q, k, v
        o = o.transpose(1, 2).reshape(B * T, -1)
        x, out = h.reshape(-1, H), torch.empty_like(h)
        flat_out = out.view(-1, H)
        for s, e in ranges:
            self._combine(self.token_part(w, x[s:e], o[s:e], self._mask(ctx, s, e)), outs, s, e, flat_out)
        return self._finish(out, outs)

    def _tile_grads(self, outs_douts, leaves: list, params: dict, acc: dict) -> list:
        """Backpropagates (outputs, their gradients) to `leaves` (returned) and the weights (added to `acc`)."""
        outs, douts = outs_douts
        grads = torch.autograd.grad(outs, [*leaves, *params.values()], douts, allow_unused=True)
        for name, g in zip(params, grads[len(leaves):]):
            if g is not None:
                acc[name].add_(g)
        return list(grads[:len(leaves)])

    def _mlp_outputs(self, out, dy: torch.Tensor, extra_grad):
        """(outputs, gradients) of an MLP part's result: the MoE router probabilities get the router loss's."""
        if not self.moe:
            return out, dy
        if extra_grad is None:
            return out[0], dy
        return (out[0], out[1]), (dy, extra_grad.expand_as(out[1]))

    def backward(self, w: dict[str, torch.Tensor], checkpoint: torch.Tensor, ctx, dh: torch.Tensor,
                 grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None) -> torch.Tensor:
        """layer_backward's contract (see there), the per-token parts tile by tile."""
        B, T, H = checkpoint.shape
        ranges = token_tiles(B * T, self.tile)
        if len(ranges) == 1:
            return _whole_backward(self.whole, w, checkpoint, ctx, dh, grad_views, extra_grad)
        params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        acc = dict(zip(params, grad_views))
        x, dy = checkpoint.detach().reshape(-1, H), dh.reshape(-1, H)
        # a tile's d(output) is spent once the tile is backpropagated: what flows to the input is written over it
        reuse = dh.is_contiguous() and dh.dtype == checkpoint.dtype and dh.shape == checkpoint.shape
        if not self.split_attention:
            return self._backward_mlp_tiles(params, acc, checkpoint, ctx, dy, extra_grad, ranges, reuse)
        # 1. q, k, v tile by tile, without autograd; 2. the attention with autograd over them (what it saves: q, k,
        # v, its output and statistics); 3. per tile, attention's per-token end and the MLP part, recomputed and
        # backpropagated: d(attention output), and d(input) through the residual; 4. the attention's backward;
        # 5. per tile, q, k, v recomputed and backpropagated, the residual's gradient first (below)
        with torch.no_grad():
            q, k, v = self._heads(params, checkpoint, ctx, ranges)
        heads = [t.requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            o = self.attend(*(self._rows(t, B, T) for t in heads), ctx)
        o_rows = o.detach().transpose(1, 2).reshape(B * T, -1)
        d_o, dx = torch.empty_like(o_rows), dy if reuse else torch.empty_like(x)
        for s, e in ranges:
            xt, ot = x[s:e].detach().requires_grad_(True), o_rows[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                out = self.token_part(params, xt, ot, self._mask(ctx, s, e))
                dx[s:e], d_o[s:e] = self._tile_grads(self._mlp_outputs(out, dy[s:e], extra_grad), [xt, ot],
                                                     params, acc)
            del out, xt, ot
        del o_rows
        d_heads = torch.autograd.grad(o, heads, d_o.view(B, T, o.shape[1], -1).transpose(1, 2))
        del o, heads, q, k, v, d_o
        cos, sin = self._rope(ctx)
        for s, e in ranges:
            xt = x[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                qt, kt, vt = self.qkv(params, xt, cos[s:e], sin[s:e])
                # the residual's gradient enters through a node made after q, k, v: autograd runs it first, so xt's
                # gradient sums the residual, then q, k, v's paths, in the order the whole layer's autograd does
                through = xt.view_as(xt)
                dx[s:e] = self._tile_grads(((qt, kt, vt, through), (*(d[s:e] for d in d_heads), dx[s:e])), [xt],
                                           params, acc)[0]
            del qt, kt, vt, through, xt
        return dx.view_as(checkpoint)

    def _backward_mlp_tiles(self, params, acc, checkpoint, ctx, dy, extra_grad, ranges, reuse) -> torch.Tensor:
        """The attention part whole, the MLP part tile by tile (an adapter whose attention does not split)."""
        H = checkpoint.shape[-1]
        x = checkpoint.detach().requires_grad_(True)
        with torch.enable_grad():
            mid = self.attention(params, x, ctx)
        mid_flat = mid.detach().view(-1, H)
        d_mid = dy if reuse else torch.empty_like(mid_flat)
        for s, e in ranges:
            xt = mid_flat[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                out = self.mlp(params, xt, self._mask(ctx, s, e))
                d_mid[s:e] = self._tile_grads(self._mlp_outputs(out, dy[s:e], extra_grad), [xt], params, acc)[0]
            del out, xt
        del mid_flat
        return self._tile_grads((mid, d_mid.view_as(mid)), [x], params, acc)[0]


def layer_template(adapter, seq_tile: int = 0, compile: bool = False):
    """What the engine calls for a layer: the adapter's layer_forward (compiled or not), or with `seq_tile` > 0 a
    TiledLayer (an adapter whose layer does not split into attention and MLP parts runs whole)."""
    if seq_tile and getattr(adapter, "splits_layer", False):
        return TiledLayer(adapter, seq_tile, compile)
    return torch.compile(adapter.layer_forward, dynamic=False) if compile else adapter.layer_forward


def layer_backward(layer_fn: Callable, w: dict[str, torch.Tensor], checkpoint: torch.Tensor, ctx,
                   dh: torch.Tensor, grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Recompute `layer_fn(w, checkpoint, ctx)` with autograd and backpropagate `dh` through it: each weight's
    gradient is added to its fp32 view in `grad_views` (spec order); returns d(checkpoint). A MoE layer returns
    (h, router probability sum, counts): `extra_grad` (the router loss's gradient with respect to that sum, or None
    without one) flows back through the sum as well. A TiledLayer runs its per-token parts tile by tile, and writes
    what flows back over `dh` (spent tile by tile), returning a view of it."""
    if isinstance(layer_fn, TiledLayer):
        return layer_fn.backward(w, checkpoint, ctx, dh, grad_views, extra_grad)
    return _whole_backward(layer_fn, w, checkpoint, ctx, dh, grad_views, extra_grad)
