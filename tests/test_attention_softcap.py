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
