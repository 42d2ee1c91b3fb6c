"""config.json read as the planner needs it, without transformers (whose import takes seconds, tens on a host
without bytecode caches), for the families whose config class only stores what the file says.

`plan_fields(raw)`: the dict as attributes, with the defaults transformers' LlamaConfig, MistralConfig, Qwen2Config
and Qwen3Config give the keys the adapters and the planner read, or None when the file asks for more than storing (a
rope type other than default, linear and llama3, a quantization, qwen2's or qwen3's sliding window, a size key left
to its default): the caller then reads it with AutoConfig. tests/test_plan_imports.py checks, for every real config
here, that the adapter built from these fields equals the one built from AutoConfig's.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

# the keys each family needs in the file (their transformers defaults are those of a tiny test model, never a real
# one's), and the defaults of those the adapters read when the file leaves them out
REQUIRED = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
            "rms_norm_eps", "max_position_embeddings")
DEFAULTS = {"hidden_act": "silu", "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
            "attention_bias": False, "mlp_bias": False}
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {"use_sliding_window": False}, "qwen3": {"use_sliding_window": False}}
# size keys whose transformers default a family's config class sets to a model's own (Qwen3Config: 32 kv heads of 128)
FAMILY_REQUIRED = {"qwen3": ("num_key_value_heads", "head_dim")}


# rope types stored as given (rope_parameters, as transformers 5 writes it), with the keys transformers' validation
# reads: the planner needs only the type (the adapters check it; its tables are computed when a layer runs)
ROPE_KEYS = {"default": ("rope_theta",), "linear": ("rope_theta", "factor"),
             "llama3": ("rope_theta", "factor", "low_freq_factor", "high_freq_factor")}


def _plain_rope(rope) -> bool:
    if not isinstance(rope, dict) or rope.get("rope_type") not in ROPE_KEYS:
        return False
    nums = [rope.get(k) for k in ROPE_KEYS[rope["rope_type"]]]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in nums) and \
        isinstance(rope.get("original_max_position_embeddings", 1), int)


class PlanFields(SimpleNamespace):
    """config.json's keys as attributes (a PretrainedConfig's read-only surface the planner uses)."""

    def to_dict(self) -> dict:
        return copy.deepcopy(vars(self))


def plan_fields(raw: dict) -> PlanFields | None:
    """config.json's dict `raw` (already checked: models.load_hf_config) as attributes, or None (see the module)."""
    family = FAMILIES.get(raw.get("model_type"))
    if family is None or any(k not in raw for k in REQUIRED + FAMILY_REQUIRED.get(raw["model_type"], ())):
        return None
    rope = raw.get("rope_parameters")
    if raw.get("rope_scaling") or raw.get("quantization_config") or rope is not None and not _plain_rope(rope):
        return None
    if raw["model_type"] == "mistral" and "sliding_window" not in raw:
        return None  # (MistralConfig's default window)
    if raw["model_type"] in ("qwen2", "qwen3") and raw.get("use_sliding_window"):
        return None  # (Qwen2Config and Qwen3Config derive the window's layers)
    fields = {**DEFAULTS, **family, **raw}
    if raw["model_type"] in ("qwen2", "qwen3"):
        fields["sliding_window"] = None  # Qwen2Config and Qwen3Config keep the window only with use_sliding_window
    if raw["model_type"] == "qwen3" and raw.get("layer_types") is None:  # (Qwen3Config: full attention, no window)
        fields["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields["dtype"] = raw.get("dtype") or raw.get("torch_dtype")
    fields["rope_parameters"] = dict(rope) if rope else {"rope_type": "default",
                                                         "rope_theta": raw.get("rope_theta", 10000.0)}
    if fields["rope_parameters"]["rope_type"] == "llama3":  # (as transformers' standardize_rope_params)
        fields["rope_parameters"].setdefault("original_max_position_embeddings", fields["max_position_embeddings"])
    fields.pop("torch_dtype", None)
    return PlanFields(**fields)
