"""The attention kept from the forward wave for the backward (memory.reuse_attention, runtime/layer.AttentionStash).

A layer that keeps its attention does not recompute q, k, v nor run the attention forward in its backward: it
backpropagates through the graph its forward made. In fp32 on CPU that is the same computation on the same numbers
as the recompute (the same kernels on bit-identical inputs), so everything is compared bit for bit: the layer's
output, d(input) and every weight gradient, for every family whose attention splits (gpt_oss's does not: refused by
name), in rows and packed; a whole engine step with several micro-batches, wave groups, blocks of rebuilt layers
and spilled inputs; and two steps against transformers + torch AdamW at 1e-5 on an 8,192-token row.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from megatrain.runtime import Placement
from megatrain.runtime.layer import AttentionStash, TiledLayer, can_stash, layer_backward, layer_template
from megatrain.runtime.schedule import step_schedule
from reference import Megatrain, random_batches, rel
from test_long_context import two_long_steps_like_transformers
from test_tiling import ALL, adapter_of, layer_inputs


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("tile", [0, 16], ids=["whole", "tiles"])
def test_kept_attention_backpropagates_what_the_recompute_does(family, packed, tile):
    adapter = adapter_of(family)
    if not can_stash(adapter):  # gpt_oss: its sinks are weights its attention reads; the attention runs whole
        with pytest.raises(ValueError, match="reuse_attention"):
            layer_template(adapter, tile, stash=True)
        return
    layer = layer_template(adapter, tile, stash=True)
    assert isinstance(layer, TiledLayer)
    # the same split template recomputing (a whole layer's backward sums its weight gradients in another order)
    recompute = TiledLayer(adapter, tile or 1000)
    specs = adapter.units()[1].specs
    for kind in sorted(set(adapter.layer_kinds)):
        w, ctx, x, dh, extra = layer_inputs(adapter, packed, seed=hash((family, kind, tile)) % 1000)
        c = ctx.for_kind(kind)
        with torch.no_grad():
            out, stash = layer.forward_stash(w, x, c)
            plain = layer(w, x, c)
        assert isinstance(stash, AttentionStash)
        for a, b in zip(*((o,) if not adapter.moe else o for o in (out, plain))):
            assert torch.equal(a, b), (family, kind)  # the kept attention's output is the one the layer uses
        g_kept = [torch.randn(s.shape) for s in specs]  # accumulators that already hold a gradient
        g_again = [g.clone() for g in g_kept]
        dx_kept = layer_backward(layer, w, x, c, dh.clone(), g_kept, extra, stash=stash)
        dx_again = layer_backward(recompute, w, x, c, dh.clone(), g_again, extra)
        assert torch.equal(dx_kept, dx_again), (family, kind, rel(dx_kept, dx_again))
        for s, a, b in zip(specs, g_kept, g_again):
            assert torch.equal(a, b), (family, kind, s.name, rel(a, b))
        assert stash.output is None and stash.grads is None  # spent: nothing of it outlives the backward
        with pytest.raises(RuntimeError, match="used once"):
            stash.backpropagate(dh)
        # on plain rows the stash does not hold q, k, v (the backward recomputed them); with a mask it does
        assert stash.keeps_heads == (packed or c.mask is not None or c.block_mask is not None)


def test_the_schedule_keeps_attention_only_of_kept_top_layers():
    """reuse_attention N: of the top N layers those whose input is kept (not rebuilt), in every wave group."""
    L = 8
    pl = Placement(checkpoint_every=2, keep_top_layers=2, reuse_attention=5, wave_groups=2)
    uses = step_schedule(L + 2, False, pl)
    for g in (0, 1):
        got = [u.layer for u in uses if u.kind == "forward" and u.group == g and u.stash]
        assert got == [4, 6, 7], got  # 3..7 are the top 5; 3 and 5 are rebuilt in blocks (4, 5) and (2, 3)
    assert not any(u.stash for u in step_schedule(L + 2, False, Placement(reuse_attention=0)))
    with pytest.raises(ValueError):
        Placement(reuse_attention=-1)


@pytest.mark.parametrize("family,tied,placement", [
    ("llama", False, Placement(reuse_attention=3)),
    ("qwen2", True, Placement(reuse_attention=2, seq_tile=24, checkpoint_every=2, keep_top_layers=1)),
    ("gemma2", True, Placement(reuse_attention=3, wave_groups=2, spill_layers=2)),
    ("qwen3_moe", False, Placement(reuse_attention=3, seq_tile=48)),
])
def test_a_step_keeping_attention_is_the_same_step(tmp_path, family, tied, placement):
    """The engine, three padded micro-batches of unequal lengths, two steps (the second after an update): the loss,
    the norm, every gradient and every updated weight equal the run that recomputes the attention, bit for bit."""
    make_model_dir(tmp_path, family, tied=tied, seed=5, layers=3)
    again = Megatrain(tmp_path, placement=Placement(**{**placement.__dict__, "reuse_attention": 0}))
    kept = Megatrain(tmp_path, placement=placement)
    # the recomputing run through the same split template (a whole layer sums its weight gradients in another order)
    again.engine.layer = TiledLayer(again.adapter, placement.seq_tile or 10**6)
    assert isinstance(kept.engine.layer, TiledLayer)
    for step in range(2):
        batches = random_batches(3, 2, 97, [70, 40, 57], seed=21 + step)
        l0, n0, g0 = again.train_step(batches, keep_grads=True)
        l1, n1, g1 = kept.train_step(batches, keep_grads=True)
        assert l1 == l0 and n1 == n0, (step, l0, l1)
        for name, g in g0.items():
            assert torch.equal(g1[name], g), (step, name, rel(g1[name], g))
    p0, p1 = again.params(), kept.params()
    for name, p in p0.items():
        assert torch.equal(p1[name], p), name
    again.close()
    kept.close()


def test_an_8k_sequence_keeping_attention_trains_like_transformers(tmp_path):
    """One 8,192-token row per step, 2 steps, every layer keeping its attention (no tiles: the split template runs
    whole): loss, every gradient and every updated weight within 1e-5 of transformers (SDPA) + torch AdamW."""
    make_model_dir(tmp_path, "llama", seed=7, layers=2)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    two_long_steps_like_transformers(ref, Megatrain(tmp_path, placement=Placement(reuse_attention=2)))


def test_a_model_whose_attention_does_not_split_is_refused(tmp_path):
    make_model_dir(tmp_path, "gpt_oss", seed=3, layers=2)
    with pytest.raises(ValueError, match="memory.reuse_attention"):
        Megatrain(tmp_path, placement=Placement(reuse_attention=1))


def test_plan_refuses_reuse_for_a_model_that_cannot_and_chooses_it_at_long_rows():
    """`megatrain plan`: memory.reuse_attention on gpt-oss is refused by name, before anything runs; with no keys,
    rows of 32k and more get it where it fits (and is predicted faster), short rows do not."""
    from megatrain.errors import MegatrainError
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.placement import FREE_ALL
    from megatrain.planner.profile import GiB, load_profile
    from test_plan import adapter_of as real_adapter

    prof = load_profile(None)
    with pytest.raises(MegatrainError, match="memory.reuse_attention: 1, but gpt_oss"):
        make_plan(real_adapter("gpt-oss-20b", 2), Workload((1,), 1024, placement=Placement(reuse_attention=1)), prof,
                  suggest=False)
    llama = real_adapter("llama-3.1-8b", 32)
    long = make_plan(llama, Workload((1,), 131072, compile=True), prof, suggest=False, gpu_limit=139 * GiB,
                     host_available=125 * GiB, choose_keys=FREE_ALL)
    assert long.fits and long.workload.placement.reuse_attention == 32, long.placement_keys
    assert "memory.reuse_attention=32" in long.placement_keys and "reuse_attention" in long.why
    short = make_plan(llama, Workload((8,) * 4, 4096, compile=True), prof, suggest=False, gpu_limit=139 * GiB,
                      host_available=125 * GiB, choose_keys=FREE_ALL)
    assert short.fits and short.workload.placement.reuse_attention == 0
