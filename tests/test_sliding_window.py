"""Sliding-window attention: layers that transformers runs with a window (mistral's sliding_window, qwen2's
use_sliding_window with max_window_layers, config.json's layer_types) see only the last `window` positions, in
megatrain exactly as in transformers; unpacked and packed rows."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import tiny_hf_config
from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from test_equivalence import TOL, assert_trains_like_reference, load_reference

from megatrain.errors import MegatrainError
from megatrain.models import get_adapter


def windowed_model_dir(path, family: str, window: int, seed: int, **extra):
    """A tiny model whose layers (all, or those after max_window_layers for qwen2) use a window shorter than the
    test rows (5 to 17 tokens), saved as a model directory."""
    cfg = tiny_hf_config(family)
    kw = cfg.to_dict()
    kw.update(sliding_window=window, **extra)
    if family == "qwen2":
        kw.update(use_sliding_window=True, max_window_layers=1, layer_types=None)
    cfg = AutoConfig.for_model(family, **{k: v for k, v in kw.items() if k not in ("model_type",)})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return cfg


def test_layer_kinds_follow_the_config(tmp_path):
    cfg = windowed_model_dir(tmp_path / "q", "qwen2", window=4, seed=0)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert get_adapter(cfg).layer_kinds == ["full", "sliding", "sliding"]
    assert get_adapter(windowed_model_dir(tmp_path / "m", "mistral", window=4, seed=0)).layer_kinds == \
        ["sliding"] * 3
    assert get_adapter(tiny_hf_config("llama")).layer_kinds == ["full"] * 3
    # qwen2 with a window in config.json but use_sliding_window false: transformers ignores it, so does megatrain
    off = tiny_hf_config("qwen2")
    off.sliding_window, off.use_sliding_window = 4, False
    assert get_adapter(off).layer_kinds == ["full"] * 3


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_windowed_step_matches_transformers(tmp_path, family):
    windowed_model_dir(tmp_path, family, window=4, seed=11)
    ref, mt = load_reference(tmp_path), Megatrain(tmp_path)
    batches = random_batches(1, 3, 97, [13], seed=12)
    ref_loss, ref_grads = reference_step(ref, reference_optimizer(ref), batches)
    loss, grads = mt.step(batches)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= TOL, f"gradient of {name}"
    ref_params = dict(ref.named_parameters())
    for name, p in mt.params().items():
        assert rel(p, ref_params[name].detach()) <= TOL, f"updated {name}"

    # the test has teeth: the same weights without the window (full causal attention) give another loss
    no_window = {"sliding_window": None} if family == "mistral" else {"layer_types": ["full_attention"] * 3}
    full = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32,
                                                **no_window)
    full_loss, _ = reference_step(full, reference_optimizer(full), batches)
    assert abs(full_loss - ref_loss) > 1e-3 * abs(ref_loss)


def test_windowed_twenty_steps_with_unequal_padded_microbatches(tmp_path):
    """Rows of 5 to 17 tokens with a window of 6: some rows shorter than the window (plain causal), some longer."""
    windowed_model_dir(tmp_path, "mistral", window=6, seed=13)
    assert_trains_like_reference(load_reference(tmp_path), Megatrain(tmp_path), steps=20, seed=300)


def test_windowed_bounded_placement_matches_transformers(tmp_path):
    """The window's context reaches layers through rebuilds and wave groups too (K = 2, groups 2, spill)."""
    from megatrain.runtime.schedule import Placement

    windowed_model_dir(tmp_path, "qwen2", window=5, seed=14, num_hidden_layers=4)
    placement = Placement(checkpoint_every=2, wave_groups=2, spill_layers=1)
    assert_trains_like_reference(load_reference(tmp_path), Megatrain(tmp_path, placement=placement), steps=3,
                                 seed=400)


def test_packed_windowed_row_equals_its_documents(tmp_path):
    """A packed row under a window: each document sees only itself and only the window, as when run alone."""
    from test_data_packing import _engine, _run

    windowed_model_dir(tmp_path, "mistral", window=4, seed=15)
    engine, sink = _engine(tmp_path)
    g = torch.Generator().manual_seed(16)
    lengths = [7, 3, 9]
    ids = torch.randint(3, 97, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    for s in torch.nonzero(pos[0] == 0).flatten().tolist():
        labels[0, s] = -100  # a document's first token is no target of the one before
    packed_loss, packed_grads, packed_n = _run(engine, sink, ids, labels, pos)
    loss_sum, grads_sum, n_sum, s = 0.0, None, 0, 0
    for n in lengths:
        loss, grads, k = _run(engine, sink, ids[:, s:s + n], labels[:, s:s + n], pos[:, s:s + n])
        loss_sum, n_sum, s = loss_sum + loss, n_sum + k, s + n
        grads_sum = grads if grads_sum is None else {u: grads_sum[u] + v for u, v in grads.items()}
    assert packed_n == n_sum
    assert packed_loss == pytest.approx(loss_sum, rel=1e-5)
    for u, v in packed_grads.items():
        torch.testing.assert_close(v, grads_sum[u], rtol=1e-4, atol=1e-5)


def test_unknown_layer_type_is_refused():
    cfg = tiny_hf_config("qwen2")
    cfg.sliding_window, cfg.use_sliding_window = 4, True
    cfg.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    with pytest.raises(MegatrainError, match="chunked_attention"):
        get_adapter(cfg).layer_kinds


def test_attention_flops_count_the_window():
    """The planner's attention FLOPs follow the keys each query sees: T/2 on average when causal, nearly W with a
    window W << T (checked against a count over positions), and only for the windowed layers."""
    from megatrain.planner.flops import attention_span, flops_per_token

    T, W = 4096, 512
    mistral = tiny_hf_config("mistral")
    mistral.sliding_window = W
    ad = get_adapter(mistral)
    exact = 2 * sum(min(q + 1, W) for q in range(T)) / T
    assert attention_span(ad, T) == pytest.approx(exact, rel=1e-3)
    assert attention_span(ad, W) == W  # rows no longer than the window: plain causal
    qwen = tiny_hf_config("qwen2")
    qwen.sliding_window, qwen.use_sliding_window, qwen.max_window_layers = W, True, 1
    qwen.layer_types = ["full_attention", "sliding_attention", "sliding_attention"]
    assert attention_span(get_adapter(qwen), T) == pytest.approx((T + 2 * exact) / 3, rel=1e-3)
    full = tiny_hf_config("mistral")
    assert flops_per_token(ad, T)[1] < flops_per_token(get_adapter(full), T)[1]
    assert flops_per_token(ad, T)[0] == flops_per_token(get_adapter(full), T)[0]  # 6N counts no attention
