"""Sequence tiling inside the layer (memory.seq_tile, runtime/layer.py): a layer's per-token parts over tiles of
tokens (q, k, v before the attention; o_proj, residual and the MLP part after it) compute the layer the whole layer
computes, in fp32 on CPU, for every family.

Bit for bit, every dense family: the forward (the forward wave and rebuilds), and the recompute's output and
d(input) in backward. The weight gradients are sums over tokens that the tiled layer reduces tile by tile instead of
in one GEMM: the same sums in another order. That deviation is measured here (~2-3e-7 relative) and bounded at 1e-6,
the bound tests/test_lm_head.py puts on the LM head's chunk size; a whole step's loss is the same bit for bit, and a
run with tiles equals transformers + AdamW at 1e-5 (test_long_context.py).

MoE families: each expert's GEMMs run over the tokens routed to it, so a tile gives an expert fewer rows than the
whole micro-batch does, and CPU MKL computes products of a few rows (up to 2-6 at these shapes, more at larger
ones) with another kernel whose rows differ in the last bit. Their tiled layer is therefore compared at the same
1e-6 (measured: outputs and d(input) ~1e-7 when it happens; bit for bit when every expert gets enough rows)."""

import pytest
import torch

from conftest import FAMILIES, make_model_dir, tiny_hf_config
from megatrain.models import get_adapter
from megatrain.runtime import Placement
from megatrain.runtime.layer import TiledLayer, layer_backward, layer_template, token_tiles
from reference import Megatrain, random_batches, rel
from test_families_phi3_olmo2 import make_dir, tiny_config

ALL = FAMILIES + ["phi3", "olmo2"]
SUM_BOUND = 1e-6  # the weight gradients' reduction order (module docstring)


def adapter_of(family: str):
    return get_adapter(tiny_config(family) if family in ("phi3", "olmo2") else tiny_hf_config(family))


def mlp_names(adapter) -> set[str]:
    """The weights the MLP part reads: found by running it alone with autograd."""
    unit = adapter.units()[1]
    w = {s.name: torch.randn(s.shape, requires_grad=True) for s in unit.specs}
    out = adapter.mlp_part(w, torch.randn(5, adapter.hidden_size), None)
    out = out[0].sum() + out[1].sum() if isinstance(out, tuple) else out.sum()
    grads = torch.autograd.grad(out, list(w.values()), allow_unused=True)
    return {n for n, g in zip(w, grads) if g is not None}


def layer_inputs(adapter, packed: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    unit = adapter.units()[1]
    w = {s.name: (torch.randn(s.shape, generator=g) * (0.15 if len(s.shape) > 1 else 1.0)) for s in unit.specs}
    B, T = 2, 75
    pos = torch.arange(T).repeat(B, 1)
    if packed:  # documents of 30 + 45 and 60 + 15 tokens
        pos[0, 30:] = torch.arange(45)
        pos[1, 60:] = torch.arange(15)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 66:] = False  # padding at the end of a row (MoE router statistics skip it)
    ctx = adapter.make_context(pos, torch.float32, packed).with_token_mask(mask)
    x = torch.randn(B, T, adapter.hidden_size, generator=g)
    dh = torch.randn(B, T, adapter.hidden_size, generator=g)
    extra = torch.randn(adapter.num_experts, generator=g) if adapter.moe else None
    return w, ctx, x, dh, extra


def test_token_tiles():
    assert token_tiles(150, 0) == [(0, 150)] and token_tiles(150, 150) == [(0, 150)]
    assert token_tiles(150, 32) == [(0, 32), (32, 64), (64, 96), (96, 128), (128, 150)]  # 22 >= 16: its own tile
    assert token_tiles(150, 64) == [(0, 64), (64, 150)]  # 22 < 32: joined to the last
    assert token_tiles(40, 32) == [(0, 40)]
    for n in range(1, 300, 7):
        for t in (1, 5, 16, 33, 64):
            r = token_tiles(n, t)
            assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
            assert all(e - s >= min(n, (t + 1) // 2) for s, e in r)


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
def test_tiled_layer_is_the_whole_layer(family, packed):
    """Every layer kind of the family (gemma: sliding and full), tiles of 16 tokens (MoE: 32) over 2 x 75 tokens,
    the last tile holding the remainder; accumulators that already hold a gradient."""
    adapter = adapter_of(family)
    tile = 32 if adapter.moe else 16
    tiled = TiledLayer(adapter, tile)
    assert len(token_tiles(150, tile)) > 3
    # gpt_oss's attention (its sinks are weights the attention reads) runs whole; its MoE MLP part is tiled
    assert tiled.split_attention == (family != "gpt_oss")
    specs = adapter.units()[1].specs
    for kind in sorted(set(adapter.layer_kinds)):
        w, ctx, x, dh, extra = layer_inputs(adapter, packed, seed=hash((family, kind)) % 1000)
        c = ctx.for_kind(kind)
        with torch.no_grad():
            whole, got = adapter.layer_forward(w, x, c), tiled(w, x, c)
        if adapter.moe:  # output, router probability sum, counts (whole numbers: exact)
            assert rel(got[0], whole[0]) <= SUM_BOUND and rel(got[1], whole[1]) <= SUM_BOUND
            assert torch.equal(got[2], whole[2]), (family, kind)
        else:
            assert torch.equal(got, whole), (family, kind)
        g_whole = [torch.randn(s.shape) for s in specs]  # accumulators that already hold a gradient
        g_tiled = [g.clone() for g in g_whole]
        dx_whole = layer_backward(adapter.layer_forward, w, x, c, dh, g_whole, extra)
        dx_tiled = layer_backward(tiled, w, x, c, dh, g_tiled, extra)
        if adapter.moe:
            assert rel(dx_tiled, dx_whole) <= SUM_BOUND
        else:
            assert torch.equal(dx_tiled, dx_whole), (family, kind)
        for s, a, b in zip(specs, g_tiled, g_whole):
            assert rel(a, b) <= SUM_BOUND, (family, kind, s.name, rel(a, b))


def test_the_sums_do_differ_by_rounding():
    """The reduction order is the only difference, and it is a real one: the weight gradients of a tiled layer are
    not those of the whole layer bit for bit (if they were, the bound above would be hiding nothing)."""
    adapter = adapter_of("llama")
    w, ctx, x, dh, _ = layer_inputs(adapter, False, seed=3)
    specs = adapter.units()[1].specs
    g_whole, g_tiled = [torch.zeros(s.shape) for s in specs], [torch.zeros(s.shape) for s in specs]
    dx = layer_backward(adapter.layer_forward, w, x, ctx, dh.clone(), g_whole)
    assert torch.equal(layer_backward(TiledLayer(adapter, 16), w, x, ctx, dh.clone(), g_tiled), dx)
    diffs = {s.name: rel(a, b) for s, a, b in zip(specs, g_tiled, g_whole)}
    assert 0 < diffs["mlp.down_proj.weight"] <= SUM_BOUND and 0 < diffs["self_attn.q_proj.weight"] <= SUM_BOUND


def test_a_family_with_its_own_attention_tiles_only_its_mlp():
    """An adapter that overrides attention_block (its attention does not split into qkv, attend, attn_out) runs its
    attention part whole and its MLP part over tiles: still the same layer."""
    adapter = adapter_of("qwen3")

    class OwnAttention(type(adapter)):
        def attention_block(self, w, h, ctx):
            return super().attention_block(w, h, ctx)

    own = OwnAttention(adapter.hf_config)
    tiled = TiledLayer(own, 16)
    assert own.splits_layer and not own.splits_attention and not tiled.split_attention
    w, ctx, x, dh, _ = layer_inputs(own, True, seed=8)
    with torch.no_grad():
        assert torch.equal(tiled(w, x, ctx), own.layer_forward(w, x, ctx))
    specs = own.units()[1].specs
    g_whole, g_tiled = [torch.zeros(s.shape) for s in specs], [torch.zeros(s.shape) for s in specs]
    dx = layer_backward(own.layer_forward, w, x, ctx, dh.clone(), g_whole)
    assert torch.equal(layer_backward(tiled, w, x, ctx, dh.clone(), g_tiled), dx)
    mlp = mlp_names(own)
    for s, a, b in zip(specs, g_tiled, g_whole):  # the attention's weights: one backward, as the whole layer's
        assert torch.equal(a, b) if s.name not in mlp else rel(a, b) <= SUM_BOUND, s.name


def test_d_input_is_written_over_d_output():
    """The tiled backward spends d(output) tile by tile and writes d(input) over it: no second [B, T, H] buffer."""
    adapter = adapter_of("llama")
    w, ctx, x, dh, _ = layer_inputs(adapter, False, seed=5)
    specs = adapter.units()[1].specs
    dx = layer_backward(TiledLayer(adapter, 16), w, x, ctx, dh, [torch.zeros(s.shape) for s in specs])
    assert dx.data_ptr() == dh.data_ptr()


def test_layer_template_tiles_only_when_asked():
    adapter = adapter_of("qwen3")
    assert layer_template(adapter, 0) == adapter.layer_forward
    assert isinstance(layer_template(adapter, 64), TiledLayer)

    class Overrides(type(adapter)):  # a family whose layer_forward is its own runs whole
        def layer_forward(self, w, h, ctx):
            return super().layer_forward(w, h, ctx)

    other = Overrides(adapter.hf_config)
    assert not other.splits_layer and layer_template(other, 64) == other.layer_forward


def test_tiled_forward_refuses_autograd():
    adapter = adapter_of("llama")
    w, ctx, x, _, _ = layer_inputs(adapter, False, seed=1)
    with pytest.raises(RuntimeError, match="without autograd"):
        TiledLayer(adapter, 16)(w, x, ctx)


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("gemma2", True), ("mixtral", False),
                                         ("phi3", True), ("olmo2", False)])
def test_a_step_with_tiles_is_the_same_step(tmp_path, family, tied):
    """The engine with memory.seq_tile: one step of 3 padded micro-batches (rows of 40-70 tokens, tiles of 24 or 32
    over their 2 x T tokens), checkpoints every 2 layers (rebuilds run the tiled forward): the loss is the same bit
    for bit, the embedding's and the head's gradients too (d(hidden) is), the layers' to SUM_BOUND."""
    if family in ("phi3", "olmo2"):
        make_dir(tmp_path, family, tied=tied, seed=5)
    else:
        make_model_dir(tmp_path, family, tied=tied, seed=5)
    batches = random_batches(3, 2, 97, [70, 40, 57], seed=21)
    tile = 24
    whole = Megatrain(tmp_path, placement=Placement(checkpoint_every=2))
    tiled = Megatrain(tmp_path, placement=Placement(checkpoint_every=2, seq_tile=tile))
    assert isinstance(tiled.engine.layer, TiledLayer)
    l0, n0, g0 = whole.train_step(batches, keep_grads=True)
    l1, n1, g1 = tiled.train_step(batches, keep_grads=True)
    moe = whole.adapter.moe  # see the module docstring
    assert l1 == l0 or (moe and abs(l1 - l0) <= 1e-6 * l0)
    for name, g in g0.items():  # the layers' weights: sums in another order; the embedding's and head's exact
        if name.startswith("model.layers.") or moe:
            assert rel(g1[name], g) <= SUM_BOUND, (name, rel(g1[name], g))
        else:
            assert torch.equal(g1[name], g), name
    assert abs(n1 - n0) <= 1e-6 * n0
    whole.close()
    tiled.close()
