"""Shared builders: tiny random Hugging Face models of each supported family, saved as real model directories."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One core per worker (pytest -n): the tiny models gain nothing from a second intra-op thread, and two workers
    # of two threads each on two cores take 3x as long as one. The processes the tests start inherit it.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "qwen3_moe", "mixtral", "olmoe", "gpt_oss"]


def _gpt_oss_experts_read_the_config() -> None:
    """transformers before 5.2x (the GPU image's 5.17) hard-codes gpt-oss's SwiGLU alpha and limit (1.702, 7.0), the
    values of every released config; later releases read config.swiglu_alpha and swiglu_limit, as megatrain does.
    The tiny gpt_oss config sets a limit of 2.0 so that the clamp is crossed: the reference experts read it here on
    either release, so the comparisons hold under both."""
    import inspect

    try:
        from transformers.models.gpt_oss import modeling_gpt_oss as hf
    except ImportError:
        return
    init = hf.GptOssExperts.__init__
    if "swiglu_limit" in inspect.getsource(init):
        return

    def reads_config(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)
        self.alpha = float(getattr(config, "swiglu_alpha", self.alpha))
        self.limit = float(getattr(config, "swiglu_limit", self.limit))

    hf.GptOssExperts.__init__ = reads_config


_gpt_oss_experts_read_the_config()


def tiny_hf_config(family: str, tied: bool = False, layers: int = 3, vocab: int = 97):
    from transformers import AutoConfig

    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        # Llama-3 rope scaling, so the llama3 inverse-frequency path is exercised
        kw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 32}
    if family == "qwen3":
        kw["head_dim"] = 16
    if family == "mistral":
        kw["sliding_window"] = None
    if family in ("gemma2", "gemma3_text"):
        # windows shorter than the test rows (9, 12, 17 tokens) on two of three layers; gemma-3-27b's rope (linear
        # scaling on the full layers, another base on the sliding ones); gemma2's caps small enough to bend a tiny
        # model's scores. The window is 8, not 4: with 4 the 20-step gemma3 trajectory is ill-conditioned, and
        # transformers fp32 itself strays 3.2e-5 from transformers float64 (its q_norm gradient at step 13; 4.1e-6
        # with 8), so a 1e-5 comparison of two fp32 implementations there measures rounding chaos, not correctness
        kw.update(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                  layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
        if family == "gemma3_text":
            kw["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
        else:
            kw.update(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    if family in ("qwen3_moe", "mixtral", "olmoe"):
        # 4 experts, top 2, the router loss on (a coefficient large enough to matter at this size); qwen3_moe
        # renormalises the top-k weights, olmoe does not (its default), mixtral always does
        kw.update({"num_local_experts" if family == "mixtral" else "num_experts": 4, "num_experts_per_tok": 2,
                   "output_router_logits": True, "router_aux_loss_coef": 0.05})
        if family == "qwen3_moe":
            kw.update(moe_intermediate_size=48, head_dim=16, norm_topk_prob=True)
        if family == "mixtral":
            kw["sliding_window"] = None
    if family == "gpt_oss":
        # 8 experts, top 2, the router loss on; attention sinks; sliding windows of 8 (shorter than the test rows) on
        # every other layer; yarn rope that scales (factor 8 over 32 positions: inv_freq and attention scaling both
        # change); a SwiGLU limit of 2.0 that ~1% of the tiny model's activations cross (7.0 never would at this
        # scale; with 1.0 so many sit near the kink that an fp32 rounding flips one: seen at step 18, 3.6e-7 from the
        # limit, 6e-5 on layer 0's gradients). 8 experts, not 4: the router-bias and sink gradients are sums that
        # cancel, and with 4 experts transformers fp32 itself strays 2.5e-5 from transformers float64 on them over
        # the 20 steps (so a 1e-5 comparison of two fp32 implementations measures rounding); with 8, 5.7e-6.
        # intermediate 64: MXFP4 packs the expert matrices' columns in groups of 32
        kw.update(head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.05, sliding_window=8, swiglu_limit=2.0,
                  layer_types=(["sliding_attention", "full_attention"] * layers)[:layers],
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "original_max_position_embeddings": 32, "truncate": False})
    return AutoConfig.for_model(family, **kw)


def reference_attention(family: str) -> str:
    """transformers' attention for a reference model: SDPA, but eager for gemma2, whose SDPA path skips the score
    cap (megatrain's CPU path computes capped attention the eager way), and for gpt_oss (no SDPA path: its sinks)."""
    return "eager" if family in ("gemma2", "gpt_oss") else "sdpa"


def make_model_dir(path, family: str, tied: bool = False, seed: int = 0, layers: int = 3, vocab: int = 97):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, tied=tied, layers=layers, vocab=vocab)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():  # non-trivial norms and biases, so their gradients and updates are tested too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` (tests/gpu) are collected everywhere and skipped where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
