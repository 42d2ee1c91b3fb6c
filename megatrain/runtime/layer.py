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


class _Entry(torch.autograd.Function):
    """x (one of q, k, v as the attention reads it) entering the kept attention graph without autograd keeping x
    itself: a view of x that depends on a scalar `anchor` leaf, whose backward hands x's gradient to `sink[i]`."""

    @staticmethod
    def forward(ctx, x, anchor, sink: list, i: int):
        ctx.sink, ctx.i = sink, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink[ctx.i] = grad
        return None, None, None, None


class AttentionStash:
    """What a layer's forward keeps of its attention so that its backward need not run it again
    (`memory.reuse_attention`): the attention's output [B, heads, T, d] with its autograd graph, which holds what
    the kernel saves for its backward (flash-class kernels: q, k, v, the output and its log-sum-exp).

    On plain causal rows (no mask: SDPA's flash or cuDNN kernel, or CPU's flash kernel) the graph does not keep q,
    k and v: a saved-tensor hook swaps each for a note of its place in the q, k, v buffers, and the backward
    recomputes the buffers (the cheap projections, bit for bit the forward's numbers) and gives them back
    (`restore`) before backpropagating: the stash is the output and the log-sum-exp. With a mask (packed rows,
    windows, soft-capping: FlexAttention, whose compiled graph is not hooked) the graph keeps them.

    Used once, by the backward (`backpropagate`), which frees it as it goes."""

    __slots__ = ("output", "anchor", "grads", "keeps_heads", "_buffers", "_keys")

    def __init__(self, attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows, ctx):
        """Runs `attend` over `rows(q)`, `rows(k)`, `rows(v)` (buffers [B·T, heads, d] as attention reads them)
        with autograd; returns through `.output`."""
        self.keeps_heads = ctx.mask is not None or ctx.block_mask is not None
        self.anchor = torch.zeros((), device=q.device, requires_grad=True)
        self.grads: list = [None, None, None]
        self._buffers: list | None = None
        self._keys = {t.untyped_storage()._cdata: i for i, t in enumerate((q, k, v))}
        with torch.enable_grad():
            heads = [_Entry.apply(rows(t), self.anchor, self.grads, i) for i, t in enumerate((q, k, v))]
            if self.keeps_heads:
                self.output = attend(*heads, ctx)
            else:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    self.output = attend(*heads, ctx)

    def _pack(self, t: torch.Tensor):
        i = self._keys.get(t.untyped_storage()._cdata)
        if i is None:  # the output, the log-sum-exp, the kernel's scalars: kept
            return t
        return (i, t.shape, t.stride(), t.storage_offset())

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        i, shape, stride, offset = packed
        if self._buffers is None:
            raise RuntimeError("the kept attention's q, k, v were not restored before its backward")
        return self._buffers[i].as_strided(shape, stride, offset)

    def restore(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The recomputed q, k, v buffers (laid out as the forward's) for the graph's saved views of them."""
        self._buffers = [q, k, v]

    def backpropagate(self, d_output: torch.Tensor) -> list[torch.Tensor]:
        """d(q), d(k), d(v) as the attention read them ([B, heads, T, d] views) for d(output); frees the stash."""
        if self.output is None:
            raise RuntimeError("an attention stash is used once")
        if not self.keeps_heads and self._buffers is None:
            raise RuntimeError("the kept attention's q, k, v were not restored before its backward")
        torch.autograd.grad(self.output, self.anchor, d_output, allow_unused=True)
        grads = self.grads
        self.output = self.anchor = self.grads = self._buffers = None
        return grads


# Graphs Dynamo may compile for one function of a template (its recompile limit, 8 by default, counts them per
# function): the first micro-batch shape's static ones (a tile and the last, shorter tile, each in the three ways
# a function is called: the forward wave, the backward's recompute without autograd, the backward with autograd;
# with and without a padding mask) and as many dynamic ones.
TEMPLATE_GRAPHS = 24


class Shapes:
    """The micro-batch shapes a compiled template runs: the first one's graphs are compiled static, any other
    shape's with its token dimension dynamic (ShapeCompiled). `note(h)` at each entry of the template ([B, T, H]
    hidden states) sets `varied` for the parts it calls."""

    __slots__ = ("first", "varied")

    def __init__(self):
        self.first: tuple[int, int] | None = None
        self.varied = False

    def note(self, h: torch.Tensor) -> bool:
        shape = (int(h.shape[0]), int(h.shape[1]))
        if self.first is None:
            self.first = shape
        self.varied = shape != self.first
        return self.varied


def expect_first_shape(layer, rows: int, tokens: int) -> None:
    """Compile a template's static graphs for this micro-batch shape (the run's first training micro-batch), whatever
    runs first: an evaluation of other rows before step 1 then takes the dynamic graphs, not the training. A no-op
    for an uncompiled template, or one that has run already."""
    shapes = getattr(layer, "shapes", None)
    if isinstance(shapes, Shapes) and shapes.first is None:
        shapes.first = (int(rows), int(tokens))


def _mark_rows(h: torch.Tensor, ctx) -> None:
    """Rows and tokens of a whole micro-batch dynamic: h [B, T, H] and its context's per-token tensors."""
    from torch._dynamo import maybe_mark_dynamic

    for t, dims in ((h, (0, 1)),) + tuple((t, d) for c in (ctx, *ctx.variants.values()) for t, d in (
            (c.cos, (0, 1)), (c.sin, (0, 1)), (c.mask, (0, 2, 3)), (c.token_mask, (0, 1))) if t is not None):
        for d in dims:
            maybe_mark_dynamic(t, d)


class ShapeCompiled:
    """A layer template's function compiled (engine.compile). Dynamo specialises a graph to its inputs' sizes, and
    unpacked rows (padded per micro-batch to its longest row) give nearly every micro-batch a length of its own: a
    graph per length, each compiled (and on CUDA tuned) anew, until torch's recompile limit (8), past which Dynamo
    silently runs the function uncompiled. So two compiled entries: `static` (dynamic=False) for the template's
    first micro-batch shape (`Shapes`), exactly the graphs a run of one shape has always had; `varied` for every
    other shape, its inputs' token dimension (and rows) marked dynamic: one graph for every length. Dynamo keeps
    their graphs apart (a graph is used only by the compile call it was made for: `dynamic` is part of the match),
    so the dynamic graph never takes the static shape's calls (Dynamo tries the graph it used last first).
    `rows`: called as (w, h [B, T, H], ctx), else (w, per-token tensors [tokens, ...] or None ...)."""

    def __init__(self, fn, shapes: Shapes, rows: bool):
        self.static = torch.compile(fn, dynamic=False)
        self.varied = torch.compile(fn, dynamic=None)  # with automatic dynamic shapes off (below): only the marks
        self.fn, self.shapes, self.rows = fn, shapes, rows
        self.uncompiled = False  # the dynamic graph failed to compile: other shapes run uncompiled

    def __call__(self, w, *args):
        from torch._dynamo import config, maybe_mark_dynamic
        from torch._dynamo.exc import TorchDynamoException

        varied = self.shapes.note(args[0]) if self.rows else self.shapes.varied
        if not varied:
            with config.patch(recompile_limit=TEMPLATE_GRAPHS):
                return self.static(w, *args)
        if self.uncompiled:
            return self.fn(w, *args)
        if self.rows:
            _mark_rows(*args)
        else:
            for t in args:
                if isinstance(t, torch.Tensor):
                    maybe_mark_dynamic(t, 0)
        # automatic dynamic shapes off: only the marked dimensions are dynamic, the weights' stay static
        try:
            with config.patch(recompile_limit=TEMPLATE_GRAPHS, automatic_dynamic_shapes=False):
                return self.varied(w, *args)
        except TorchDynamoException as e:  # a compiler that cannot take symbolic sizes: slower, not wrong
            import warnings

            # (not the static graphs: the marks stay on the inputs, and a static compile honours them too)
            self.uncompiled = True
            warnings.warn(f"megatrain: compiling {getattr(self.fn, '__name__', 'a layer function')} with a dynamic "
                          f"token dimension failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); micro-batches "
                          "of other shapes than the first run it uncompiled", stacklevel=2)
            return self.fn(w, *args)


class TiledLayer:
    """A layer template whose per-token parts run over tiles of `tile` tokens. Called like `layer_forward` (without
    autograd: the forward wave and rebuilds); `layer_backward` runs its `backward`. A micro-batch of at most one tile
    runs the adapter's layer_forward. An adapter whose attention does not split (`splits_attention`) runs its
    attention part whole and only its MLP part over tiles."""

    def __init__(self, adapter, tile: int, compile: bool = False):
        self.shapes = Shapes()

        def maybe_compiled(fn, rows: bool = False):
            return ShapeCompiled(fn, self.shapes, rows) if compile else fn

        self.tile, self.moe = int(tile), bool(adapter.moe)
        self.split_attention = bool(getattr(adapter, "splits_attention", False))
        self.whole = maybe_compiled(adapter.layer_forward, rows=True)
        self.attention = maybe_compiled(adapter.attention_part, rows=True)
        self.mlp = maybe_compiled(adapter.mlp_part)
        self.reduce = adapter.mlp_reduce
        if self.split_attention:
            self.qkv = maybe_compiled(adapter.qkv)
            self.attn_out = maybe_compiled(adapter.attn_out)
            self.attend = adapter.attend  # the attention kernel itself (flash, FlexAttention) is not compiled again

            def token_part(w, h, o, token_mask):  # attention's per-token end, then the MLP part
                return adapter.mlp_part(w, adapter.attn_out(w, h, o), token_mask)

            self.token_part = maybe_compiled(token_part)

    def _whole(self, ctx, ranges, T: int) -> bool:
        """Whether a micro-batch runs the adapter's whole layer (compiled when the template is): one tile, and no
        attention backward over blocks (`ctx.attn_block`, which runs outside the compiled graph, in `attend`)."""
        return len(ranges) == 1 and not (self.split_attention and ctx.mask is None and ctx.block_mask is None
                                         and 0 < ctx.attn_block < T)

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
        self.shapes.note(h)
        if self._whole(ctx, ranges, T):
            return self.whole(w, h, ctx)
        outs: list = []
        if not self.split_attention:
            mid = self.attention(w, h, ctx)
            flat = mid.view(-1, H)
            for s, e in ranges:  # each tile's output replaces its input, which nothing reads again
                self._combine(self.mlp(w, flat[s:e], self._mask(ctx, s, e)), outs, s, e, flat)
            return self._finish(mid, outs)
        return self._split_forward(w, h, ctx, ranges, None)

    def forward_stash(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx) -> tuple:
        """(the layer's output, an `AttentionStash`): the forward over the split parts (even as one tile), its
        attention run with autograd over q, k, v so that `backward(..., stash=)` backpropagates through it without
        recomputing q, k, v or running the attention forward again."""
        if not self.split_attention:
            raise ValueError("this layer's attention does not split into qkv, attend and attn_out: nothing to stash")
        if torch.is_grad_enabled():
            raise RuntimeError("forward_stash writes its tiles in place: call it without autograd")
        B, T, _ = h.shape
        self.shapes.note(h)
        stash: list = []
        out = self._split_forward(w, h, ctx, token_tiles(B * T, self.tile), stash)
        return out, stash[0]

    def _split_forward(self, w, h: torch.Tensor, ctx, ranges, stash: list | None):
        B, T, H = h.shape
        outs: list = []
        q, k, v = self._heads(w, h, ctx, ranges)
        if stash is None:
            o = self.attend(self._rows(q, B, T), self._rows(k, B, T), self._rows(v, B, T), ctx)
        else:
            stash.append(AttentionStash(self.attend, q, k, v, lambda t: self._rows(t, B, T), ctx))
            o = stash[-1].output.detach()
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
                 grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None,
                 stash: AttentionStash | None = None) -> torch.Tensor:
        """layer_backward's contract (see there), the per-token parts tile by tile. With the `stash` of this
        micro-batch's forward (`forward_stash`), q, k, v and the attention's output come from it: steps 1 and 2
        below are skipped, the rest is the same code on the same numbers."""
        B, T, H = checkpoint.shape
        ranges = token_tiles(B * T, self.tile)
        self.shapes.note(checkpoint)
        if self._whole(ctx, ranges, T) and stash is None:
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
        if stash is None:
            with torch.no_grad():
                q, k, v = self._heads(params, checkpoint, ctx, ranges)
            heads = [t.requires_grad_(True) for t in (q, k, v)]
            with torch.enable_grad():
                o = self.attend(*(self._rows(t, B, T) for t in heads), ctx)
        else:  # the forward's attention: its graph, and q, k, v recomputed only where it did not keep them
            if not stash.keeps_heads:
                with torch.no_grad():
                    stash.restore(*self._heads(params, checkpoint, ctx, ranges))
            o, heads, q, k, v = stash.output, None, None, None, None
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
        d_rows = d_o.view(B, T, o.shape[1], -1).transpose(1, 2)
        if stash is None:
            d_heads = torch.autograd.grad(o, heads, d_rows)
        else:  # [B, heads, T, d] views -> [B·T, heads, d], as autograd gives the buffers above
            d_heads = [g.transpose(1, 2).reshape(B * T, g.shape[1], g.shape[3]) for g in stash.backpropagate(d_rows)]
        del o, heads, q, k, v, d_o, d_rows, stash
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


def can_stash(adapter) -> bool:
    """Whether this adapter's layers can keep their attention for the backward (`AttentionStash`): their attention
    part splits into qkv, attend and attn_out."""
    return bool(getattr(adapter, "splits_attention", False))


def layer_template(adapter, seq_tile: int = 0, compile: bool = False, stash: bool = False, attn_block: int = 0):
    """What the engine calls for a layer: the adapter's layer_forward (compiled or not), or with `seq_tile` > 0 a
    TiledLayer (an adapter whose layer does not split into attention and MLP parts runs whole). `stash`: some
    layers keep their attention for the backward (`TiledLayer.forward_stash`): a TiledLayer even without tiles
    (its layers without a stash run whole, as layer_forward). `attn_block` (Placement.attn_block): a TiledLayer too,
    whose rows longer than it run split, their attention uncompiled (models/attention.blockwise_causal)."""
    if stash and not can_stash(adapter):
        raise ValueError(f"{type(adapter).__name__}'s attention does not split into qkv, attend and attn_out: its "
                         "layers cannot keep their attention for the backward (memory.reuse_attention: 0)")
    if (seq_tile or stash or attn_block) and getattr(adapter, "splits_layer", False):
        return TiledLayer(adapter, seq_tile, compile)
    return ShapeCompiled(adapter.layer_forward, Shapes(), rows=True) if compile else adapter.layer_forward


def layer_backward(layer_fn: Callable, w: dict[str, torch.Tensor], checkpoint: torch.Tensor, ctx,
                   dh: torch.Tensor, grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None,
                   stash: AttentionStash | None = None) -> torch.Tensor:
    """Recompute `layer_fn(w, checkpoint, ctx)` with autograd and backpropagate `dh` through it: each weight's
    gradient is added to its fp32 view in `grad_views` (spec order); returns d(checkpoint). A MoE layer returns
    (h, router probability sum, counts): `extra_grad` (the router loss's gradient with respect to that sum, or None
    without one) flows back through the sum as well. A TiledLayer runs its per-token parts tile by tile, and writes
    what flows back over `dh` (spent tile by tile), returning a view of it; with the `stash` of this micro-batch's
    forward (TiledLayer.forward_stash) it does not run the attention forward again."""
    if isinstance(layer_fn, TiledLayer):
        return layer_fn.backward(w, checkpoint, ctx, dh, grad_views, extra_grad, stash)
    if stash is not None:
        raise ValueError("an attention stash needs the TiledLayer template (layer_template(..., stash=True))")
    return _whole_backward(layer_fn, w, checkpoint, ctx, dh, grad_views, extra_grad)
