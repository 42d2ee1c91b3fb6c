"""Phi-3 (fused qkv_proj and gate_up_proj, partial rotary) and OLMo 2 (post-norms, full-width q/k norms): one step and
20 steps of unequal padded micro-batches equal transformers + torch AdamW at 1e-5 (tied and untied), export loads in
transformers with equal logits, packed rows train as their documents, Phi-3's partial rotary and sliding window and
OLMo 2's attention biases match transformers, unsupported options are refused by key, and `megatrain plan` counts
the parameters transformers builds for the real 14B / 13B configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from test_equivalence import TOL, assert_trains_like_reference

from megatrain.errors import MegatrainError
from megatrain.models import get_adapter

FAMILIES = ["phi3", "olmo2"]
TIED = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])


def tiny_config(family: str, tied: bool = False, layers: int = 3, vocab: int = 97, **extra):
    """conftest.tiny_hf_config's sizes, for phi3 / olmo2; `extra` overrides config keys."""
    kw = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kw.update(extra)
    return AutoConfig.for_model(family, **kw)


def make_dir(path, family: str, tied: bool = False, seed: int = 0, **extra):
    """A tiny random model saved as a Hugging Face directory, norms and biases perturbed (conftest.make_model_dir)."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, tied=tied, **extra)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return model


def reference(d):
    return AutoModelForCausalLM.from_pretrained(d, attn_implementation="sdpa", dtype=torch.float32)


def assert_one_step_matches(d, tied: bool, lengths=(13,)) -> None:
    ref, mt = reference(d), Megatrain(d)
    opt = reference_optimizer(ref)
    batches = random_batches(1, 3, 97, list(lengths), seed=2)
    ref_loss, ref_grads = reference_step(ref, opt, batches)
    loss, grads = mt.step(batches)
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
    ref_params = dict(ref.named_parameters())
    assert set(grads) == set(ref_params) - ({"lm_head.weight"} if tied else set())
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) <= TOL, f"gradient of {name}"
    for name, p in mt.params().items():
        assert rel(p, ref_params[name].detach()) <= TOL, f"updated {name}"
    mt.close()


# ---- 1, 2: equal to transformers + torch AdamW ---------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@TIED
def test_one_step_matches_transformers(tmp_path, family, tied):
    make_dir(tmp_path, family, tied=tied, seed=1)
    assert_one_step_matches(tmp_path, tied)


@pytest.mark.parametrize("family", FAMILIES)
@TIED
def test_twenty_steps_with_unequal_padded_microbatches(tmp_path, family, tied):
    make_dir(tmp_path, family, tied=tied, seed=5)
    assert_trains_like_reference(reference(tmp_path), Megatrain(tmp_path), steps=20, seed=100)


def test_fused_tensors_keep_the_checkpoint_layout(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are stored fused under the checkpoint's names; OLMo 2 has no input norm
    and a post-feedforward norm; both units hold exactly the checkpoint's tensors."""
    from safetensors.torch import load_file

    for family in FAMILIES:
        d = tmp_path / family
        make_dir(d, family, seed=3)
        ad = get_adapter(AutoConfig.from_pretrained(d))
        specs = {s.hf_name: s for u in ad.units() for s in u.specs}
        ckpt = load_file(d / "model.safetensors")
        assert specs.keys() == ckpt.keys()
        assert all(tuple(ckpt[n].shape) == s.shape for n, s in specs.items())
        assert all(s.decay == (len(s.shape) == 2) for s in specs.values())
    names = {s.name for s in get_adapter(tiny_config("phi3")).units()[1].specs}
    assert {"self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"} <= names
    names = {s.name for s in get_adapter(tiny_config("olmo2")).units()[1].specs}
    assert "input_layernorm.weight" not in names and "post_feedforward_layernorm.weight" in names


# ---- 3: export -> transformers, same logits ------------------------------------------------------------------------
def _run_dir(tmp_path, family: str, tied: bool) -> Path:
    """test_checkpoint_helpers.setup_run with this file's model builder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from test_checkpoint_helpers import CHAT_TEMPLATE, make_data, write_config

    model = tmp_path / "model"
    make_dir(model, family, tied=tied)
    vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz "))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(model)
    data = make_data(tmp_path / "train.jsonl")
    return write_config(tmp_path / "cfg.yaml", model, data, tmp_path / "run", tmp_path / "cache",
                        train={"steps": 2}, data={"chat_template": CHAT_TEMPLATE},
                        export={"at_end": True, "dtype": "fp32", "max_shard_mb": 0.05})


@pytest.mark.parametrize("family", FAMILIES)
@TIED
def test_export_loads_in_transformers_with_equal_logits(tmp_path, family, tied):
    from test_checkpoint_helpers import run
    from test_export import megatrain_logits, sample_inputs

    summary = run(_run_dir(tmp_path, family, tied))
    out = tmp_path / "run" / "export"
    assert summary["export"] == str(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.model_type == family
    ids, lengths = sample_inputs()
    with torch.no_grad():
        hf = model(input_ids=ids).logits[torch.arange(3), lengths - 1]
    mine = megatrain_logits(tmp_path / "run" / "checkpoints" / "step-2", ids, lengths)
    torch.testing.assert_close(hf, mine, rtol=1e-5, atol=1e-5)
    # the trained weights, not the initial ones
    initial = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32).named_parameters())
    name = "model.layers.0.mlp.gate_up_proj.weight" if family == "phi3" else "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(initial[name], dict(model.named_parameters())[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_forward_is_transformers_bit_for_bit(tmp_path, family):
    """bf16 weights and compute: the logits equal transformers' bf16 model exactly on CPU. For OLMo 2 this needs
    Olmo2RMSNorm's fp32 scaling and Olmo2RotaryEmbedding's fp32 cos/sin (with bf16 cos/sin: 0.02 off)."""
    from megatrain.runtime.engine import CollectGrads, Engine
    from megatrain.runtime.store import HostStore

    make_dir(tmp_path, family, seed=3)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.bfloat16)
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = ref(input_ids=ids).logits[:, -1]
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    store = HostStore(ad, torch.bfloat16, torch.bfloat16)
    store.load_safetensors(tmp_path)
    mine = Engine(store, ad, torch.device("cpu"), CollectGrads()).next_token_logits(ids, torch.tensor([11] * 3))
    assert torch.equal(mine.to(hf.dtype), hf)


# ---- 4: Phi-3's options: partial rotary, sliding window; OLMo 2's biases; refusals -----------------------------------
@TIED
def test_phi3_partial_rotary_matches_transformers(tmp_path, tied):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    make_dir(tmp_path, "phi3", tied=tied, seed=11, rope_parameters=rope)
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    assert ad.rotary_dim == 8 and ad.head_dim == 16  # half of each head rotates
    assert_one_step_matches(tmp_path, tied)
    assert_trains_like_reference(reference(tmp_path), Megatrain(tmp_path), steps=4, seed=400)


def test_phi3_partial_rotary_has_teeth(tmp_path):
    """The factor changes the loss by far more than the tolerance: the test above would notice it being ignored."""
    batches = random_batches(1, 3, 97, [13], seed=2)
    losses = []
    for factor in (0.5, 1.0):
        rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor}
        make_dir(tmp_path / str(factor), "phi3", seed=11, rope_parameters=rope)
        ref = reference(tmp_path / str(factor))
        losses.append(reference_step(ref, reference_optimizer(ref), batches)[0])
    assert abs(losses[0] - losses[1]) > 1e-4 * abs(losses[1])


def test_phi3_sliding_window_matches_transformers(tmp_path):
    """A window shorter than the rows (13 tokens, window 4): every layer slides, as transformers' phi3 mask."""
    make_dir(tmp_path, "phi3", seed=12, sliding_window=4)
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    assert ad.sliding_window == 4 and set(ad.layer_kinds) == {"sliding"}
    assert_one_step_matches(tmp_path, False)
    # teeth: transformers' loss without the window is another number
    batches = random_batches(1, 3, 97, [13], seed=2)
    losses = []
    for window in (4, None):
        ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32,
                                                   sliding_window=window)
        losses.append(reference_step(ref, reference_optimizer(ref), batches)[0])
    assert abs(losses[0] - losses[1]) > 1e-3 * abs(losses[1])


def test_olmo2_attention_bias_matches_transformers(tmp_path):
    make_dir(tmp_path, "olmo2", seed=13, attention_bias=True)
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    assert {"self_attn.q_proj.bias", "self_attn.o_proj.bias"} <= {s.name for s in ad.units()[1].specs}
    assert_one_step_matches(tmp_path, False)


@pytest.mark.parametrize("family,extra,key", [
    ("phi3", {"resid_pdrop": 0.1}, "resid_pdrop"),
    ("phi3", {"embd_pdrop": 0.1}, "embd_pdrop"),
    ("phi3", {"attention_dropout": 0.1}, "attention_dropout"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
                                  "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
                                  "original_max_position_embeddings": 64}}, "rope_type"),
    ("phi3", {"attention_bias": True}, "attention_bias"),
    ("phi3", {"mlp_bias": True}, "mlp_bias"),
    ("phi3", {"hidden_act": "gelu"}, "hidden_act"),
    ("olmo2", {"attention_dropout": 0.1}, "attention_dropout"),
    ("olmo2", {"clip_qkv": 8.0}, "clip_qkv"),
    ("olmo2", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, "rope_type"),
    ("olmo2", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ("olmo2", {"hidden_act": "gelu"}, "hidden_act"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_unsupported_options_are_refused_by_key(tmp_path, family, extra, key):
    """In the adapter, and from a model directory's config.json as `megatrain` reads it."""
    from megatrain.models import load_hf_config

    cfg = tiny_config(family, **extra)
    with pytest.raises(MegatrainError, match=key) as e:
        get_adapter(cfg)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(MegatrainError, match=key):
        get_adapter(load_hf_config(tmp_path))


# ---- 5: packed rows ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_row_equals_its_documents(tmp_path, family):
    """A row of three documents trains exactly as the documents one by one; without the boundaries it differs."""
    from test_data_packing import _engine, _run

    make_dir(tmp_path, family, seed=9)
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
    leaky_loss, _, _ = _run(engine, sink, ids, labels, torch.arange(ids.shape[1])[None])
    assert abs(leaky_loss - loss_sum) > 1e-3 * abs(loss_sum)


# ---- the planner on the real configs -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,family", [("phi-3-medium-14b", "phi3"), ("olmo-2-13b", "olmo2")])
def test_plan_on_real_configs_counts_the_parameters_transformers_builds(tmp_path, capsys, name, family):
    from megatrain.cli import main
    from megatrain.models import load_hf_config

    d = Path(__file__).resolve().parents[2] / "shared" / "model-configs" / name
    if not d.is_dir():
        d = Path(__file__).resolve().parents[1] / "bench" / "model-configs" / name
    if not d.is_dir():
        pytest.skip(f"{name}/config.json is not in this checkout")
    capsys.readouterr()
    rc = main(["plan", f"model.path={d}", f"output.dir={tmp_path / 'out'}", "--json"])
    out = capsys.readouterr()
    assert rc in (0, 1) and "Traceback" not in out.err, out.err  # 1: will not fit on this machine
    plan = json.loads(out.out)
    assert plan["model"].startswith(family)
    cfg = load_hf_config(d)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert plan["params"] == n == sum(u.numel for u in get_adapter(cfg).units())
