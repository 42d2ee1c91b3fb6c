"""Placements on CUDA (issue 11): the bounded-memory paths the CPU cannot reach — rebuilt blocks, checkpoints spilled
to pinned host memory and fetched back on the H2D stream, gradients copied to host during backward, accumulators
parked in host memory between wave groups — compute the same step as the default placement, and keep less on the
GPU.

    python3 -m pytest -q -m gpu tests/gpu/test_placement_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

A Llama-shaped model (12 layers, hidden 768), 3 steps of 4 unequal micro-batches in fp32 with TF32 off. On the CPU
every placement is bit-identical (tests/test_placement.py); on CUDA the attention backward accumulates with atomics,
so two runs of even one placement may differ in the last bits: the bound is 1e-5 relative, the CPU tests' tolerance
against transformers.
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_results import write_result

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, MicroBatch, Placement, RuntimeOptions, \
    build_runtime
from megatrain.runtime.adamw import clip_coefficient

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

STEPS, TOL = 3, 1e-5
PLACEMENTS = {
    "K2-spill4": Placement(checkpoint_every=2, spill_layers=4),
    "K4": Placement(checkpoint_every=4),
    "K2-top3-spill2": Placement(checkpoint_every=2, keep_top_layers=3, spill_layers=2),  # rebuilds below the top 3
    "grads_to_host6": Placement(grads_to_host=6),
    "groups2-gpu": Placement(wave_groups=2),
    "groups3-host": Placement(wave_groups=3, group_grads="host"),
    "groups3-host-all-to-host": Placement(wave_groups=3, group_grads="host", grads_to_host=14),  # accumulators
    #                                    wait in the gradients' own host buffers (the 70B placement's shape)
    "all": Placement(checkpoint_every=3, spill_layers=6, grads_to_host=5, wave_groups=2, group_grads="host"),
}


def make_model(path: str) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)


def batches(step: int, vocab: int = 32000):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for T in (512, 384, 256, 448):
        ids = torch.randint(1, vocab, (4, T), generator=g)
        labels = ids.clone()
        labels[:, : T // 8] = -100
        out.append(MicroBatch.from_labels(ids, labels))
    return out


def train(path: str, placement: Placement) -> dict:
    adapter = get_adapter(load_hf_config(path))
    store = HostStore(adapter, torch.float32)
    store.load_safetensors(path)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    runtime = build_runtime(store, "cuda", CpuAdamW(weight_decay=0.1),
                            RuntimeOptions(engine=EngineOptions(placement=placement)))
    try:
        losses = []
        for step in range(STEPS):
            out = runtime.engine.train_step(batches(step))
            norm = math.sqrt(out.grad_sq_norm.item())
            losses.append(out.loss_sum.item())
            runtime.pipeline.finish_step(lr=3e-4, clip_coef=clip_coefficient(norm, 1.0))
        runtime.pipeline.drain()
        torch.cuda.synchronize()
        params = store.master.clone()
    finally:
        runtime.close()
    return {"losses": losses, "params": params, "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("placement_cuda"))
    make_model(path)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    base = train(path, Placement())
    record = {"default": {"losses": base["losses"], "gpu_peak_gib": base["gpu_peak_gib"]}}
    yield path, base, record
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    write_result("gpu_placement", __file__, record)


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_placement_is_the_same_step_on_cuda(setup, name):
    path, base, record = setup
    got = train(path, PLACEMENTS[name])
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], base["losses"]))
    param_rel = ((got["params"] - base["params"]).norm() / base["params"].norm()).item()
    record[name] = {"placement": str(PLACEMENTS[name]), "losses": got["losses"], "max_rel_loss_diff": loss_rel,
                    "param_rel_diff": param_rel, "gpu_peak_gib": got["gpu_peak_gib"]}
    print(name, record[name])
    assert loss_rel <= TOL and param_rel <= TOL, record[name]
    if name == "all":  # fewer checkpoints and gradients on the GPU
        assert got["gpu_peak_gib"] < base["gpu_peak_gib"], (got["gpu_peak_gib"], base["gpu_peak_gib"])
