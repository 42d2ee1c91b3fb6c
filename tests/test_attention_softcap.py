"""Gemma 2's soft-capped attention score on CUDA (models/attention.softcap_score: cap·(2·sigmoid(2s/cap) − 1)) is
cap·tanh(s/cap), the function transformers applies, and its gradient 1 − tanh²(s/cap); FlexAttention's kernel
options apply on Hopper only (flex_kernel_options)."""

import pytest
import torch

from megatrain.models import attention
from megatrain.models.attention import FLEX_OPTIONS_SM90, flex_kernel_options, softcap_score


def scores(dtype):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(50_000, generator=g, dtype=torch.float64) * 200  # past the cap's bend on both sides
    small = torch.logspace(-8, 2, 5_000, dtype=torch.float64)  # near 0, where 2·sigmoid − 1 cancels
    return torch.cat([wide, small, -small, torch.tensor([0.0, 1e4, -1e4], dtype=torch.float64)]).to(dtype)


@pytest.mark.parametrize("cap", [50.0, 30.0])
def test_softcap_score_is_cap_tanh(cap):
    s = scores(torch.float64)
    truth = cap * torch.tanh(s / cap)
    f = softcap_score(cap)
    assert torch.allclose(f(s, 0, 0, 0, 0), truth, rtol=0, atol=1e-12 * cap)  # the same function
    s32 = s.float()
    got = f(s32, 0, 0, 0, 0)
    assert got.dtype == torch.float32
    # fp32: within cap·2⁻²² of the float64 truth (sigmoid near ½ rounds to 2⁻²⁴, doubled, times cap; the scores
    # the kernel caps are bf16 products accumulated in fp32, whose own rounding is larger)
    assert float((got.double() - truth).abs().max()) <= cap * 2**-22
    assert float(got.abs().max()) <= cap


@pytest.mark.parametrize("cap", [50.0, 30.0])
def test_softcap_score_gradient_is_tanh_derivative(cap):
    s = scores(torch.float32).requires_grad_()
    softcap_score(cap)(s, 0, 0, 0, 0).sum().backward()
    truth = 1 - torch.tanh(s.detach().double() / cap) ** 2
    assert float((s.grad.double() - truth).abs().max()) < 1e-6


def test_flex_kernel_options_on_hopper_only(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert flex_kernel_options("softcap", 256, torch.device("cpu")) is None
    for cap, want in (((9, 0), FLEX_OPTIONS_SM90[("softcap", 256)]), ((8, 0), None), ((10, 0), None)):
        monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda d, c=cap: c)
        assert flex_kernel_options("softcap", 256, cuda) == want
    monkeypatch.setattr(attention.torch.cuda, "get_device_capability", lambda d: (9, 0))
    assert flex_kernel_options("softcap", 128, cuda) is None  # measured at head_dim 256 only
    assert flex_kernel_options("plain", 256, cuda) is None
    opts = flex_kernel_options("softcap", 256, cuda)
    opts["fwd_num_warps"] = 1  # a copy: the table stays as measured
    assert FLEX_OPTIONS_SM90[("softcap", 256)]["fwd_num_warps"] == 8
    # every tile divides the block mask's 128-token blocks (FlexAttention refuses others)
    for key, v in FLEX_OPTIONS_SM90[("softcap", 256)].items():
        if "BLOCK" in key:
            assert 128 % v == 0, key


@pytest.mark.parametrize("packed", [False, True])
def test_planned_capped_layer_allocates_as_the_cuda_kernel(packed):
    """The planner's meta-device layer of Gemma 2 planned for CUDA allocates what FlexAttention does there (the
    fused kernel's output and log-sum-exp, as an uncapped layer's), not the CPU path's T x T scores; planned for
    CPU it holds them."""
    from conftest import tiny_hf_config

    from megatrain.models import get_adapter
    from megatrain.planner.activations import layer_memory

    capped, plain = tiny_hf_config("gemma2"), tiny_hf_config("gemma2")
    capped.attn_logit_softcapping, plain.attn_logit_softcapping = 50.0, None
    rows, seq = 2, 1024
    a, b = get_adapter(capped), get_adapter(plain)
    assert a.attention_score == "softcap" and b.attention_score == "plain"
    cuda = [layer_memory(ad, rows, seq, torch.bfloat16, packed, cuda_attention=True) for ad in (a, b)]
    assert cuda[0]["forward_peak"] == cuda[1]["forward_peak"]
    assert cuda[0]["backward_peak"] == cuda[1]["backward_peak"]
    cpu = layer_memory(a, rows, seq, torch.bfloat16, packed, cuda_attention=False)
    scores = rows * capped.num_attention_heads * seq * seq * 2  # one bf16 T x T score tensor
    assert cpu["backward_peak"] >= cuda[0]["backward_peak"] + scores


def test_planned_head_counts_the_logit_cap():
    """The planner's LM head of Gemma 2 runs the engine's head with its final-logit cap (tanh and the capped logits
    per chunk besides the logits), so it plans more than the same head uncapped."""
    from conftest import tiny_hf_config

    from megatrain.models import get_adapter
    from megatrain.planner.activations import head_memory

    capped, plain = tiny_hf_config("gemma2"), tiny_hf_config("gemma2")
    capped.final_logit_softcapping, plain.final_logit_softcapping = 30.0, None
    capped.vocab_size = plain.vocab_size = 8192  # the logits, not the hidden states, make the head's peak
    a, b = get_adapter(capped), get_adapter(plain)
    assert a.logit_softcap == 30.0 and b.logit_softcap is None
    chunk = 256
    for cuda in (True, False):
        got, base = (head_memory(ad, 2, 512, 1000, chunk, torch.bfloat16, cuda=cuda) for ad in (a, b))
        assert got >= base + chunk * capped.vocab_size * 2, (cuda, got, base)  # at least one more bf16 chunk
