"""Gemma 2 and Gemma 3 (text) beyond the tests every family runs (conftest.FAMILIES: one step and 20 steps equal to
transformers + torch AdamW at 1e-5, tied and untied, bf16, placements, checkpoints, export): each Gemma-specific piece
matters, packed rows, the forward-only paths cap logits, unsupported options are refused, real configs count the
parameters transformers builds."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from conftest import make_model_dir, reference_attention, tiny_hf_config
from test_equivalence import TOL, load_reference

from megatrain.errors import MegatrainError
from megatrain.models import get_adapter

GEMMAS = ["gemma2", "gemma3_text"]


def gemma_config(family: str, tied: bool = True, layers: int = 3, **extra):
    cfg = tiny_hf_config(family, tied=tied, layers=layers)
    for k, v in extra.items():
        setattr(cfg, k, v)
    return cfg


def gemma_model_dir(path, family: str, tied: bool = True, seed: int = 0):
    """conftest's tiny model (norms, which start at zero in Gemma, perturbed so they are tested)."""
    make_model_dir(path, family, tied=tied, seed=seed)


def eager_reference(d):
    return load_reference(d)


def test_the_gemma_specifics_have_teeth(tmp_path):
    """Each Gemma-specific piece changes the loss: without it the equality above would fail."""
    gemma_model_dir(tmp_path, "gemma2", seed=7)
    assert reference_attention("gemma2") == "eager"  # transformers' SDPA path would skip the score cap
    batches = random_batches(1, 2, 97, [13], seed=8)
    ref = eager_reference(tmp_path)
    base = reference_step(ref, reference_optimizer(ref), batches)[0]
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None},
                   {"sliding_window": 64}, {"query_pre_attn_scalar": 16}):
        other = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32,
                                                     **change)
        loss = reference_step(other, reference_optimizer(other), batches)[0]
        assert abs(loss - base) > 1e-4 * abs(base), change


@pytest.mark.parametrize("family", GEMMAS)
def test_packed_row_equals_its_documents(tmp_path, family):
    from test_data_packing import _engine, _run

    gemma_model_dir(tmp_path, family, seed=9)
    engine, sink = _engine(tmp_path)
    g = torch.Generator().manual_seed(10)
    lengths = [7, 3, 9]
    ids = torch.randint(3, 97, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels[0, pos[0] == 0] = -100
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


@pytest.mark.parametrize("family", GEMMAS)
def test_eval_loss_and_logits_match_transformers(tmp_path, family):
    """The forward-only paths (evaluation, next-token logits) cap the logits too."""
    gemma_model_dir(tmp_path, family, tied=False, seed=11)
    ref, mt = eager_reference(tmp_path), Megatrain(tmp_path)
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        out = ref(input_ids=ids, labels=ids)
    from megatrain.runtime import MicroBatch

    loss, n = mt.engine.eval_loss([MicroBatch.from_labels(ids, ids)])
    assert loss == pytest.approx(out.loss.item(), rel=1e-5)
    logits = mt.engine.next_token_logits(ids, torch.tensor([11, 6]))
    assert rel(logits[0], out.logits[0, 10]) <= TOL and rel(logits[1], out.logits[1, 5]) <= TOL


def test_unsupported_options_are_refused():
    with pytest.raises(MegatrainError, match="use_bidirectional_attention"):
        get_adapter(gemma_config("gemma3_text", use_bidirectional_attention=True))
    with pytest.raises(MegatrainError, match="hidden_activation"):
        get_adapter(gemma_config("gemma2", hidden_activation="relu"))
    with pytest.raises(MegatrainError, match="rope_type 'dynamic'"):
        get_adapter(gemma_config("gemma3_text", rope_parameters={
            "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))


@pytest.mark.parametrize("name", ["gemma-2-9b", "gemma-3-27b"])
def test_real_configs_count_the_parameters_transformers_builds(name):
    from pathlib import Path

    from megatrain.models import load_hf_config

    d = Path(__file__).resolve().parents[2] / "shared" / "model-configs" / name
    if not d.is_dir():
        d = Path(__file__).resolve().parents[1] / "bench" / "model-configs" / name
    if not d.is_dir():
        pytest.skip(f"{name}/config.json is not in this checkout")
    cfg = load_hf_config(d)
    ad = get_adapter(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert sum(u.numel for u in ad.units()) == sum(p.numel() for p in model.parameters())
    assert set(ad.layer_kinds) == {"full", "sliding"}
