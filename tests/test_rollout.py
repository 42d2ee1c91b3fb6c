"""The rollout sampler (megatrain/rollout, issue 38): greedy decoding equals transformers' generate token for token,
resident and streamed (the KV cache on the device or the host), dense and MoE, soft-capping and sliding windows
(Gemma 2), attention sinks (gpt-oss), over uneven prompts with EOS
mid-batch (finished rows leave the batch); the modes and kv_on_host agree when sampling; the kept log-probs equal a
plain full forward's log_softmax of logits / temperature."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_hf_config

from megatrain.rollout import DictWeights, Sampler, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23], [40, 3, 41]]


def tiny_model(family, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **kw)
    # transformers' own attention for the family: sdpa, or eager where sdpa lacks soft-capping or sinks
    attn = "eager" if family in ("gemma2", "gpt_oss") else "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    if getattr(model.config, "output_router_logits", False):
        model.config.output_router_logits = False
    return cfg, model


def reference_generate(model, prompts, max_new, eos):
    """transformers' greedy generate over the left-padded batch: each row's new tokens, cut after its first EOS."""
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                         eos_token_id=eos, pad_token_id=0)[:, P:].tolist()
    rows = []
    for r in out:
        cut = r.index(eos) + 1 if eos in r else len(r)
        rows.append(r[:cut])
    return rows


def eos_mid_batch(model, prompts, max_new):
    """An EOS id that some row of the greedy batch emits before max_new and some row never does."""
    free = reference_generate(model, prompts, max_new, eos=model.config.vocab_size)  # an id never drawn
    for cand in sorted({t for r in free for t in r[1:max_new - 2]}):
        ends = [cand in r[:max_new - 1] for r in free]
        if any(ends) and not all(ends):
            return cand
    raise AssertionError("no token ends some rows but not all")


@pytest.mark.parametrize("family,tied", [("qwen2", False), ("mixtral", False), ("llama", True), ("gemma2", True),
                                         ("gpt_oss", False)])
def test_greedy_equals_transformers_generate(family, tied):
    cfg, model = tiny_model(family, tied=tied)
    max_new = 12
    eos = eos_mid_batch(model, PROMPTS, max_new)
    want = reference_generate(model, PROMPTS, max_new, eos)
    assert any(len(r) < max_new for r in want) and any(len(r) == max_new and eos not in r for r in want)
    weights = DictWeights(dict(model.state_dict()))
    for mode, host in (("resident", False), ("streamed", False), ("streamed", True)):
        s = Sampler(cfg, weights, "cpu", mode=mode, dtype=torch.float32, kv_on_host=host)
        out = s.generate(PROMPTS, SamplingParams(max_new_tokens=max_new, top_k=1, eos_token_ids=(eos,)))
        s.close()
        assert out.completion_ids == want, (mode, host)
        assert out.finished == [r[-1] == eos for r in want]
        assert out.prompt_index == [0, 1, 2, 3]


def test_logprobs_equal_a_full_forward_and_modes_agree_when_sampling():
    cfg, model = tiny_model("llama", seed=3)
    weights = DictWeights(dict(model.state_dict()))
    params = SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.95, top_k=40, n=3, eos_token_ids=(2,),
                            seed=7)
    outs = []
    for mode, host in (("resident", False), ("streamed", False), ("streamed", True), ("resident", True)):
        s = Sampler(cfg, weights, "cpu", mode=mode, dtype=torch.float32, kv_on_host=host)
        outs.append(s.generate(PROMPTS, params))
    out = outs[0]
    assert out.prompt_index == [i for i in range(len(PROMPTS)) for _ in range(3)]
    for o in outs[1:]:
        assert o.completion_ids == out.completion_ids
    assert len({tuple(c) for c in out.completion_ids[:3]}) > 1  # sampled, not greedy
    with torch.no_grad():
        for r, i in enumerate(out.prompt_index):
            p, c = PROMPTS[i], out.completion_ids[r]
            logits = model(input_ids=torch.tensor([p + c])).logits[0].double()
            want = torch.log_softmax(logits / params.temperature, -1)[len(p) - 1: len(p) + len(c) - 1].gather(
                -1, torch.tensor(c)[:, None])  # the policy that sampled them, before top-k / top-p (TRL's)
            got = torch.tensor(out.logprobs[r], dtype=torch.float64)
            assert (got - want.squeeze(-1)).abs().max().item() <= 1e-5, r


def test_prefill_in_row_chunks_equals_generate(monkeypatch):
    """A prefill over row chunks (sampler.PREFILL_TOKENS) writes each chunk's keys and values into its rows."""
    from megatrain.rollout import sampler

    monkeypatch.setattr(sampler, "PREFILL_TOKENS", 15)  # two rows of 7 tokens a chunk
    cfg, model = tiny_model("qwen2", seed=6)
    want = reference_generate(model, PROMPTS, 8, eos=model.config.vocab_size)
    weights = DictWeights(dict(model.state_dict()))
    for mode, host in (("resident", False), ("streamed", True)):
        s = Sampler(cfg, weights, "cpu", mode=mode, dtype=torch.float32, kv_on_host=host)
        assert s.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1)).completion_ids == want, (mode, host)


def test_the_cache_goes_under_the_forwards_own_name(monkeypatch):
    """transformers renamed the forward's `past_key_values` to `cache`: the sampler passes the KV cache under the name
    the installed forward takes, and a prefill that leaves the cache empty (a name the forward ignores) stops the
    rollout instead of decoding every step without its past."""
    from megatrain.rollout import model as rollout_model

    class Old:
        def forward(self, input_ids=None, past_key_values=None, **kwargs): ...

    class New:
        def forward(self, input_ids=None, cache=None, **kwargs): ...

    class Neither:
        def forward(self, input_ids=None, **kwargs): ...

    assert rollout_model.cache_keyword(Old()) == "past_key_values"
    assert rollout_model.cache_keyword(New()) == "cache"
    with pytest.raises(ValueError, match="neither"):
        rollout_model.cache_keyword(Neither())

    cfg, model = tiny_model("qwen2", seed=2)
    weights = DictWeights(dict(model.state_dict()))
    monkeypatch.setattr(rollout_model, "cache_keyword", lambda m: "kv_cache_unread")
    s = Sampler(cfg, weights, "cpu", mode="resident", dtype=torch.float32)
    with pytest.raises(RuntimeError, match="KV cache"):
        s.generate(PROMPTS, SamplingParams(max_new_tokens=4, top_k=1))


@pytest.mark.parametrize("groups,kernel", [(1, "sdpa"), (4, "sdpa"), (4, "matmul")])
def test_decode_attention_equals_attention_over_repeated_heads(groups, kernel, monkeypatch):
    """A decode step's attention (rollout/attention.py) equals the written-out attention of every query head over
    its key/value head's cached positions, padded ones masked, in float64; prefills go to transformers' sdpa."""
    from megatrain.rollout import attention

    monkeypatch.setattr(attention, "DECODE_KERNEL", kernel)
    decode_attention = attention.decode_attention
    torch.manual_seed(groups)
    B, Hkv, n, D = 3, 2, 9, 16
    H = Hkv * groups
    q = torch.randn(B, H, 1, D)
    k_slab, v_slab = torch.randn(B, Hkv, n + 5, D), torch.randn(B, Hkv, n + 5, D)
    k, v = k_slab[:, :, :n], v_slab[:, :, :n]  # the slab's cached positions: a strided view, as the sampler's
    mask = torch.ones(B, 1, 1, n, dtype=torch.bool)
    mask[1, ..., :3] = False  # left padding
    mask[2, ..., :1] = False
    scale = 0.3

    class Layer(torch.nn.Module):
        num_key_value_groups = groups

    out, _ = decode_attention(Layer(), q, k, v, mask, scaling=scale)
    qd, kd, vd = (x.double() for x in (q, k, v))
    kr, vr = kd.repeat_interleave(groups, 1), vd.repeat_interleave(groups, 1)
    s = (qd @ kr.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    want = (s.softmax(-1) @ vr).transpose(1, 2)
    assert out.shape == (B, 1, H, D)
    assert (out.double() - want).abs().max().item() < 1e-5

    q3 = torch.randn(B, H, 4, D)  # a prefill: transformers' sdpa, causal
    k3, v3 = torch.randn(B, Hkv, 4, D), torch.randn(B, Hkv, 4, D)
    out3, _ = decode_attention(Layer(), q3, k3, v3, None, scaling=scale, is_causal=True)
    s3 = (q3.double() @ k3.double().repeat_interleave(groups, 1).transpose(-1, -2) * scale)
    s3 = s3.masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    want3 = (s3.softmax(-1) @ v3.double().repeat_interleave(groups, 1)).transpose(1, 2)
    assert (out3.double() - want3).abs().max().item() < 1e-5
