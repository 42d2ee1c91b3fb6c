"""Sequence tiling inside the layer on CUDA (issue 15): the layer with its per-token parts over tiles of tokens
computes what the whole layer computes, eagerly and compiled, and its memory is what the planner measures on the
meta device.

    python3 -m pytest -q -m gpu tests/gpu/test_tiling_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. One Llama-3.1-8B-shaped layer (random weights, bf16) over one 65,536-token row, tiles of 8,192: the forward and
   d(input) agree with the whole layer at bf16's rounding (the GEMMs of a tile may pick other cuBLAS kernels than
   the whole; flash attention's backward accumulates with atomics), the weight gradients too (eager); the same
   layer in fp32 (TF32 off), eager and compiled, each against the whole layer run the same way, within 1e-5.
2. The same layer's recompute + backward: torch.cuda.max_memory_allocated above what was allocated before, tiled
   and whole, against planner.activations.layer_memory (the planner's number, FlashLike attention) within 10%;
   tiled at most 45% of whole (the planner: 4.52 GiB tiled, 16.37 GiB whole at this shape).
3. A step of the engine with memory.seq_tile (a 12-layer Llama-shaped model, fp32, TF32 off, rows of 2,048 and 1,536
   tokens, tiles of 512) against the same step untiled: loss, gradient norm and gradients within 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_results import write_result

from megatrain.runtime.layer import TiledLayer, layer_backward, layer_template

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

GiB = 2**30
SEQ, TILE = 65536, 8192


def llama8b_layer(dtype=torch.bfloat16, seq=SEQ):
    from transformers import LlamaConfig

    from megatrain.models import get_adapter

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                      rope_theta=500000.0, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                       "rope_theta": 500000.0})
    adapter = get_adapter(cfg)
    unit = adapter.units()[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    w = {s.name: (torch.randn(s.shape, device="cuda", generator=g) * 0.02 if len(s.shape) > 1 else
                  1.0 + 0.1 * torch.randn(s.shape, device="cuda", generator=g)).to(dtype) for s in unit.specs}
    pos = torch.arange(seq, device="cuda")[None]
    ctx = adapter.make_context(pos, dtype, False)
    x = torch.randn(1, seq, 4096, device="cuda", generator=g).to(dtype)
    dh = (torch.randn(1, seq, 4096, device="cuda", generator=g) * 1e-3).to(dtype)
    return adapter, unit, w, ctx, x, dh


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def test_tiled_layer_equals_the_whole_layer_in_bf16():
    adapter, unit, w, ctx, x, dh = llama8b_layer()
    out = {}
    # each against the whole layer run the same way: compiled kernels keep elementwise intermediates in fp32 where
    # eager rounds each op to bf16, so compiled-tiled against eager-whole would measure compilation, not tiling
    # (the first H200 run of this check did that: output 6.7e-3 apart)
    compiled_whole = torch.compile(adapter.layer_forward, dynamic=False)
    for name, layer, whole_layer in (("eager", TiledLayer(adapter, TILE), adapter.layer_forward),
                                     ("compiled", TiledLayer(adapter, TILE, compile=True), compiled_whole)):
        with torch.no_grad():
            whole = whole_layer(w, x, ctx)
        g_whole = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
        dx_whole = layer_backward(whole_layer, w, x, ctx, dh.clone(), g_whole)
        with torch.no_grad():
            got = layer(w, x, ctx)
        g = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
        dx = layer_backward(layer, w, x, ctx, dh.clone(), g)
        out[name] = {"output": rel(got, whole), "d_input": rel(dx, dx_whole),
                     "weights": max(rel(a, b) for a, b in zip(g, g_whole))}
    write_result("tiling_bf16", __file__, out)
    # eager: bf16 rounding of different kernels (2^-8 = 3.9e-3 per element). Compiled, inductor fuses the tile's
    # graph and the whole layer's differently (where each keeps fp32 intermediates): 6.0e-3 apart on the H200, a
    # rounding difference, not an error; recorded here, and checked in fp32 below, where rounding cannot hide one
    r = out["eager"]
    assert r["output"] <= 4e-3 and r["d_input"] <= 2e-2 and r["weights"] <= 2e-2, ("eager", r)


def test_tiled_layer_equals_the_whole_layer_in_fp32():
    """Eager and compiled, fp32 weights and activations, TF32 off: the tiled layer's output, d(input) and weight
    gradients equal the whole layer's within 1e-5 (the same kernels on other row counts). 8,192 tokens in tiles of
    1,024: SDPA has no fused fp32 kernel for grouped-query heads, and its math fallback builds the T x T scores
    (512 GiB at 65,536 tokens)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        adapter, unit, w, ctx, x, dh = llama8b_layer(torch.float32, seq=8192)
        out = {}
        for name, layer, whole_layer in (
                ("eager", TiledLayer(adapter, 1024), adapter.layer_forward),
                ("compiled", TiledLayer(adapter, 1024, compile=True),
                 torch.compile(adapter.layer_forward, dynamic=False))):
            with torch.no_grad():
                whole = whole_layer(w, x, ctx)
                got = layer(w, x, ctx)
            g_whole = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
            dx_whole = layer_backward(whole_layer, w, x, ctx, dh.clone(), g_whole)
            g = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
            dx = layer_backward(layer, w, x, ctx, dh.clone(), g)
            out[name] = {"output": rel(got, whole), "d_input": rel(dx, dx_whole),
                         "weights": max(rel(a, b) for a, b in zip(g, g_whole))}
            del whole, got, dx, dx_whole, g, g_whole
            torch.cuda.empty_cache()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    write_result("tiling_fp32", __file__, out)
    for name, r in out.items():
        assert max(r.values()) <= 1e-5, (name, r)


def _backward_peak(layer, adapter, unit, w, ctx, x, dh) -> int:
    g = [torch.zeros(s.shape, device="cuda") for s in unit.specs]
    dx = layer_backward(layer, w, x, ctx, dh.clone(), g)  # warm-up (kernels, workspaces)
    del dx
    d = dh.clone()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    dx = layer_backward(layer, w, x, ctx, d, g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del dx
    return peak


def test_tiled_layer_memory_is_the_planners():
    from megatrain.planner.activations import layer_memory

    adapter, unit, w, ctx, x, dh = llama8b_layer()
    measured = {"whole": _backward_peak(layer_template(adapter, 0), adapter, unit, w, ctx, x, dh),
                "tiled": _backward_peak(layer_template(adapter, TILE), adapter, unit, w, ctx, x, dh)}
    planned = {"whole": layer_memory(adapter, 1, SEQ)["backward_peak"],
               "tiled": layer_memory(adapter, 1, SEQ, seq_tile=TILE)["backward_peak"]}
    write_result("tiling_memory", __file__, {k: {"measured_gib": measured[k] / GiB, "planned_gib": planned[k] / GiB}
                                             for k in measured})
    for k in measured:
        assert abs(planned[k] - measured[k]) <= 0.10 * measured[k], (k, measured[k] / GiB, planned[k] / GiB)
    assert measured["tiled"] <= 0.45 * measured["whole"], {k: v / GiB for k, v in measured.items()}


def make_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def test_a_step_with_tiles_on_cuda(tmp_path):
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, MicroBatch, Placement, RuntimeOptions, \
        build_runtime

    make_model(str(tmp_path))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(3)
    mbs = []
    for T in (2048, 1536):
        ids = torch.randint(1, 32000, (2, T), generator=g)
        labels = ids.clone()
        labels[:, :100] = -100
        mbs.append(MicroBatch.from_labels(ids, labels))

    def step(placement):
        adapter = get_adapter(load_hf_config(str(tmp_path)))
        store = HostStore(adapter, torch.float32)
        store.load_safetensors(str(tmp_path))
        rt = build_runtime(store, "cuda", CpuAdamW(weight_decay=0.1),
                           RuntimeOptions(engine=EngineOptions(placement=placement)))
        try:
            out = rt.engine.train_step(mbs)
            grads = [rt.pipeline.gradient(i).clone() for i in range(len(store.tiles))]
            return out.loss_sum.item(), math.sqrt(out.grad_sq_norm.item()), grads
        finally:
            rt.pipeline.drain()
            rt.close()

    l0, n0, g0 = step(Placement())
    l1, n1, g1 = step(Placement(seq_tile=512, checkpoint_every=2))
    worst = max(rel(a, b) for a, b in zip(g1, g0))
    write_result("tiling_step_fp32", __file__, {"loss": [l0, l1], "norm": [n0, n1], "worst_grad_rel": worst})
    assert abs(l1 - l0) <= 1e-5 * abs(l0) and abs(n1 - n0) <= 1e-5 * n0 and worst <= 1e-5
