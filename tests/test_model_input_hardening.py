"""A model folder's mistakes are refused as they are read, one line naming the file and the key or tensor, with
nothing written to output.dir; a key transformers ignores changes nothing.

- sliding_window is read only where the family's transformers model applies it, the way it applies it (a leftover
  key in a llama config trains exactly as without it), and must then be a whole number of at least 1;
- config.json's eps, rope bases and other numbers must be finite and in range (a NaN eps trained as NaN, an
  infinite one quietly);
- checkpoint tensors must hold floats (BF16, F16, F32, F64) or what the adapter unpacks (gpt-oss's MXFP4), and finite
  values; a tensor name found in two unindexed shards is refused, naming both.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_model_dir, tiny_hf_config
from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from test_bad_input_paths import cli_error
from test_equivalence import TOL, load_reference
from test_inputs import error_of, setup, write_config  # noqa: F401  (setup: a fixture)

from megatrain.errors import MegatrainError
from megatrain.models import ADAPTERS, get_adapter, load_hf_config
from megatrain.models.window import WINDOW_RULES
from megatrain.runtime import weights_load
from megatrain.runtime.store import HostStore

Q = "model.layers.1.self_attn.q_proj.weight"


def edit_config(model_dir, drop=(), **keys):
    """config.json of model_dir with `keys` set and `drop` removed; returns its path."""
    f = model_dir / "config.json"
    c = json.loads(f.read_text())
    for k in drop:
        c.pop(k, None)
    c.update(keys)
    f.write_text(json.dumps(c))  # (NaN and Infinity written as JSON's non-standard literals, as Python reads them)
    return f


def config_dir(tmp_path, family: str, **keys):
    """A folder holding only the tiny `family` config.json (conftest's sizes), `keys` set in the file."""
    d = tmp_path / family
    tiny_hf_config(family).save_pretrained(d)
    edit_config(d, **keys)
    return d


def load_error(model_dir) -> list[str]:
    """The error of reading model_dir's config.json (and building its adapter) both ways: as the planner reads it
    and as training does. Both must fail."""
    msgs = []
    for plan_only in (True, False):
        with pytest.raises(MegatrainError) as e:
            get_adapter(load_hf_config(model_dir, plan_only=plan_only)).layer_kinds
        msgs.append(str(e.value))
    return msgs


def load_store(model_dir) -> HostStore:
    store = HostStore(get_adapter(load_hf_config(model_dir)), torch.float32)
    store.load_safetensors(model_dir, progress=False)
    return store


def store_error(model_dir) -> str:
    with pytest.raises(MegatrainError) as e:
        load_store(model_dir)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def masters(store: HostStore) -> dict[str, torch.Tensor]:
    return {s.hf_name: v for t in store.tiles for s, v in zip(t.unit.specs, t.views(t.master).values())}


# ---- 1. sliding_window: where transformers applies it, as it applies it -------------------------------------------
def test_every_family_has_a_window_rule():
    assert set(WINDOW_RULES) == set(ADAPTERS)


@pytest.mark.parametrize("window", [4, -1, 0])
def test_a_leftover_sliding_window_in_a_llama_config_changes_nothing(tmp_path, window):
    """LlamaForCausalLM ignores sliding_window: a llama whose config.json sets one (shorter than the rows, or a
    nonsense value) trains bit for bit as the same llama without it, and as transformers."""
    plain, windowed = tmp_path / "plain", tmp_path / "windowed"
    make_model_dir(plain, "llama", seed=3)
    shutil.copytree(plain, windowed)
    edit_config(windowed, sliding_window=window)
    assert get_adapter(load_hf_config(windowed)).layer_kinds == ["full"] * 3
    assert get_adapter(load_hf_config(windowed, plan_only=True)).sliding_window is None
    batches = random_batches(2, 3, 97, [13, 9], seed=4)
    want_loss, want_grads = Megatrain(plain).step(batches)
    loss, grads = Megatrain(windowed).step(batches)
    assert loss == want_loss
    for name, g in grads.items():
        assert torch.equal(g, want_grads[name]), name
    if window == 4:
        ref = load_reference(windowed)
        ref_loss, ref_grads = reference_step(ref, reference_optimizer(ref), batches)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss)
        for name, g in grads.items():
            assert rel(g, ref_grads[name]) <= TOL, f"gradient of {name}"


SW, FULL = "sliding_attention", "full_attention"


@pytest.mark.parametrize("family,keys,kinds", [
    ("llama", {"sliding_window": 4}, ["full"] * 3),
    ("olmo2", {"sliding_window": 4}, ["full"] * 3),
    ("mistral", {"sliding_window": 4}, ["sliding"] * 3),
    ("mistral", {"sliding_window": None}, ["full"] * 3),
    # MixtralModel, Phi3Model and Qwen3MoeModel window every layer and never read layer_types
    ("mixtral", {"sliding_window": 4, "layer_types": [SW, FULL, FULL]}, ["sliding"] * 3),
    ("mixtral", {"sliding_window": 4}, ["sliding"] * 3),
    ("phi3", {"sliding_window": 4}, ["sliding"] * 3),
    ("qwen3_moe", {"sliding_window": 4, "use_sliding_window": True}, ["sliding"] * 3),
    ("qwen3_moe", {"sliding_window": 4, "use_sliding_window": False}, ["full"] * 3),
    ("qwen2", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 1, "layer_types": None},
     ["full", "sliding", "sliding"]),
    ("qwen2", {"sliding_window": 4, "use_sliding_window": False}, ["full"] * 3),
    ("qwen2", {"sliding_window": -1, "use_sliding_window": False}, ["full"] * 3),  # (not applied: not read)
    ("qwen3", {"sliding_window": 4, "use_sliding_window": True, "max_window_layers": 2, "layer_types": None},
     ["full", "full", "sliding"]),
    ("gemma2", {"sliding_window": 4}, ["sliding", "full", "sliding"]),
])
def test_the_window_follows_each_familys_transformers_model(tmp_path, family, keys, kinds):
    d = config_dir(tmp_path, family, **keys)
    for plan_only in (True, False):
        assert get_adapter(load_hf_config(d, plan_only=plan_only)).layer_kinds == kinds, plan_only


@pytest.mark.parametrize("family,keys,culprit", [
    ("mistral", {"sliding_window": 0}, "sliding_window: expected a whole number of at least 1 (or null: no window), "
                                       "got 0"),
    ("mistral", {"sliding_window": -1}, "sliding_window: expected a whole number of at least 1"),
    ("mixtral", {"sliding_window": 2.5}, "sliding_window: expected a whole number of at least 1"),
    ("gemma2", {"sliding_window": "8"}, "sliding_window: expected a whole number of at least 1"),
    ("qwen2", {"sliding_window": -1, "use_sliding_window": True}, "sliding_window: expected a whole number"),
    ("gpt_oss", {"sliding_window": True}, "sliding_window: expected a whole number"),
    # OlmoeForCausalLM's masks are causal; only its flash-attention kernel would apply the window
    ("olmoe", {"sliding_window": 4}, "sliding_window: 4 is set, but transformers' olmoe applies it"),
    # Qwen2Model refuses sliding layers without a window (create_sliding_window_causal_mask raises)
    ("qwen2", {"sliding_window": 4, "use_sliding_window": False, "layer_types": [FULL, SW, SW]},
     "layer_types: names sliding_attention layers, but no sliding_window applies (use_sliding_window is false)"),
    ("llama", {"layer_types": [FULL, FULL]}, "layer_types: 2 entries for 3 layers (num_hidden_layers)"),
])
def test_a_window_that_cannot_apply_is_refused_naming_the_key(tmp_path, family, keys, culprit):
    d = config_dir(tmp_path, family, **keys)
    for msg in load_error(d):
        assert msg.startswith(f"{d / 'config.json'}: {culprit}"), msg


def test_a_mistral_config_with_layer_types_is_refused(tmp_path):
    """transformers' AutoConfig reads model_type mistral with layer_types as ministral (windows per layer type, not
    Mistral's window on every layer): refused alike by `megatrain plan` and `train`, naming the key."""
    d = config_dir(tmp_path, "mistral", sliding_window=4, layer_types=[SW, FULL, FULL])
    for msg in load_error(d):
        assert msg.startswith(f"{d / 'config.json'}: layer_types: transformers reads a mistral config.json that has "
                              f"layer_types as a Ministral model"), msg


# ---- 2. config.json's numbers --------------------------------------------------------------------------------------
@pytest.mark.parametrize("family,keys,drop,culprit", [
    ("llama", {"rms_norm_eps": -1.0}, (), "rms_norm_eps: expected a finite number above 0, got -1.0"),
    ("llama", {"rms_norm_eps": 0}, (), "rms_norm_eps: expected a finite number above 0, got 0"),
    ("llama", {"rms_norm_eps": math.nan}, (), "rms_norm_eps: expected a finite number above 0, got nan"),
    ("llama", {"rms_norm_eps": math.inf}, (), "rms_norm_eps: expected a finite number above 0, got inf"),
    ("llama", {"rms_norm_eps": "x"}, (), "rms_norm_eps: expected a finite number above 0, got 'x'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, (),
     "rope_parameters.rope_theta: expected a finite number above 0, got 0"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, (),
     "rope_parameters.rope_theta: expected a finite number above 0, got -1.0"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": math.nan}}, (),
     "rope_parameters.factor: expected a finite number above 0, got nan"),
    ("llama", {"rope_theta": 0.0}, ("rope_parameters",), "rope_theta: expected a finite number above 0, got 0.0"),
    ("llama", {"rope_scaling": {"type": "linear", "factor": -2.0}, "rope_theta": 1e4}, ("rope_parameters",),
     "rope_scaling.factor: expected a finite number above 0, got -2.0"),
    ("llama", {"rope_parameters": "default"}, (), "rope_parameters: expected an object"),
    ("llama", {"initializer_range": math.nan}, (), "initializer_range: expected a finite number of at least 0"),
    ("llama", {"max_position_embeddings": 0}, (), "max_position_embeddings: expected a whole number of at least 1"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": -1e4}}}, (),
     "rope_parameters.sliding_attention.rope_theta: expected a finite number above 0, got -10000.0"),
    ("gemma2", {"query_pre_attn_scalar": 0}, (), "query_pre_attn_scalar: expected a finite number above 0, got 0"),
    ("gemma2", {"attn_logit_softcapping": math.inf}, (), "attn_logit_softcapping: expected a finite number above 0"),
    ("mixtral", {"router_aux_loss_coef": -0.1}, (), "router_aux_loss_coef: expected a finite number of at least 0"),
    ("gpt_oss", {"swiglu_limit": math.nan}, (), "swiglu_limit: expected a finite number above 0, got nan"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}}, (),
     "rope_parameters.partial_rotary_factor: expected a number above 0 and at most 1, got 1.5"),
])
def test_config_numbers_out_of_range_name_the_file_and_key(tmp_path, family, keys, drop, culprit):
    d = config_dir(tmp_path, family)
    edit_config(d, drop=drop, **keys)
    for msg in load_error(d):
        assert msg.startswith(f"{d / 'config.json'}: {culprit}"), msg


def test_every_real_config_keeps_its_numbers(tmp_path):
    """The number checks refuse no released model's config (the benchmarked ones)."""
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "bench" / "model-configs").glob("*/config.json"))
    assert files
    for f in files:
        d = tmp_path / f.parent.name
        d.mkdir()
        shutil.copy(f, d / "config.json")
        for plan_only in (True, False):
            get_adapter(load_hf_config(d, plan_only=plan_only)).layer_kinds


@pytest.mark.parametrize("command", ["train", "plan"])
def test_an_infinite_eps_is_one_line_before_anything_is_written(setup, capsys, command):
    """rms_norm_eps: Infinity trained quietly (every norm's output zero); NaN failed at step 1 blaming the lr."""
    tmp_path, model_dir, data = setup
    f = edit_config(model_dir, rms_norm_eps=math.inf)
    msg = cli_error(capsys, tmp_path, command, str(write_config(tmp_path, model_dir, data)))
    assert msg == f"{f}: rms_norm_eps: expected a finite number above 0, got inf"


# ---- 3. checkpoint tensors: float dtypes, finite values, one file per name -------------------------------------------
@pytest.mark.parametrize("dtype,shown", [(torch.int64, "I64"), (torch.bool, "BOOL"), (torch.uint8, "U8"),
                                         (torch.float8_e4m3fn, "F8_E4M3"), (torch.int8, "I8")])
def test_a_tensor_that_is_not_floating_point_is_refused(tmp_path, dtype, shown):
    make_model_dir(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd[Q] = torch.zeros(sd[Q].shape, dtype=dtype)
    save_file(sd, f)
    msg = store_error(tmp_path)
    assert msg.startswith(f"{f}: tensor '{Q}' is {shown}; megatrain loads BF16, F16, F32 or F64"), msg


def test_a_non_float_tensor_stops_the_run_before_a_write(setup):
    tmp_path, model_dir, data = setup
    f = model_dir / "model.safetensors"
    sd = load_file(f)
    sd[Q] = torch.ones(sd[Q].shape, dtype=torch.bool)
    save_file(sd, f)
    assert error_of(tmp_path, write_config(tmp_path, model_dir, data)).startswith(f"{f}: tensor '{Q}' is BOOL")


def test_f64_tensors_load_as_their_fp32_values(tmp_path):
    make_model_dir(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    want = sd[Q].clone()
    sd[Q] = sd[Q].double()
    save_file(sd, f)
    assert torch.equal(masters(load_store(tmp_path))[Q], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_weight_names_file_tensor_and_element(tmp_path, dtype, value):
    make_model_dir(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd = {k: v.to(dtype) for k, v in sd.items()}
    sd[Q][3, 5] = value
    save_file(sd, f)
    msg = store_error(tmp_path)
    assert msg.startswith(f"{f}: tensor '{Q}' holds {value} at [3, 5]"), msg


def test_the_element_is_found_across_pieces(tmp_path, monkeypatch):
    """A tensor read in several pieces (64 bytes each here) names the element's place in the whole tensor."""
    monkeypatch.setattr(weights_load, "PIECE", 64)
    make_model_dir(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd[Q][50, 7] = math.nan
    save_file(sd, f)
    assert store_error(tmp_path).startswith(f"{f}: tensor '{Q}' holds nan at [50, 7]")


def test_an_f64_value_beyond_fp32_is_refused(tmp_path):
    make_model_dir(tmp_path, "llama")
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd[Q] = sd[Q].double()
    sd[Q][0, 1] = 1e300
    save_file(sd, f)
    assert store_error(tmp_path).startswith(f"{f}: tensor '{Q}' holds inf at [0, 1] in fp32")


def test_a_nan_weight_stops_the_run_before_a_write(setup, capsys):
    """m/nan: the run wrote output.dir, then failed at step 1 blaming train.lr or the data."""
    tmp_path, model_dir, data = setup
    f = model_dir / "model.safetensors"
    sd = load_file(f)
    sd[Q][3, 3] = math.nan
    save_file(sd, f)
    msg = cli_error(capsys, tmp_path, "train", str(write_config(tmp_path, model_dir, data)))
    assert msg.startswith(f"{f}: tensor '{Q}' holds nan at [3, 3]"), msg


def test_an_mxfp4_scale_that_overflows_names_the_packed_tensors(tmp_path):
    from test_gpt_oss import mxfp4_model_dir

    packed = mxfp4_model_dir(tmp_path, seed=4)
    name = "model.layers.1.mlp.experts.down_proj"
    sd = load_file(tmp_path / "model.safetensors")
    sd[name + "_scales"][0, 2, 0] = 255  # 2^128: every nonzero value of that block is infinite in fp32
    sd[name + "_blocks"][0, 2, 0] = 0x77
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert packed
    msg = store_error(tmp_path)
    assert msg.startswith(f"{tmp_path / 'model.safetensors'}: tensors {name}_blocks, {name}_scales: hold inf "
                          f"at [0, "), msg


def test_a_tensor_in_two_unindexed_shards_names_both(tmp_path):
    """m/dup_noindex: the later file (in name order) silently won."""
    make_model_dir(tmp_path, "llama")
    sd = load_file(tmp_path / "model.safetensors")
    save_file({Q: torch.zeros_like(sd[Q])}, tmp_path / "z.safetensors")
    msg = store_error(tmp_path)
    assert msg == (f"{tmp_path}: tensor '{Q}' is in both model.safetensors and z.safetensors, and no "
                   f"model.safetensors.index.json says which to load"), msg
    # an index says which file holds each tensor: then the other copy is not read
    index = {"metadata": {}, "weight_map": {**{k: "model.safetensors" for k in sd}, Q: "z.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert torch.equal(masters(load_store(tmp_path))[Q], torch.zeros_like(sd[Q]))
