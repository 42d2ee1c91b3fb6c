"""The rollout sampler's draws (megatrain/rollout): top-k / top-p / temperature filtering against a written-out
reference, the draw's frequencies, seeds and RNG restore, stop strings, the store's weights (stacked experts), and
bad SamplingParams."""

import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from conftest import make_model_dir
from test_rollout import PROMPTS, reference_generate, tiny_model

from megatrain.models import get_adapter, load_hf_config
from megatrain.rollout import (DictWeights, Sampler, SamplingParams, StoreWeights, restore_sampler_rng,
                               sampler_rng_state)
from megatrain.rollout.params import draw, filtered_logits
from megatrain.runtime.store import HostStore

TINY = Path(__file__).resolve().parents[1] / "megatrain" / "defaults" / "tiny-llama"


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution written out, in float64: softmax(logits / T) over the top_k tokens, then the smallest set
    of most likely tokens whose (renormalised) probability reaches top_p, renormalised."""
    p = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(p, descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    kept = order[:top_k] if top_k else order
    q = p[kept] / p[kept].sum()
    before = torch.cumsum(q, 0) - q  # the probability of the tokens ahead of each
    keep[kept[before < top_p]] = True
    out = torch.where(keep, p, torch.zeros_like(p))
    return out / out.sum()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.8, 7, 0.75)])
def test_filtering_and_draws_follow_the_written_out_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 23, generator=g) * 2
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    want = torch.stack([reference_probs(x, temperature, top_k, top_p) for x in logits])
    got = filtered_logits(logits, params).softmax(-1).double()
    assert (got - want).abs().max().item() <= 1e-6
    n = 20000
    toks, lps = draw(logits.repeat(n, 1), params, torch.Generator().manual_seed(5))
    freq = torch.zeros_like(want)
    for r in range(3):
        freq[r] = torch.bincount(toks.view(n, 3)[:, r], minlength=23).double() / n
    sigma = (want * (1 - want) / n).sqrt()
    assert ((freq - want).abs() <= 5 * sigma + 1e-12).all()
    # the kept log-prob: the policy's, logits / temperature before top-k and top-p (TRL's per-token log-probs)
    assert torch.allclose(lps.view(n, 3), torch.log_softmax(logits / temperature, -1).gather(-1, toks.view(n, 3).T).T)


def test_seed_and_rng_restore_repeat_the_completions():
    cfg, model = tiny_model("llama", seed=4)
    s = Sampler(cfg, DictWeights(dict(model.state_dict())), "cpu", mode="resident", dtype=torch.float32)
    params = SamplingParams(max_new_tokens=8, n=2, seed=3)
    a, b = s.generate(PROMPTS, params), s.generate(PROMPTS, params)
    assert a.completion_ids == b.completion_ids
    assert s.generate(PROMPTS, SamplingParams(max_new_tokens=8, n=2, seed=4)).completion_ids != a.completion_ids
    g = torch.Generator().manual_seed(9)
    s.generate(PROMPTS, params, generator=g)
    state = sampler_rng_state(g)
    first = s.generate(PROMPTS, params, generator=g)
    second = s.generate(PROMPTS, params, generator=g)
    assert first.completion_ids != second.completion_ids  # the generator moved on
    g2 = restore_sampler_rng(state)
    assert s.generate(PROMPTS, params, generator=g2).completion_ids == first.completion_ids
    assert s.generate(PROMPTS, params, generator=g2).completion_ids == second.completion_ids


def fp32_ulp(x: float) -> float:
    """The spacing of float32 numbers at magnitude x."""
    return torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(max(x, 1e-30)))


def test_stop_strings_cut_after_the_token_that_completes_them():
    tok = AutoTokenizer.from_pretrained(TINY)
    cfg, model = tiny_model("llama", seed=2, vocab=len(tok))
    s = Sampler(cfg, DictWeights(dict(model.state_dict())), "cpu", mode="streamed", dtype=torch.float32)
    prompts = [tok.encode("abc"), tok.encode("hello w"), tok.encode("xy")]
    free = s.generate(prompts, SamplingParams(max_new_tokens=16, top_k=1))
    row = free.completion_ids[1]
    text = tok.decode(row)
    stop = text[5:8]  # three characters from the middle of row 1's completion
    out = s.generate(prompts, SamplingParams(max_new_tokens=16, top_k=1, stop=(stop,)), tokenizer=tok)
    for r, full in enumerate(free.completion_ids):
        cut = next((k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k])), None)
        assert out.completion_ids[r] == (full if cut is None else full[:cut])
        assert out.finished[r] == (cut is not None)
        # the same tokens' log-probs: once a row has left, the batch's matmuls have fewer rows and the CPU's kernels
        # may sum in another order: the logits and their log-sum-exp (about the largest logit + log(vocab)) differ in
        # their last bits, which a log-prob inherits as absolute error: a few fp32 ulps at that magnitude
        want = free.logprobs[r][:len(out.completion_ids[r])]
        for got, ref in zip(out.logprobs[r], want):
            assert abs(got - ref) <= 4 * fp32_ulp(abs(ref) + math.log(len(tok))), (r, got, ref)
    cut = out.completion_ids[1]
    assert out.finished[1] and stop in tok.decode(cut) and stop not in tok.decode(cut[:-1])
    with pytest.raises(ValueError, match="SamplingParams.stop"):
        s.generate(prompts, SamplingParams(max_new_tokens=4, stop=("x",)))


def test_store_weights_with_stacked_experts_decode_as_transformers(tmp_path):
    make_model_dir(tmp_path, "mixtral", seed=5)
    adapter = get_adapter(load_hf_config(tmp_path))
    store = HostStore(adapter, torch.float32)
    store.load_safetensors(tmp_path, progress=False)
    cfg, _ = tiny_model("mixtral")
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32).eval()
    model.config.output_router_logits = False
    want = reference_generate(model, PROMPTS, 8, eos=model.config.vocab_size)
    s = Sampler(model.config, StoreWeights(store, adapter), "cpu", mode="streamed", dtype=torch.float32)
    assert s.generate(PROMPTS, SamplingParams(max_new_tokens=8, top_k=1)).completion_ids == want


@pytest.mark.parametrize("field,value", [("max_new_tokens", 0), ("temperature", 0.0), ("temperature", float("nan")),
                                         ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("n", 0), ("stop", "x"),
                                         ("stop", ("",)), ("eos_token_ids", (-1,)), ("seed", 1.5)])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{"max_new_tokens": 4, field: value})
