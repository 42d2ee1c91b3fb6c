"""GPU equivalence (issue 2): megatrain on CUDA against an in-GPU transformers + torch.optim.AdamW reference.

    python3 -m pytest -q -m gpu tests/gpu/test_equivalence_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

A ~125M-parameter Llama-shaped model, 20 steps of 4 unequal, right-padded micro-batches, megatrain's runtime as the
trainer builds it (`build_runtime` on CUDA: weight slots, the H2D/compute/D2H streams, the optimizer thread with
pinned landing buffers, the LM-head kernels):
  bf16: megatrain bf16 (bf16 streamed weights, fp32 master + Adam on the CPU, the overlapped optimizer thread)
        vs transformers with fp32 master weights on the GPU, bf16 autocast, fused GPU AdamW;
  fp32: megatrain fp32 vs transformers fp32 (TF32 off): checks the CUDA stream/slot/landing-buffer path exactly.

bench/gpu_equivalence.py, which this replaces, reported the differences without bounds. The bounds here are 3.5-6x
the largest differences it measured on the H200 in calls 1, 9 and 10 (the first H200
round's results, in git history: fp32 parameters 1.65e-5; bf16 loss 8.8e-5, parameters 5.6e-3), and for the
fp32 loss the CPU tests' 1e-5 (measured: 2.0e-7).
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_results import write_result

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, HostStore, MicroBatch, build_runtime
from megatrain.runtime.adamw import clip_coefficient

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

LR, WD, MAX_NORM, STEPS = 3e-4, 0.1, 1.0, 20
BOUNDS = {"fp32": {"max_rel_loss_diff": 1e-5, "worst_param_rel_diff": 1e-4},
          "bf16": {"max_rel_loss_diff": 5e-4, "worst_param_rel_diff": 2e-2}}


def make_model(path: str) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def batches(step: int, vocab: int = 32000):
    g = torch.Generator().manual_seed(step)
    out = []
    for T in (512, 384, 256, 448):
        start = torch.randint(1, vocab, (8, 1), generator=g)
        stride = torch.randint(1, 7, (8, 1), generator=g)
        ids = 1 + (start + stride * torch.arange(T)) % (vocab - 1)
        labels = ids.clone()
        for r in range(8):
            real = int(torch.randint(T // 2, T + 1, (1,), generator=g))
            ids[r, real:], labels[r, real:] = 0, -100
        out.append((ids, labels))
    return out


def reference(path: str, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").cuda()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, fused=True)
    losses = []
    for step in range(STEPS):
        bs = batches(step)
        n = sum(int((l[:, 1:] != -100).sum()) for _, l in bs)
        total = 0.0
        for ids, labels in bs:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = model(input_ids=ids.cuda(), labels=labels.cuda(), num_items_in_batch=n)
            out.loss.backward()
            total += out.loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    del model, opt
    torch.cuda.empty_cache()
    return losses, params


def megatrain(path: str, precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    adapter = get_adapter(load_hf_config(path))
    store = HostStore(adapter, torch.bfloat16 if precision == "bf16" else torch.float32)
    store.load_safetensors(path)
    runtime = build_runtime(store, "cuda", CpuAdamW(weight_decay=WD))
    try:
        engine, pipeline = runtime.engine, runtime.pipeline
        # the CUDA path: two weight slots, the optimizer thread, the store's streaming copy and the landing
        # buffers page-locked
        assert engine.cuda and len(engine.slots) == 2 and pipeline.threaded
        assert runtime.pinned.registered_bytes >= store.stream.numel() * store.stream.element_size() \
            + sum(b.numel() * b.element_size() for b in pipeline.landing)
        losses = []
        for step in range(STEPS):
            mbs = [MicroBatch.from_labels(ids, labels) for ids, labels in batches(step)]
            out = engine.train_step(mbs)
            norm = math.sqrt(out.grad_sq_norm.item())
            losses.append(out.loss_sum.item())
            pipeline.finish_step(lr=LR, clip_coef=clip_coefficient(norm, MAX_NORM))
        pipeline.drain()
        params = {s.hf_name: v.clone() for t in store.tiles
                  for s, v in zip(t.unit.specs, t.views(t.master).values())}
    finally:
        runtime.close()
    return losses, params


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_equivalence")
    return str(d), make_model(str(d))


@pytest.fixture(scope="module")
def record(model_dir):
    """The JSON of bench/gpu_equivalence.py (params, steps, lr, one entry per precision), written at the end."""
    result = {"params": model_dir[1], "steps": STEPS, "lr": LR}
    yield result
    write_result("gpu_equivalence", __file__, result)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_runtime_matches_transformers_adamw(precision, model_dir, record, no_tf32):
    path = model_dir[0]
    ref_losses, ref_params = reference(path, precision)
    mt_losses, mt_params = megatrain(path, precision)
    rel = [abs(a - b) / abs(b) for a, b in zip(mt_losses, ref_losses)]
    prel = max(((mt_params[k] - ref_params[k]).norm() / ref_params[k].norm()).item() for k in mt_params)
    row = {"precision": precision, "loss_first": ref_losses[0], "loss_last_ref": ref_losses[-1],
           "loss_last_mt": mt_losses[-1], "max_rel_loss_diff": max(rel), "mean_rel_loss_diff": sum(rel) / len(rel),
           "max_abs_loss_diff": max(abs(a - b) for a, b in zip(mt_losses, ref_losses)),
           "worst_param_rel_diff": prel}
    record[precision] = {**row, "ref_losses": ref_losses, "megatrain_losses": mt_losses, "bounds": BOUNDS[precision]}
    print(precision, [f"{a:.4f}/{b:.4f}" for a, b in zip(mt_losses, ref_losses)], row)
    assert len(mt_losses) == STEPS and all(math.isfinite(x) for x in mt_losses)
    assert set(mt_params) == set(ref_params)
    for key, bound in BOUNDS[precision].items():
        assert row[key] <= bound, f"{precision}: {key} {row[key]:.3g} > {bound:.3g}"
