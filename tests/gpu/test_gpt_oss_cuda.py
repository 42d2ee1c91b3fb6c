"""GPU checks of gpt_oss (models/gpt_oss.py and the sink path of models/attention.py). On CUDA the attention sinks
come from FlexAttention's log-sum-exp (o · σ(lse − sink), gradients through o, lse and the sink), and in bf16 the
experts run as grouped GEMMs with their biases and the clamped SwiGLU; on CPU both are explicit (the CPU tests check
them against transformers: tests/test_equivalence.py, tests/test_gpt_oss.py).

    python3 -m pytest -q -m gpu tests/gpu/test_gpt_oss_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. fp32 on CUDA equals CPU within 1e-5: a small gpt_oss (3 layers, sliding/full/sliding with a window of 48, sinks,
   yarn rope, 8 experts top 2 with biases, a SwiGLU limit the activations cross, router loss on): loss and every
   gradient, rows of 160 tokens (one padded), and one packed row of four documents.
2. The sink path alone, fp32: FlexAttention's (o, lse) with o · σ(lse − sink) equals the explicit formula in value
   and in the gradients of q, k, v and the sinks within 1e-5 (grouped-query heads; full causal, window, window with
   documents); and in bf16 at length (one row of 32,768 tokens, gpt-oss-120b's 64 heads of 64 and 8 KV heads, window
   128, forward + backward) it runs without any T x T tensor (64 heads x 32k² in bf16 would be 128 GiB): peak memory
   recorded and bounded.
3. Grouped experts equal the loop in bf16 at the gpt-oss-120b expert shape (H 2880, I 2880, E 128, top 4, 8192
   tokens), biases and clamp included, forward and backward within bf16 rounding; the grouped block runs with no
   host synchronisation; its forward+backward rate is recorded.
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_results import write_result

from megatrain.models import get_adapter, load_hf_config
from megatrain.models.attention import attention_context, sink_attention, sink_attention_explicit
from megatrain.models.gpt_oss import _grouped_clamped_ffn, _looped_clamped_ffn
from megatrain.runtime import CpuAdamW, HostStore, MicroBatch, Runtime, build_runtime

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.fixture(scope="module")
def record():
    rows = []
    yield rows
    write_result("gpu_gpt_oss", __file__, rows)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def model_dir(path) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "gpt_oss", vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=48, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=1024, swiglu_limit=1.0, router_aux_loss_coef=0.05, output_router_logits=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sinks and biases large enough to matter
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "bias")) or "norm" in name:
                p.add_(0.5 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return str(path)


def runtime(d: str, dtype, device: str) -> Runtime:
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, dtype)
    store.load_safetensors(d)
    return build_runtime(store, device, CpuAdamW())


def step(rt: Runtime, mbs):
    out = rt.engine.train_step(mbs)
    grads = torch.cat([rt.pipeline.gradient(k).cpu().float() for k in range(len(rt.store.tiles))])
    loss = out.loss_sum.item()
    rt.pipeline.finish_step(lr=0.0, clip_coef=1.0)
    return loss, grads


def test_fp32_cuda_equals_cpu(tmp_path, record, no_tf32):
    d = model_dir(tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (2, 160), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 120:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    lengths = [70, 30, 90, 60]  # one packed row of four documents
    packed = torch.randint(1, 4096, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    plabels = packed.clone()
    plabels[pos == 0] = -100
    cases = {"unpacked, a padded row": lambda: [MicroBatch.from_labels(ids, labels, None, mask)],
             "packed, 4 documents": lambda: [MicroBatch.from_labels(packed, plabels, pos)]}
    cpu, cuda = runtime(d, torch.float32, "cpu"), runtime(d, torch.float32, "cuda")
    try:
        for name, mbs in cases.items():
            ref_loss, ref_grads = step(cpu, mbs())
            loss, grads = step(cuda, mbs())
            loss_rel, grad_rel = abs(loss - ref_loss) / abs(ref_loss), rel(grads, ref_grads)
            record.append({"check": f"gpt_oss fp32 CUDA vs CPU, {name} (router loss on)", "loss_rel": loss_rel,
                           "grad_rel": grad_rel})
            assert loss_rel < 1e-5 and grad_rel < 1e-5, name
    finally:
        cpu.close()
        cuda.close()


def _attn_inputs(B, H, KV, T, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, T, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(B, KV, T, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, KV, T, d, device="cuda", generator=g).to(dtype)
    sinks = torch.randn(H, device="cuda", generator=g).to(dtype)
    return q, k, v, sinks


@pytest.mark.parametrize("window,packed", [(None, False), (64, False), (64, True)], ids=["full", "window",
                                                                                        "window+documents"])
def test_sinks_from_flex_lse_equal_the_explicit_formula(record, no_tf32, window, packed):
    B, H, KV, T, d = 2, 8, 2, 300, 64
    q, k, v, sinks = _attn_inputs(B, H, KV, T, d, torch.float32, seed=3)
    pos = torch.arange(T).repeat(B, 1)
    if packed:
        pos[0, 100:] -= 100  # two documents in row 0, three in row 1
        pos[1, 50:] -= 50
        pos[1, 220:] -= 170
    cos = sin = torch.zeros(B, T, d)
    flex_ctx = attention_context(pos.cuda(), cos.cuda(), sin.cuda(), packed, window, force_mask=True)
    cpu_ctx = attention_context(pos, cos, sin, packed, window, force_mask=True)  # the explicit bool mask
    assert flex_ctx.block_mask is not None and cpu_ctx.mask is not None
    mask = cpu_ctx.mask.cuda()
    outs = {}
    for name, fn in (("flex", lambda *t: sink_attention(*t, flex_ctx, d**-0.5)),
                     ("explicit", lambda *t: sink_attention_explicit(*t, mask, d**-0.5))):
        inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
        o = fn(*inputs)
        do = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
        o.backward(do)
        outs[name] = [o.detach()] + [t.grad for t in inputs]
    errs = {lab: rel(a, b) for lab, a, b in zip(("o", "dq", "dk", "dv", "dsinks"), outs["flex"], outs["explicit"])}
    record.append({"check": f"sink attention, FlexAttention LSE vs explicit, fp32, window {window}, "
                            f"packed {packed}, relative errors", **errs})
    for lab, e in errs.items():
        assert e < 1e-5, lab


def test_sinks_at_length_build_no_t_by_t_tensor(record):
    H, KV, T, d, W = 64, 8, 32768, 64, 128  # gpt-oss-120b's attention, one row of 32k tokens
    q, k, v, sinks = _attn_inputs(1, H, KV, T, d, torch.bfloat16, seed=5)
    pos = torch.arange(T, device="cuda")[None]
    ctx = attention_context(pos, None, None, False, W, force_mask=True)
    inputs = [t.detach().clone().requires_grad_(True) for t in (q, k, v, sinks)]
    for _ in range(2):  # the first call compiles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        o = sink_attention(*inputs, ctx, d**-0.5)
        o.backward(torch.ones_like(o))
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() - base
        del o
        for t in inputs:
            t.grad = None
    record.append({"check": "sink attention bf16, 1 x 32768 tokens, 64 heads of 64, 8 KV heads, window 128, "
                            "fwd+bwd", "seconds": dt, "peak_gib_above_inputs": peak / 2**30})
    assert peak < 4 * 2**30  # q, k, v, o, lse and their gradients are ~1 GiB; a T x T score tensor is 128 GiB


def _expert_inputs(N, H, I, E, k, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(N, E, device="cuda", generator=g)
    top_v, top_i = torch.topk(logits, k, dim=-1)
    top_w = torch.softmax(top_v, dim=-1).to(torch.bfloat16)
    # pre-activations of std ~4: a share of gate and up values cross gpt-oss's limit of 7
    gate_up = (torch.randn(E, H, 2 * I, device="cuda", generator=g) * 4 * H**-0.5).to(torch.bfloat16)
    gate_up_b = (torch.randn(E, 2 * I, device="cuda", generator=g)).to(torch.bfloat16)
    down = (torch.randn(E, I, H, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    down_b = (torch.randn(E, H, device="cuda", generator=g)).to(torch.bfloat16)
    return x, top_i, top_w, gate_up, gate_up_b, down, down_b


def test_grouped_experts_equal_the_loop_and_never_sync(record):
    N, H, I, E, k = 8192, 2880, 2880, 128, 4  # gpt-oss-120b's experts, 8192 tokens
    x, top_i, *weights = _expert_inputs(N, H, I, E, k)
    outs = {}
    for name, fn in (("grouped", _grouped_clamped_ffn), ("looped", _looped_clamped_ffn)):
        ts = [t.detach().clone().requires_grad_(True) for t in (x, *weights)]
        y = fn(ts[0], top_i, *ts[1:], 1.702, 7.0)
        dy = torch.randn(y.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
        y.backward(dy.to(y.dtype))
        outs[name] = [y.float()] + [t.grad.float() for t in ts]
    labels = ("y", "dx", "dweights", "dgate_up", "dgate_up_bias", "ddown", "ddown_bias")
    errs = {lab: rel(a, b) for lab, a, b in zip(labels, outs["grouped"], outs["looped"])}
    h = x[:256].float() @ weights[1][0].float() + weights[2][0].float()  # expert 0's pre-activations (gate_up, bias)
    clamped = (h.abs() > 7).float().mean().item()  # the clamp acts on a share of them
    for lab, e in errs.items():
        assert e < 2e-2, lab  # bf16 products summed in another order
    assert clamped > 0.01
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # sort, offsets, bias gathers, both grouped GEMMs and their backward: no device-to-host synchronisation
        ts = [t.detach().clone().requires_grad_(True) for t in (x, *weights)]
        y = _grouped_clamped_ffn(ts[0], top_i, *ts[1:], 1.702, 7.0)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ts = [t.detach().clone().requires_grad_(True) for t in (x, *weights)]

    def once():
        y = _grouped_clamped_ffn(ts[0], top_i, *ts[1:], 1.702, 7.0)
        y.backward(torch.ones_like(y))

    once()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        once()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / 5
    flops = 3 * 2 * N * k * (3 * H * I)
    record.append({"check": "gpt_oss grouped vs looped experts, bf16, gpt-oss-120b shape, 8192 tokens, relative "
                            "errors", **errs, "share_of_pre_activations_clamped": clamped})
    record.append({"check": "gpt_oss grouped experts fwd+bwd (eager), gpt-oss-120b shape, 8192 tokens",
                   "seconds": dt, "tflops": flops / dt / 1e12})
