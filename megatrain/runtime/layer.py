"""One decoder layer as the engine runs it, for one micro-batch: its forward (the forward wave, rebuilds) and its
backward (recompute from the layer's input checkpoint, local autograd, fp32 gradient accumulation). Plain functions
and one small class, so the engine, the probe (which times them) and the planner (which measures their memory on
the meta device) all run the same code.

Sequence tiling (`memory.seq_tile`, Placement.seq_tile): a layer is `attention_part` (what mixes tokens: norm,
q/k/v, attention, o_proj, residual) then `mlp_part` (token by token: norm, MLP or routed experts, residual). With a
tile of t tokens, the MLP part runs over the micro-batch's B·T tokens t at a time, in the forward and in backward
(recompute the tile's MLP, backpropagate it, add its weight gradients, free it, next tile), so the layer's working
set holds one tile's [t, intermediate] tensors, never [B·T, intermediate]. The attention part runs whole.

What is exactly the same as the whole layer, in fp32 on CPU: the output, d(input) and the attention part's weight
gradients, bit for bit (each tile's rows are the same rows of the whole GEMMs: CPU BLAS computes a row of a product
independently of the other rows once a product has more than a few rows; `token_tiles` never makes a tile of fewer
than half a tile). The MLP part's weight gradients are sums over tokens, reduced tile by tile instead of in one
GEMM: the same sum in another order (relative difference ~1e-7 in fp32; tests/test_tiling.py measures it). A MoE
layer's experts run over the tokens routed to them: a tile gives an expert fewer rows, and CPU BLAS computes a product
of a few rows with another kernel, so there the tiled output can differ from the whole one in the last bit.
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
    """A layer template whose MLP part runs over tiles of `tile` tokens. Called like `layer_forward` (without
    autograd: the forward wave and rebuilds); `layer_backward` runs its `backward`. `attention`, `mlp` and `whole`
    are the adapter's attention_part, mlp_part and layer_forward, each compiled or not; `reduce` its mlp_reduce.
    A micro-batch of at most one tile runs `whole`."""

    def __init__(self, adapter, tile: int, compile: bool = False):
        def maybe_compiled(fn):
            return torch.compile(fn, dynamic=False) if compile else fn

        self.tile, self.moe = int(tile), bool(adapter.moe)
        self.whole = maybe_compiled(adapter.layer_forward)
        self.attention = maybe_compiled(adapter.attention_part)
        self.mlp = maybe_compiled(adapter.mlp_part)
        self.reduce = adapter.mlp_reduce

    @staticmethod
    def _mask(ctx, s: int, e: int):
        return None if ctx.token_mask is None else ctx.token_mask.reshape(-1)[s:e]

    def __call__(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx):
        if torch.is_grad_enabled():
            raise RuntimeError("TiledLayer's forward writes its tiles in place: call it without autograd "
                               "(layer_backward recomputes with autograd)")
        H = h.shape[-1]
        ranges = token_tiles(h.numel() // H, self.tile)
        if len(ranges) == 1:
            return self.whole(w, h, ctx)
        mid = self.attention(w, h, ctx)
        flat = mid.view(-1, H)
        probs, counts = [], None
        for s, e in ranges:  # each tile's output replaces its input, which nothing reads again
            out = self.mlp(w, flat[s:e], self._mask(ctx, s, e))
            if self.moe:
                out, p, c = out
                probs.append(p)
                counts = c if counts is None else counts + c  # whole numbers below 2^24: exact in fp32
            flat[s:e] = out
            del out
        return self.reduce((mid, torch.cat(probs), counts)) if self.moe else mid

    def backward(self, w: dict[str, torch.Tensor], checkpoint: torch.Tensor, ctx, dh: torch.Tensor,
                 grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None) -> torch.Tensor:
        """layer_backward's contract (see there), the MLP part tile by tile."""
        H = checkpoint.shape[-1]
        ranges = token_tiles(checkpoint.numel() // H, self.tile)
        if len(ranges) == 1:
            return _whole_backward(self.whole, w, checkpoint, ctx, dh, grad_views, extra_grad)
        params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
        acc = dict(zip(params, grad_views))
        x = checkpoint.detach().requires_grad_(True)
        with torch.enable_grad():
            mid = self.attention(params, x, ctx)
        mid_flat, dh_flat = mid.detach().view(-1, H), dh.reshape(-1, H)
        d_mid = torch.empty_like(mid_flat)
        for s, e in ranges:
            xt = mid_flat[s:e].detach().requires_grad_(True)
            with torch.enable_grad():
                out = self.mlp(params, xt, self._mask(ctx, s, e))
                outs, douts = (out, dh_flat[s:e])
                if self.moe:  # d(sum of probabilities)/d(a token's probabilities) is the router loss's gradient
                    outs, douts = ((out[0], out[1]), (douts, extra_grad.expand_as(out[1]))) \
                        if extra_grad is not None else (out[0], douts)
                grads = torch.autograd.grad(outs, [xt, *params.values()], douts, allow_unused=True)
            del out, outs
            d_mid[s:e] = grads[0]
            for name, g in zip(params, grads[1:]):
                if g is not None:
                    acc[name].add_(g)
            del grads
        del mid_flat, dh_flat
        grads = torch.autograd.grad(mid, [x, *params.values()], d_mid.view_as(mid), allow_unused=True)
        del mid, d_mid
        for name, g in zip(params, grads[1:]):
            if g is not None:
                acc[name].add_(g)
        return grads[0]


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
    without one) flows back through the sum as well. A TiledLayer runs its MLP part tile by tile."""
    if isinstance(layer_fn, TiledLayer):
        return layer_fn.backward(w, checkpoint, ctx, dh, grad_views, extra_grad)
    return _whole_backward(layer_fn, w, checkpoint, ctx, dh, grad_views, extra_grad)
