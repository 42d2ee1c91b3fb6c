"""The chunked LM head: same loss and gradients as full-vocabulary cross-entropy, whatever the chunk size."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from reference import Megatrain, random_batches, rel


@pytest.mark.parametrize("chunk", [1, 3, 7, 4096])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_loss_equals_full_cross_entropy(tmp_path, chunk, tied):
    make_model_dir(tmp_path, "qwen2", tied=tied, seed=11)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    batches = random_batches(2, 2, 97, [11, 6], seed=12)
    # reference: full logits, one cross-entropy over every target token of the step
    logits = [ref(input_ids=b["input_ids"]).logits[:, :-1] for b in batches]
    targets = [b["labels"][:, 1:] for b in batches]
    full = F.cross_entropy(torch.cat([l.reshape(-1, 97) for l in logits]),
                           torch.cat([t.reshape(-1) for t in targets]), ignore_index=-100)
    full.backward()
    mt = Megatrain(tmp_path, loss_chunk_tokens=chunk)
    loss, grads = mt.step(batches)
    assert abs(loss - full.item()) <= 1e-6 * full.item()
    for name, p in ref.named_parameters():
        if name in grads:
            assert rel(grads[name], p.grad) <= 1e-5, name


def test_chunk_size_does_not_change_results(tmp_path):
    make_model_dir(tmp_path, "llama", seed=13)
    batches = random_batches(3, 2, 97, [9, 14, 5], seed=14)
    l1, g1 = Megatrain(tmp_path, loss_chunk_tokens=2).step(batches)
    l2, g2 = Megatrain(tmp_path, loss_chunk_tokens=10_000).step(batches)
    assert abs(l1 - l2) <= 1e-6 * l2
    for name in g1:
        assert rel(g1[name], g2[name]) <= 1e-6, name
