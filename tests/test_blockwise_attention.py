"""The attention's backward over blocks of queries and keys (memory.attn_block, models/attention.blockwise_causal).

The forward is the flash kernel over the whole row; the backward runs the kernel's backward per (query block, key
block) pair from the row's output and log-sum-exp and sums the pairs in fp32. On CPU the same code runs CPU's flash
kernels, so the decomposition itself is checked here: against autograd through SDPA in float64 on fresh random
inputs (grouped and plain heads, a row that is not a multiple of the block, several rows), the engine with it against
the engine without it and against transformers + torch AdamW at 1e-5 on an 8,192-token row, and the planner's
memory of it (the meta device) against the fused kernel's. The CUDA kernels: tests/gpu/test_blockwise_cuda.py.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from megatrain.models.attention import attention_blocks, blockwise_causal, causal_attention
from megatrain.runtime import Placement
from megatrain.runtime.layer import TiledLayer, layer_backward, layer_template
from reference import Megatrain, random_batches, rel
from test_long_context import two_long_steps_like_transformers
from test_tiling import adapter_of, layer_inputs


def _qkv(B, h, kh, T, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # laid out [B, T, heads, d] and viewed [B, heads, T, d], as the layer's buffers are
    return [torch.randn(B, T, n, d, generator=g, dtype=dtype).transpose(1, 2) for n in (h, kh, kh)]


@pytest.mark.parametrize("kh", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("T,block", [(70, 16), (64, 16), (33, 32), (50, 7)])
def test_blockwise_backward_equals_autograd_through_sdpa_in_float64(kh, T, block):
    q, k, v = _qkv(2, 4, kh, T, 16, torch.float64, seed=T * block + kh)
    do = torch.randn(2, 4, T, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    scale = 0.3
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=kh != 4)
    ref_grads = torch.autograd.grad(ref, leaves, do)
    mine = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = blockwise_causal(*mine, scale, block)
    assert out.grad_fn is not None and "Blockwise" in type(out.grad_fn).__name__
    assert rel(out, ref) <= 1e-14
    grads = torch.autograd.grad(out, mine, do)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel(a, b) <= 1e-13, (name, rel(a, b))
        assert a.transpose(1, 2).is_contiguous(), name  # laid out as q, k, v: views back to the layer's buffers
    assert len(attention_blocks(T, block)) == -(-T // block)


def test_blockwise_backward_in_fp32_is_as_close_to_float64_as_the_whole_kernel():
    """fp32: each pair's gradient is rounded before the sum; the result is as close to the float64 truth as the
    whole-row kernel's (within 4x its error), for 8 blocks."""
    q, k, v = _qkv(1, 4, 2, 256, 32, torch.float64, seed=11)
    do = torch.randn(1, 4, 256, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    leaves64 = [t.detach().requires_grad_(True) for t in (q, k, v)]
    truth = torch.autograd.grad(F.scaled_dot_product_attention(*leaves64, is_causal=True, enable_gqa=True),
                                leaves64, do)
    f32 = [t.float().detach().requires_grad_(True) for t in (q, k, v)]
    whole = torch.autograd.grad(F.scaled_dot_product_attention(*f32, is_causal=True, enable_gqa=True), f32,
                                do.float())
    f32b = [t.float().detach().requires_grad_(True) for t in (q, k, v)]
    blocks = torch.autograd.grad(blockwise_causal(*f32b, 32 ** -0.5, 32), f32b, do.float())
    for name, t, a, b in zip("qkv", truth, whole, blocks):
        assert rel(b, t) <= 4 * max(rel(a, t), 1e-7), (name, rel(b, t), rel(a, t))


def test_grad_in_place_writes_dq_over_the_output_gradient():
    q, k, v = _qkv(2, 4, 2, 48, 16, torch.float64, seed=3)
    do = torch.randn(2, 48, 4, 16, dtype=torch.float64).transpose(1, 2)  # laid out as the layer's d(output)
    keep = do.clone()
    a = [t.detach().requires_grad_(True) for t in (q, k, v)]
    want = torch.autograd.grad(blockwise_causal(*a, 0.25, 16), a, keep)
    b = [t.detach().requires_grad_(True) for t in (q, k, v)]
    got = torch.autograd.grad(blockwise_causal(*b, 0.25, 16, grad_in_place=True), b, do)
    assert got[0].untyped_storage().data_ptr() == do.untyped_storage().data_ptr()  # one row-sized buffer less
    for x, y in zip(got, want):
        assert torch.equal(x, y)


def test_causal_attention_blocks_only_plain_rows_longer_than_the_block():
    adapter = adapter_of("llama")
    for packed in (False, True):
        w, ctx, x, dh, extra = layer_inputs(adapter, packed, seed=1)
        ctx.with_attn_block(16)
        q, k, v = _qkv(2, 4, 2, x.shape[1], 8, torch.float32, seed=2)
        q.requires_grad_(True)
        out = causal_attention(q, k, v, ctx, 0.5)
        assert ("Blockwise" in type(out.grad_fn).__name__) == (not packed)  # packed rows keep their document mask
    ctx.with_attn_block(x.shape[1])  # a row no longer than the block: the fused kernel
    assert "Blockwise" not in type(causal_attention(q, k, v, ctx, 0.5).grad_fn).__name__


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "olmo2", "qwen3_moe"])
def test_a_layer_with_blocked_attention_backward_is_the_same_layer(family):
    """The split layer (tiles of 16 tokens, or none), its attention's backward over blocks of 16: the output bit for
    bit, d(input) and every weight gradient within the reordering of sums (1e-6) of the same layer with the fused
    kernel's backward; the compiled whole layer is not used for rows longer than the block."""
    adapter = adapter_of(family)
    for tile in (0, 16):
        blocked = layer_template(adapter, tile, attn_block=16)
        assert isinstance(blocked, TiledLayer)
        fused = TiledLayer(adapter, tile or 10**6)
        specs = adapter.units()[1].specs
        w, ctx, x, dh, extra = layer_inputs(adapter, False, seed=7 + tile)
        with torch.no_grad():
            a = fused(w, x, ctx)
            ctx.with_attn_block(16)
            b = blocked(w, x, ctx)
        for p, r in zip(*((o,) if not adapter.moe else o for o in (a, b))):
            assert torch.equal(p, r), family
        g_b = [torch.randn(s.shape) for s in specs]
        g_f = [g.clone() for g in g_b]
        dx_b = layer_backward(blocked, w, x, ctx, dh.clone(), g_b, extra)
        ctx.with_attn_block(0)
        dx_f = layer_backward(fused, w, x, ctx, dh.clone(), g_f, extra)
        assert rel(dx_b, dx_f) <= 1e-6, (family, tile, rel(dx_b, dx_f))
        for s, p, r in zip(specs, g_b, g_f):
            assert rel(p, r) <= 1e-6, (family, tile, s.name, rel(p, r))


@pytest.mark.parametrize("family,tied,placement", [
    ("llama", False, Placement(attn_block=16, seq_tile=16)),
    ("qwen2", True, Placement(attn_block=24, checkpoint_every=2, reuse_attention=2)),
    ("qwen3_moe", False, Placement(attn_block=32, seq_tile=48, wave_groups=2, spill_layers=1)),
])
def test_a_step_with_blocked_attention_backward_is_the_same_step(tmp_path, family, tied, placement):
    """The engine, three padded micro-batches of unequal lengths, two steps: the first step's loss, norm and every
    gradient equal the run with the fused kernel's backward up to the order of sums (1e-6); the second step (after
    AdamW, whose m/sqrt(v) magnifies relative differences of near-zero gradients) and the updated weights within
    the 1e-5 both keep to transformers + torch AdamW."""
    make_model_dir(tmp_path, family, tied=tied, seed=5, layers=3)
    fused = Megatrain(tmp_path, placement=Placement(**{**placement.__dict__, "attn_block": 0}))
    blocked = Megatrain(tmp_path, placement=placement)
    assert isinstance(blocked.engine.layer, TiledLayer)
    for step in range(2):
        batches = random_batches(3, 2, 97, [70, 40, 57], seed=21 + step)
        l0, n0, g0 = fused.train_step(batches, keep_grads=True)
        l1, n1, g1 = blocked.train_step(batches, keep_grads=True)
        bound = 1e-6 if step == 0 else 1e-5
        assert abs(l1 - l0) <= bound * abs(l0) and abs(n1 - n0) <= bound * abs(n0), (step, l0, l1, n0, n1)
        for name, g in g0.items():
            assert rel(g1[name], g) <= bound, (step, name, rel(g1[name], g))
    p0, p1 = fused.params(), blocked.params()
    for name, p in p0.items():
        assert rel(p1[name], p) <= 1e-5, name
    fused.close()
    blocked.close()


def test_an_8k_sequence_with_blocked_attention_backward_trains_like_transformers(tmp_path):
    """One 8,192-token row per step, 2 steps, the attention's backward over blocks of 1,024 tokens (36 pairs), the
    layer over tiles of 1,024, checkpoints every 2 layers: within 1e-5 of transformers (SDPA) + torch AdamW."""
    make_model_dir(tmp_path, "llama", seed=7, layers=2)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    two_long_steps_like_transformers(ref, Megatrain(tmp_path, placement=Placement(
        attn_block=1024, seq_tile=1024, checkpoint_every=2)))


def test_the_planner_measures_the_blocked_backward_smaller_and_chooses_it_where_only_it_fits():
    """On the meta device the blocked backward of a Llama-3.1-8B layer at 524,288 tokens leaves out the fused
    kernel's fp32 d(q) accumulator and per-query-head d(k), d(v) (8 + 4 + 4 GiB) and writes d(q) over d(output)
    (4 GiB); with no keys the planner blocks it where the tiled layer alone does not fit, not at 32k rows, not
    on packed rows nor on a family whose attention runs FlexAttention."""
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.activations import layer_memory
    from megatrain.planner.placement import FREE_ALL, attn_block_for
    from megatrain.planner.profile import GiB, load_profile
    from test_plan import adapter_of as real_adapter

    llama = real_adapter("llama-3.1-8b", 32)
    whole = layer_memory(llama, 1, 524288, seq_tile=8192)["backward_peak"]
    blocked = layer_memory(llama, 1, 524288, seq_tile=8192, attn_block=65536)["backward_peak"]
    assert 14.0 * GiB <= whole - blocked <= 14.6 * GiB, (whole / GiB, blocked / GiB)
    assert attn_block_for(llama, Workload((1,), 524288)) == 65536
    # packed rows on the varlen kernel block too (models/varlen.py), measured as smaller the same way
    assert attn_block_for(llama, Workload((1,), 524288, packed=True)) == 65536
    packed_whole = layer_memory(llama, 1, 524288, packed=True, seq_tile=8192)["backward_peak"]
    packed_blocked = layer_memory(llama, 1, 524288, packed=True, seq_tile=8192, attn_block=65536)["backward_peak"]
    assert 14.0 * GiB <= packed_whole - packed_blocked, (packed_whole / GiB, packed_blocked / GiB)
    assert attn_block_for(llama, Workload((1,), 65536)) == 0
    assert attn_block_for(real_adapter("gemma-2-9b", 42), Workload((1,), 524288)) == 0  # soft-capping: FlexAttention
    prof = load_profile(None)
    p = make_plan(llama, Workload((1,), 524288, compile=True), prof, suggest=False, gpu_limit=78 * GiB,
                  host_available=125 * GiB, choose_keys=FREE_ALL)
    assert p.fits and p.workload.placement.attn_block == 65536, (p.why, p.problems)
    assert "memory.attn_block=65536" in p.placement_keys and "blocks of 65536 tokens" in p.why
    short = make_plan(llama, Workload((1,), 32768, compile=True), prof, suggest=False, gpu_limit=78 * GiB,
                      host_available=125 * GiB, choose_keys=FREE_ALL)
    assert short.fits and short.workload.placement.attn_block == 0
    with pytest.raises(ValueError):
        Placement(attn_block=-1)


def test_the_planner_times_blocked_attention_at_its_measured_rate_and_probes_only_near_their_length():
    """The blocked layers' attention at 1/BLOCKED_ATTENTION_SLOWDOWN of the attention rate (SDPA's kernels per block
    pair, measured on the H200), the matmuls unchanged; and a layer rate probed at 4,096 tokens is not applied to a
    524,288-token row (attention is ~7% of such a layer's FLOPs at 4,096 and ~91% at 524,288), but is to 8,192."""
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.profile import (BLOCKED_ATTENTION_SLOWDOWN, COMPILED_SPEEDUP, LayerRate, Profile,
                                           layer_shape)
    from test_plan import adapter_of as real_adapter

    llama = real_adapter("llama-3.1-8b", 4)
    prof = Profile(source="t", measured=True)
    pl = Placement(seq_tile=8192)
    fused = make_plan(llama, Workload((1,), 524288, compile=True, clipping=False, placement=pl), prof, suggest=False)
    blocked = make_plan(llama, Workload((1,), 524288, compile=True, clipping=False,
                                        placement=Placement(seq_tile=8192, attn_block=65536)), prof, suggest=False)
    attn = 2.0 * 524288 * llama.num_heads * llama.head_dim * 524288  # one layer's attention forward, one row
    layers = len(llama.units()) - 2
    attn_flops = attn * (layers + 3 * layers)  # forward wave, then recompute + backward
    extra = attn_flops / (prof.attention_rate(524288) * COMPILED_SPEEDUP) * (BLOCKED_ATTENTION_SLOWDOWN - 1.0)
    assert blocked.time["compute_s"] == pytest.approx(fused.time["compute_s"] + extra, rel=1e-6)
    assert "BLOCKED_ATTENTION_SLOWDOWN" in blocked.time["rate_source"]
    shape = dict(zip(("hidden", "intermediate", "heads", "kv_heads", "head_dim"), layer_shape(llama)))
    r = LayerRate(**shape, micro=1, seq=4096, compile=True, forward_flops=650e12, backward_flops=600e12,
                  activation_peak_bytes=0)
    probed = Profile(source="t", measured=True, layer_rates=[r])
    assert probed.layer_rate(llama, 1, 524288, True)[0] is None
    assert "too far from 524288" in probed.layer_rate(llama, 1, 524288, True)[1]
    assert probed.layer_rate(llama, 1, 8192, True)[0] == r


def test_blocked_attention_is_refused_for_fp32_on_cuda_and_not_chosen_there():
    """The flash kernel takes bf16 on CUDA: an fp32 CUDA run with memory.attn_block is refused by name before it
    runs; the planner does not choose it for one (fp32 CPU runs may: CPU's flash kernels take fp32)."""
    from megatrain.errors import MegatrainError
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.placement import attn_block_for
    from megatrain.planner.profile import load_profile
    from test_plan import adapter_of as real_adapter

    llama = real_adapter("llama-3.1-8b", 2)
    with pytest.raises(MegatrainError, match="memory.attn_block: 65536, but train.precision is fp32"):
        make_plan(llama, Workload((1,), 262144, precision="fp32", placement=Placement(attn_block=65536)),
                  load_profile(None), suggest=False)
    assert attn_block_for(llama, Workload((1,), 262144, precision="fp32")) == 0
    assert attn_block_for(llama, Workload((1,), 262144, precision="fp32", device="cpu")) == 65536
