"""The rollout's attention, registered with transformers as NAME: its sdpa for a prefill, and for a decode step
(one query per row) each key/value head's query heads packed as that head's queries, so that the cached keys and
values are read once per step (DECODE_KERNEL: two batched matmuls, or torch's fused attention). transformers' sdpa
with a padding mask repeats the keys and values for every query head before some releases (repeat_kv: a copy of the
whole cache, num_key_value_groups times over, in every layer of every decode step); later releases pack as here.
The same masks as sdpa (its mask function is registered under NAME too), the same scaling. A layer with soft-capping
(Gemma 2) or attention sinks (gpt-oss), which transformers' sdpa does not take, runs its family's eager attention, as
transformers runs those families (prefill and decode: repeat_kv's copies included).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

NAME = "megatrain_rollout"
_SDPA = None  # transformers' sdpa attention function (sdpa()), imported once, not on every layer's call
# a decode step's kernel: "matmul" (matmul_attention) or "sdpa" (torch's fused attention over the packed heads). In
# the sampler, with prompts of several lengths (a padding mask), matmul's decode step is the faster by far
# (bench/bench_rollout.py --modes resident:matmul,resident:sdpa; docs/grpo.md), though the two kernels alone take
# about the same time (bench/decode_attention.py)
DECODE_KERNEL = "matmul"


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                     **kwargs):
    """transformers' attention interface: query [B, H, q, D], key and value [B, Hkv, n, D] -> ([B, q, H, D], None)."""
    B, H, q_len, D = query.shape
    Hkv = key.shape[1]
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:  # the family's own eager attention
        eager = sys.modules[type(module).__module__].eager_attention_forward
        if attention_mask is not None and attention_mask.dtype == torch.bool:  # eager adds its mask to the scores
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if q_len != 1 or dropout or H % Hkv:
        return sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, **kwargs)
    q = query.reshape(B, Hkv, H // Hkv, D)  # query head h reads key/value head h // groups (repeat_kv's order)
    mask = None if attention_mask is None else attention_mask[:, :, -1:, : key.shape[2]]  # [B, 1, 1, n]
    if DECODE_KERNEL == "matmul":
        out = matmul_attention(q, key, value, mask, D ** -0.5 if scaling is None else scaling)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, 1, -1).transpose(1, 2).contiguous(), None


def sdpa():
    """transformers' sdpa attention function (imported on first use: megatrain.rollout does not import transformers)."""
    global _SDPA
    if _SDPA is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        _SDPA = sdpa_attention_forward
    return _SDPA


def matmul_attention(q, key, value, mask, scale: float) -> torch.Tensor:
    """q [B, Hkv, G, D] over key, value [B, Hkv, n, D] by two batched matmuls: the scores in fp32 (cuBLAS's fp32
    output of bf16 inputs on CUDA), a softmax in fp32, the probabilities in the values' dtype times the values (as
    flash attention's second matmul). mask: bool [B, 1, 1, n] (True: attend) or additive, or None."""
    B, Hkv, G, D = q.shape
    n = key.shape[2]
    q3, k3, v3 = q.reshape(B * Hkv, G, D), key.reshape(B * Hkv, n, D), value.reshape(B * Hkv, n, -1)
    if q.is_cuda and q.dtype != torch.float32:
        s = torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32)
    else:
        s = torch.bmm(q3.float(), k3.float().transpose(1, 2))
    s = s.view(B, Hkv, G, n).mul_(scale)
    if mask is not None:
        s = s.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else s.add_(mask)
    p = s.softmax(-1).to(value.dtype).view(B * Hkv, G, n)
    return torch.bmm(p, v3).view(B, Hkv, G, -1)


def register() -> str:
    """Registers NAME with transformers' attention and mask interfaces (idempotent); returns NAME."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, decode_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME
