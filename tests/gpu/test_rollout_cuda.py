"""GPU test of the rollout sampler (megatrain/rollout) on the CUDA kernels the CPU tests cannot reach.

    python3 -m pytest -q -m gpu tests/gpu/test_rollout_cuda.py

1. A decode step's attention in bf16 (rollout/attention.py: the matmul kernel's bf16 x bf16 -> fp32 scores, and
   sdpa's packed heads) against the written-out attention in float64 over a strided slab with left padding: within
   bf16's rounding.
2. Greedy decoding on CUDA in fp32, resident and streamed (the layers through two device slots, the KV cache on the
   device or in pinned host memory), equals transformers' generate on CUDA token for token.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.rollout import DictWeights, Sampler, SamplingParams

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


@pytest.mark.parametrize("kernel", ["matmul", "sdpa"])
def test_decode_attention_in_bf16(kernel, monkeypatch):
    from megatrain.rollout import attention

    monkeypatch.setattr(attention, "DECODE_KERNEL", kernel)
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hkv, G, n, D = 64, 4, 7, 300, 128
    q = torch.randn(B, Hkv * G, 1, D, device="cuda", generator=g).bfloat16()
    k_slab = torch.randn(B, Hkv, n + 40, D, device="cuda", generator=g).bfloat16()
    v_slab = torch.randn(B, Hkv, n + 40, D, device="cuda", generator=g).bfloat16()
    k, v = k_slab[:, :, :n], v_slab[:, :, :n]
    pad = torch.randint(0, n // 2, (B,), device="cuda", generator=g)
    mask = (torch.arange(n, device="cuda")[None] >= pad[:, None])[:, None, None, :]

    class Layer(torch.nn.Module):
        num_key_value_groups = G

    out, _ = attention.decode_attention(Layer(), q, k, v, mask, scaling=D ** -0.5)
    s = (q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2)) * D ** -0.5
    want = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v.double().repeat_interleave(G, 1)).transpose(1, 2)
    err = (out.double() - want).abs().max().item()
    assert err < 2e-2, err  # bf16 inputs and output: a few of its ulps at values of order 1


@pytest.mark.parametrize("mode,host", [("resident", False), ("streamed", False), ("streamed", True)])
def test_greedy_equals_generate_on_cuda(mode, host):
    from transformers import AutoModelForCausalLM

    from conftest import tiny_hf_config

    torch.manual_seed(0)
    cfg = tiny_hf_config("qwen2")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).cuda().eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40, 3, 41]]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts], device="cuda")
    attn = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    eos = cfg.vocab_size  # an id never drawn: every row runs max_new tokens
    want = model.generate(input_ids=ids, attention_mask=attn, do_sample=False, max_new_tokens=10,
                          eos_token_id=eos, pad_token_id=0)[:, P:].tolist()
    weights = DictWeights({k: v.cpu() for k, v in model.state_dict().items()})
    s = Sampler(cfg, weights, "cuda", mode=mode, dtype=torch.float32, kv_on_host=host)
    out = s.generate(prompts, SamplingParams(max_new_tokens=10, top_k=1, eos_token_ids=(eos,)))
    s.close()
    assert out.completion_ids == want
    assert out.stats["kv_bytes"] > 0
