"""Bounds on a config.json checked as it is read, before anything is built from it.

A config.json of 10^7 layers made the planner build per-layer objects for minutes, memory growing, with no output;
a bad head count failed inside attention at step 1, after output.dir was written; a NaN rms_norm_eps failed at step 1
blaming the learning rate, an infinite one trained quietly (every norm's output zero). Here every size is a whole
number >= 1 within what megatrain lists one object of (layers, experts) or a tensor of (a dimension), the attention
heads are consistent, the numbers a layer computes with (eps, rope bases and factors, ...) are finite and in range,
and sliding_window and layer_types are what the family's transformers model takes (models/window.py), in time
independent of the values; one line naming the file and the key. The finer check (what fits once placed) is the
planner's: these bounds never refuse a model it could fit.
"""

from __future__ import annotations

import math

from ..errors import MegatrainError
from .window import check_layer_types, layer_kinds, sliding_window

MAX_LAYERS = 4096  # decoder layers: the deepest released models have under 200
MAX_EXPERTS = 4096  # experts per MoE layer: released models have at most a few hundred
MAX_DIM = 2**24  # a hidden, intermediate, head or vocabulary size: the largest released ones are under 2^18

# config.json keys that are counts or sizes, and their bound; the first group must be present.
REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
BOUNDS = {"num_hidden_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS, "num_local_experts": MAX_EXPERTS,
          "num_experts_per_tok": MAX_EXPERTS, "max_position_embeddings": 2**40}  # (positions: no tensor of that size)

# config.json numbers that must be finite and within a range where set (null: not set), at the top level and in
# each set of rope parameters (rope_parameters, Gemma 3's per layer type, the older rope_scaling)
POSITIVE, AT_LEAST_0, FRACTION, FINITE = ("a finite number above 0", "a finite number of at least 0",
                                          "a number above 0 and at most 1", "a finite number")
RANGES = {POSITIVE: lambda v: v > 0, AT_LEAST_0: lambda v: v >= 0, FRACTION: lambda v: 0 < v <= 1,
          FINITE: lambda v: True}
NUMBERS = {"rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "partial_rotary_factor": FRACTION,
           "query_pre_attn_scalar": POSITIVE, "attn_logit_softcapping": POSITIVE, "final_logit_softcapping": POSITIVE,
           "router_aux_loss_coef": AT_LEAST_0, "initializer_range": AT_LEAST_0, "swiglu_alpha": POSITIVE,
           "swiglu_limit": POSITIVE}
ROPE_NUMBERS = {"rope_theta": POSITIVE, "factor": POSITIVE, "partial_rotary_factor": FRACTION,
                "attention_factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
                "beta_fast": POSITIVE, "beta_slow": POSITIVE}  # (any other number in them: finite)


def _dims(hf_config, required: bool) -> dict[str, int]:
    """The size keys config.json sets (REQUIRED, and those of the family that are set), checked whole and >= 1."""
    keys = [*REQUIRED, "intermediate_size", "moe_intermediate_size", "num_key_value_heads", "head_dim",
            "num_experts", "num_local_experts", "num_experts_per_tok", "max_position_embeddings"]
    out = {}
    for k in keys:
        v = hf_config.get(k) if isinstance(hf_config, dict) else getattr(hf_config, k, None)
        if v is None and (k not in REQUIRED or not required):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise MegatrainError(f"{k}: expected a whole number of at least 1, got {v!r}")
        bound = BOUNDS.get(k, MAX_DIM)
        if v > bound:
            raise MegatrainError(f"{k}: {v:,} is more than megatrain handles (at most {bound:,}; released models "
                                 f"stay far below)")
        out[k] = v
    return out


def _number(key: str, v, want: str) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not RANGES[want](v):
        raise MegatrainError(f"{key}: expected {want}, got {v!r}")


def _rope(key: str, params) -> None:
    """One set of rope parameters, or Gemma 3's sets per layer type (a dict of dicts)."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise MegatrainError(f"{key}: expected an object of rope parameters, got {params!r}")
    for k, v in params.items():
        if isinstance(v, dict):
            _rope(f"{key}.{k}", v)
        elif k == "original_max_position_embeddings":
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MegatrainError(f"{key}.{k}: expected a whole number of at least 1, got {v!r}")
        elif k in ROPE_NUMBERS and v is not None:
            _number(f"{key}.{k}", v, ROPE_NUMBERS[k])
        elif isinstance(v, float):
            _number(f"{key}.{k}", v, FINITE)


def _numbers(hf_config) -> None:
    """The numbers a layer computes with: finite and in range (NUMBERS, ROPE_NUMBERS)."""
    raw = isinstance(hf_config, dict)
    get = hf_config.get if raw else lambda k: getattr(hf_config, k, None)
    for k, want in NUMBERS.items():
        if (v := get(k)) is not None:
            _number(k, v, want)
    for k in ("rope_parameters", "rope_scaling") if raw else ("rope_parameters",):  # (a config's rope_scaling is
        _rope(k, get(k))                                                             # its rope_parameters)


def _window(hf_config) -> None:
    """sliding_window where the family applies it, and layer_types (models/window.py)."""
    window = sliding_window(hf_config)
    if isinstance(hf_config, dict):  # (the config class derives the layer types where the file has none)
        if hf_config.get("num_hidden_layers") is not None:
            check_layer_types(hf_config.get("layer_types"), hf_config["num_hidden_layers"])
    else:
        layer_kinds(hf_config, window, hf_config.num_hidden_layers)


def check_model_config(hf_config, cfg_file) -> None:
    """config.json's counts and sizes (see the module's doc) and its attention heads: num_key_value_heads divides
    num_attention_heads, hidden_size does where head_dim is not given, and a head's size is even (rotary
    embeddings rotate pairs); its numbers, its sliding window and layer types. MegatrainError naming the file and
    the key. hf_config: the PretrainedConfig, or config.json's raw dict (checked before transformers builds
    anything from it: the keys it sets)."""
    try:
        d = _dims(hf_config, required=not isinstance(hf_config, dict))
        _numbers(hf_config)
        _window(hf_config)
        if "num_attention_heads" not in d or "hidden_size" not in d:
            return
        heads, kv = d["num_attention_heads"], d.get("num_key_value_heads", d["num_attention_heads"])
        if heads % kv:
            raise MegatrainError(f"num_key_value_heads: {kv} does not divide num_attention_heads ({heads}): each "
                                 f"key/value head serves a whole group of query heads")
        head_dim = d.get("head_dim")
        if head_dim is None:
            if d["hidden_size"] % heads:
                raise MegatrainError(f"num_attention_heads: {heads} does not divide hidden_size ({d['hidden_size']}) "
                                     f"and config.json gives no head_dim")
            head_dim = d["hidden_size"] // heads
        if head_dim % 2:
            raise MegatrainError(f"head_dim: {head_dim} is odd; rotary embeddings need an even head size")
    except MegatrainError as e:
        raise MegatrainError(f"{cfg_file}: {e}") from None
