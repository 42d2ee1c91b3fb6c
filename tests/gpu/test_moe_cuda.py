"""GPU checks of the MoE layer (models/moe.py): on CUDA in bf16 the experts run as two grouped GEMMs
(torch._grouped_mm) over the tokens sorted by expert; elsewhere (CPU, fp32) a loop over the experts, which
tests/test_equivalence.py checks against transformers.

    python3 -m pytest -q -m gpu tests/gpu/test_moe_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. fp32 on CUDA (looped) equals CPU: a tiny qwen3_moe's loss and gradients, router loss included.
2. bf16 grouped equals bf16 looped on the same inputs (one MoE block at the Qwen3-30B-A3B shape, forward and
   backward), within bf16 rounding; and the grouped block runs with no host synchronisation
   (torch.cuda.set_sync_debug_mode("error")).
Their rate is a benchmark: bench/moe_experts.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from gpu_results import write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from moe_experts import inputs  # noqa: E402  (the benchmark's random routed tokens and experts)

from megatrain.models import get_adapter, load_hf_config
from megatrain.models.moe import _grouped_ffn, _looped_ffn
from megatrain.runtime import CpuAdamW, HostStore, MicroBatch, Runtime, build_runtime

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.fixture(scope="module")
def record():
    rows = []
    yield rows
    write_result("gpu_moe", __file__, rows)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def runtime(d: str, dtype, device: str) -> Runtime:
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, dtype)
    store.load_safetensors(d)
    return build_runtime(store, device, CpuAdamW())


def step(rt: Runtime, rows):
    out = rt.engine.train_step([MicroBatch.from_labels(i, l, None, m) for i, l, m in rows])
    grads = torch.cat([rt.pipeline.gradient(k).cpu().float() for k in range(len(rt.store.tiles))])
    loss = out.loss_sum.item()
    rt.pipeline.finish_step(lr=0.0, clip_coef=1.0)
    return loss, grads


def test_fp32_cuda_equals_cpu(tmp_path, record, no_tf32):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512,
                               moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                               num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                               norm_topk_prob=True, router_aux_loss_coef=0.01, output_router_logits=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(tmp_path))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 4096, (2, 160), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 120:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    rows = [(ids, labels, mask)]
    cpu, cuda = runtime(str(tmp_path), torch.float32, "cpu"), runtime(str(tmp_path), torch.float32, "cuda")
    try:
        ref_loss, ref_grads = step(cpu, rows)
        loss, grads = step(cuda, rows)
    finally:
        cpu.close()
        cuda.close()
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    grad_rel = ((grads.double() - ref_grads.double()).norm() / ref_grads.double().norm()).item()
    record.append({"check": "qwen3_moe fp32 CUDA vs CPU (router loss on, a padded row)", "loss_rel": loss_rel,
                   "grad_rel": grad_rel})
    assert loss_rel < 1e-5 and grad_rel < 1e-4


def test_grouped_equals_looped_and_never_syncs(record):
    N, H, I, E, k = 8192, 2048, 768, 128, 8  # Qwen3-30B-A3B's expert shape, 8192 tokens
    x, top_i, top_w, gate_up, down = inputs(N, H, I, E, k)
    results = {}
    outs = {}
    for name, fn in (("grouped", _grouped_ffn), ("looped", _looped_ffn)):
        xs, gu, dn, tw = (t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, top_w))
        y = fn(xs, top_i, tw, gu, dn)
        dy = torch.randn_like(y, generator=torch.Generator(device="cuda").manual_seed(9))
        y.backward(dy)
        outs[name] = [y.float(), xs.grad.float(), gu.grad.float(), dn.grad.float(), tw.grad.float()]
    for label, a, b in zip(("y", "dx", "dgate_up", "ddown", "dweights"), outs["grouped"], outs["looped"]):
        err = ((a - b).norm() / b.norm()).item()
        results[label] = err
        assert err < 1e-2, label  # bf16 products summed in another order
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # routing, sort, offsets, both grouped GEMMs and their backward: no device-to-host synchronisation
        xs, gu, dn, tw = (t.detach().clone().requires_grad_(True) for t in (x, gate_up, down, top_w))
        y = _grouped_ffn(xs, top_i, tw, gu, dn)
        y.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record.append({"check": "grouped vs looped experts, bf16, Qwen3-30B-A3B shape, relative errors", **results})
