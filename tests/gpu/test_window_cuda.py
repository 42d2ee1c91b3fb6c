"""GPU test of sliding-window attention: on CUDA a windowed layer runs FlexAttention with a block mask that bounds
how far back a query sees (and, packed, keeps documents apart); on CPU an explicit mask, tested against
transformers in tests/test_sliding_window.py. Here the CUDA path must equal the CPU path.

    python3 -m pytest -q -m gpu tests/gpu/test_window_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. fp32, a qwen2 model whose layers 1.. use a window of 48 (layer 0 full): loss and gradients on CUDA equal CPU's,
   unpacked rows of 200 tokens and one packed row of four documents.
2. bf16 at length: one row of 32,768 tokens with a window of 4,096: the windowed layers build no T x T mask (peak
   memory within 0.5 GiB of full causal attention's); both step times are recorded, not asserted.
"""

from __future__ import annotations

import time

import pytest
import torch
from gpu_results import write_result

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, HostStore, MicroBatch, Runtime, build_runtime

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def model_dir(path, layers: int, hidden: int, window: int | None) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                      use_sliding_window=window is not None, sliding_window=window, max_window_layers=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


def runtime(d: str, dtype, device: str) -> Runtime:
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, dtype)
    store.load_safetensors(d)
    return build_runtime(store, device, CpuAdamW())


def step(rt: Runtime, rows) -> tuple[float, torch.Tensor]:
    out = rt.engine.train_step([MicroBatch.from_labels(i, l, p) for i, l, p in rows])
    n = out.num_targets
    grads = torch.cat([rt.pipeline.gradient(k).cpu().float() for k in range(len(rt.store.tiles))]) * n
    loss = out.loss_sum.item() * n
    rt.pipeline.finish_step(lr=0.0, clip_coef=1.0)  # the weights stay as they were
    return loss, grads


@pytest.fixture(scope="module")
def record():
    rows = []
    yield rows
    write_result("gpu_window", __file__, rows)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_windowed_cuda_equals_cpu(tmp_path, record, no_tf32):
    d = model_dir(tmp_path, 3, 256, window=48)
    assert get_adapter(load_hf_config(d)).layer_kinds == ["full", "sliding", "sliding"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (2, 200), generator=g)
    unpacked = [(ids, ids.clone(), None)]
    lengths = [37, 90, 5, 68]
    pids = torch.randint(1, 4096, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    plabels = pids.clone()
    plabels[0, pos[0] == 0] = -100
    packed = [(pids, plabels, pos)]
    results = {}
    for name, rows in (("unpacked", unpacked), ("packed", packed)):
        cpu, cuda = runtime(d, torch.float32, "cpu"), runtime(d, torch.float32, "cuda")
        try:
            ref_loss, ref_grads = step(cpu, rows)
            loss, grads = step(cuda, rows)
        finally:
            cpu.close()
            cuda.close()
        loss_rel = abs(loss - ref_loss) / abs(ref_loss)
        grad_rel = ((grads.double() - ref_grads.double()).norm() / ref_grads.double().norm()).item()
        results[name] = {"loss_rel": loss_rel, "grad_rel": grad_rel}
        assert loss_rel < 1e-5, name
        assert grad_rel < 1e-4, name
    record.append({"check": "windowed CUDA (FlexAttention) vs CPU (explicit mask), fp32", **results})


def test_windowed_long_row_builds_no_dense_mask(tmp_path, record):
    T, window = 32768, 4096
    rows = [(torch.randint(1, 4096, (1, T)), None, None)]
    rows = [(i, i.clone(), p) for i, _, p in rows]
    out = {}
    for name, w in (("full", None), ("window", window)):
        rt = runtime(model_dir(tmp_path / name, 3, 1024, window=w), torch.bfloat16, "cuda")
        try:
            step(rt, rows)  # compile and warm up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(3):
                step(rt, rows)
            torch.cuda.synchronize()
            out[name] = {"step_s": (time.perf_counter() - t0) / 3,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        finally:
            rt.close()
    record.append({"check": f"one row of {T} tokens, 3 layers (2 windowed at {window}), bf16", **out})
    assert out["window"]["peak_gib"] < out["full"]["peak_gib"] + 0.5  # a T x T bool mask alone is 1 GiB


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_cuda_equals_cpu(tmp_path, record, no_tf32, family):
    """Gemma on CUDA: gemma2's soft-capped scores through FlexAttention's score_mod (a causal block mask on every
    layer), both windows, per-kind RoPE, the scaled embedding and (gemma2) capped logits, against the CPU path
    (equal to transformers in tests/test_gemma.py); then bf16 with compiled layers trains (loss falls)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, sliding_window=48, query_pre_attn_scalar=32,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    if family == "gemma2":
        kw.update(attn_logit_softcapping=20.0, final_logit_softcapping=15.0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kw)).save_pretrained(str(tmp_path))
    d = str(tmp_path)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 4096, (2, 200), generator=g)
    lengths = [37, 90, 73]
    pids = torch.randint(1, 4096, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    plabels = pids.clone()
    plabels[0, pos[0] == 0] = -100
    results = {}
    for name, rows in (("unpacked", [(ids, ids.clone(), None)]), ("packed", [(pids, plabels, pos)])):
        cpu, cuda = runtime(d, torch.float32, "cpu"), runtime(d, torch.float32, "cuda")
        try:
            ref_loss, ref_grads = step(cpu, rows)
            loss, grads = step(cuda, rows)
        finally:
            cpu.close()
            cuda.close()
        loss_rel = abs(loss - ref_loss) / abs(ref_loss)
        grad_rel = ((grads.double() - ref_grads.double()).norm() / ref_grads.double().norm()).item()
        results[name] = {"loss_rel": loss_rel, "grad_rel": grad_rel}
        assert loss_rel < 1e-5, name
        assert grad_rel < 1e-4, name

    from megatrain.runtime import EngineOptions, RuntimeOptions

    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, torch.bfloat16)
    store.load_safetensors(d)
    rt = build_runtime(store, "cuda", CpuAdamW(), RuntimeOptions(engine=EngineOptions(compile_layers=True)))
    try:
        losses = []
        for _ in range(8):
            out = rt.engine.train_step([MicroBatch.from_labels(ids, ids.clone())])
            losses.append(out.loss_sum.item())
            rt.pipeline.finish_step(lr=1e-3, clip_coef=1.0)
    finally:
        rt.close()
    results["bf16_compiled_losses"] = losses
    record.append({"check": f"{family} CUDA vs CPU fp32; bf16 compiled training", **results})
    assert losses[-1] < losses[0]
