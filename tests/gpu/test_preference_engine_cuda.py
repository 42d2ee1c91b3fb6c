"""Preference objectives on CUDA: the engine's two-pass head with the Triton kernel's forward-only and per-row-scale
forms, the reference copy streamed through the weight slots, against transformers + torch AdamW on the same GPU.

    python3 -m pytest -q -m gpu tests/gpu/test_preference_engine_cuda.py

fp32 (TF32 off): dpo with the streamed reference and orpo, 8 steps of 2 micro-batches of 4 pairs of 32 and 48
tokens (vocabulary 9001: more than two kernel blocks per row). The streamed reference's log-probs within 1e-5 of the
frozen transformers copy; every step's loss within 1e-4 (both sides given the streamed reference log-probs: a row's
log-prob sums ~40 token log-probs of ~-9 over 9001 logits each, so fp32 rounding alone moves it by ~1e-5 absolute,
which DPO's β·(difference of sums) passes on to the loss; the same test on the CPU differs by up to 1.7e-5); the
weights within 1e-4 (the CUDA equivalence test's bound, tests/gpu/test_equivalence_cuda.py). bf16: the precomputed
and the streamed reference log-probs are the same numbers bit for bit, and the copy stays frozen.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_model_dir
from reference import EPS, WD, pair_batches, reference_optimizer, rel
from test_equivalence import load_reference
from test_preference_engine import OBJECTIVES, frozen_logps, reference_pref_step

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, MicroBatch, RuntimeOptions, build_runtime
from megatrain.runtime.adamw import clip_coefficient

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)

VOCAB, STEPS = 9001, 8


def runtime(model_dir, dtype, objective):
    store = HostStore(get_adapter(load_hf_config(model_dir)), dtype, dtype)
    store.load_safetensors(model_dir, progress=False)
    return build_runtime(store, "cuda", CpuAdamW(eps=EPS, weight_decay=WD),
                         RuntimeOptions(engine=EngineOptions(objective=objective)))


def mbs_of(batches, refs=None):
    return [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"],
                                   ref_logps=None if refs is None else refs[m]) for m, b in enumerate(batches)]


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_fp32_steps_equal_transformers_on_the_gpu(tmp_path, name):
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        make_model_dir(tmp_path, "llama", seed=41, vocab=VOCAB)
        ref = load_reference(tmp_path).cuda()
        frozen, opt = copy.deepcopy(ref).eval(), reference_optimizer(ref)
        rt = runtime(tmp_path, torch.float32, OBJECTIVES[name])
        rt.store.freeze_reference()
        for step in range(STEPS):
            batches = pair_batches(2, 4, VOCAB, [32, 48], seed=900 + step)
            on_gpu = [{k: v.cuda() for k, v in b.items()} for b in batches]
            refs = None
            if OBJECTIVES[name].needs_reference:
                want = frozen_logps(frozen, on_gpu)
                got = rt.engine.sequence_logps(mbs_of(batches), weights="reference")[0]
                assert rel(got, torch.cat(want)) <= 1e-5, f"reference log-probs at step {step}"
                refs = list(got.split(8))
            ref_loss = reference_pref_step(ref, opt, on_gpu, name, refs or [None, None])[0]
            out = rt.engine.train_step(mbs_of(batches, refs))
            norm = out.grad_sq_norm.sqrt().item()
            rt.pipeline.finish_step(lr=1e-3, clip_coef=clip_coefficient(norm, 1.0))
            assert abs(out.loss_sum.item() - ref_loss) <= 1e-4 * abs(ref_loss), f"loss at step {step}"
        rt.pipeline.drain()
        ref_params = dict(ref.named_parameters())
        worst = max(rel(v, ref_params[s.hf_name].detach().cpu()) for t in rt.store.tiles
                    for s, v in zip(t.unit.specs, t.views(t.master).values()))
        assert worst <= 1e-4
        rt.close()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_bf16_precomputed_and_streamed_reference_are_equal(tmp_path):
    make_model_dir(tmp_path, "llama", seed=42, vocab=VOCAB)
    rt = runtime(tmp_path, torch.bfloat16, OBJECTIVES["dpo"])
    rt.store.freeze_reference()
    batches = pair_batches(3, 4, VOCAB, [64, 96, 80], seed=43)
    pre, _ = rt.engine.sequence_logps(mbs_of(batches))
    streamed, _ = rt.engine.sequence_logps(mbs_of(batches), weights="reference")
    assert torch.equal(pre, streamed)
    out = rt.engine.train_step(mbs_of(batches, list(streamed.split(8))))
    rt.pipeline.finish_step(lr=1e-3, clip_coef=clip_coefficient(out.grad_sq_norm.sqrt().item(), 1.0))
    after, _ = rt.engine.sequence_logps(mbs_of(batches), weights="reference")
    assert torch.equal(after, streamed)  # the reference copy is frozen
    rt.close()
