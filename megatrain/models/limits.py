"""Bounds on a config.json checked as it is read, before anything is built from it.

A config.json of 10^7 layers made the planner build per-layer objects for minutes, memory growing, with no output;
a bad head count failed inside attention at step 1, after output.dir was written. Here every size is a whole number
>= 1 within what megatrain lists one object of (layers, experts) or a tensor of (a dimension), and the attention
heads are consistent, in time independent of the values; one line naming the file and the key. The finer check
(what fits once placed) is the planner's: these bounds never refuse a model it could fit.
"""

from __future__ import annotations

from ..errors import MegatrainError

MAX_LAYERS = 4096  # decoder layers: the deepest released models have under 200
MAX_EXPERTS = 4096  # experts per MoE layer: released models have at most a few hundred
MAX_DIM = 2**24  # a hidden, intermediate, head or vocabulary size: the largest released ones are under 2^18

# config.json keys that are counts or sizes, and their bound; the first group must be present.
REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
BOUNDS = {"num_hidden_layers": MAX_LAYERS, "num_experts": MAX_EXPERTS, "num_local_experts": MAX_EXPERTS,
          "num_experts_per_tok": MAX_EXPERTS}


def _dims(hf_config, required: bool) -> dict[str, int]:
    """The size keys config.json sets (REQUIRED, and those of the family that are set), checked whole and >= 1."""
    keys = [*REQUIRED, "intermediate_size", "moe_intermediate_size", "num_key_value_heads", "head_dim",
            "num_experts", "num_local_experts", "num_experts_per_tok"]
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


def check_model_config(hf_config, cfg_file) -> None:
    """config.json's counts and sizes (see the module's doc) and its attention heads: num_key_value_heads divides
    num_attention_heads, hidden_size does where head_dim is not given, and a head's size is even (rotary
    embeddings rotate pairs). MegatrainError naming the file and the key. hf_config: the PretrainedConfig, or
    config.json's raw dict (checked before transformers builds anything from it: the keys it sets)."""
    try:
        d = _dims(hf_config, required=not isinstance(hf_config, dict))
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
