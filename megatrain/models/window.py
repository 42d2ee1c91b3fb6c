"""Which layers attend within config.json's sliding_window: family by family, as transformers' models apply it.

A key that a family's transformers model ignores changes nothing here either (a llama config.json with a leftover
sliding_window trains as LlamaForCausalLM does: full causal attention). WINDOW_RULES, per model_type:
- "every": every layer, when sliding_window is set (MistralModel, MixtralModel, Phi3Model: one mask for all
  layers, config.json's layer_types never read);
- "every-switched": the same, only with use_sliding_window (Qwen3MoeConfig drops the window without it);
- "layer-types": the layers layer_types names sliding_attention (Gemma2, Gemma3, GptOss);
- "layer-types-switched": the same, only with use_sliding_window (Qwen2Config and Qwen3Config drop the window
  without it, and derive layer_types from max_window_layers where the file has none);
- "ignored": never (LlamaForCausalLM, Olmo2ForCausalLM);
- "refused": OlmoeForCausalLM's masks are plain causal, but it hands the window to the attention kernel, which only
  flash attention applies: what transformers trains then depends on the kernel, so a set window is refused.

A window that applies must be a whole number of at least 1: transformers' mask of a window below 1 hides every key
from every query. Works on a PretrainedConfig or on config.json's raw dict (keys its config class would default
are then absent, and read as absent).
"""

from __future__ import annotations

from ..errors import MegatrainError

WINDOW_RULES = {
    "llama": "ignored", "olmo2": "ignored", "olmoe": "refused",
    "mistral": "every", "mixtral": "every", "phi3": "every", "qwen3_moe": "every-switched",
    "gemma2": "layer-types", "gemma3_text": "layer-types", "gpt_oss": "layer-types",
    "qwen2": "layer-types-switched", "qwen3": "layer-types-switched",
}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _get(c, key: str):
    return c.get(key) if isinstance(c, dict) else getattr(c, key, None)


def sliding_window(c) -> int | None:
    """The window transformers' model of c's family applies, or None (see the module). MegatrainError naming the
    key (the caller adds the file) for a window that applies and is not a whole number of at least 1."""
    rule = WINDOW_RULES[_get(c, "model_type")]
    window = _get(c, "sliding_window")
    if window is None or rule == "ignored" or rule.endswith("-switched") and not _get(c, "use_sliding_window"):
        return None
    if rule == "refused":
        raise MegatrainError(f"sliding_window: {window!r} is set, but transformers' {_get(c, 'model_type')} applies it "
                             "only under flash attention (its eager and SDPA attention see the whole causal prefix); "
                             "set it to null to train with full attention")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise MegatrainError(f"sliding_window: expected a whole number of at least 1 (or null: no window), got "
                             f"{window!r}")
    return window


def layer_kinds(c, window: int | None, num_layers: int) -> list[str]:
    """"sliding" or "full" per layer, for the window `window` (sliding_window(c), as the adapter keeps it): every layer
    slides for the "every" rules (and where a layer-types family's config has no layer_types), else the layers
    layer_types names sliding_attention. MegatrainError naming the key for layer_types of an unknown kind, of the
    wrong length where a window applies, or naming sliding layers that no window applies to (transformers' mask then
    raises). config.json's own list is checked whole as the file is read (check_layer_types, limits.py)."""
    rule = WINDOW_RULES[_get(c, "model_type")]
    types = _get(c, "layer_types") if rule.startswith("layer-types") else None
    if types is not None:
        if not isinstance(types, (list, tuple)):
            check_layer_types(types, num_layers)
        unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if unknown:
            raise MegatrainError(f"layer_types: {unknown} are not supported (supported: {', '.join(LAYER_TYPES)})")
        if window is None and "sliding_attention" in types:
            why = "no sliding_window applies (use_sliding_window is false)" if rule.endswith("-switched") and \
                not _get(c, "use_sliding_window") else "sliding_window is not set"
            raise MegatrainError(f"layer_types: names sliding_attention layers, but {why}")
    if window is None:  # (every layer full: the list's length does not matter, as for a copy cut to fewer layers)
        return ["full"] * num_layers
    if types is None:
        return ["sliding"] * num_layers
    check_layer_types(types, num_layers)
    return ["sliding" if t == "sliding_attention" else "full" for t in types]


def check_layer_types(types, num_layers) -> None:
    """layer_types (where config.json sets them) as transformers' config validation takes them, for every family:
    a list of one entry per layer. Their kinds are checked per family (layer_kinds)."""
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) != num_layers):
        shown = (f"{len(types)} entr{'y' if len(types) == 1 else 'ies'}" if isinstance(types, (list, tuple)) else
                 repr(types))
        raise MegatrainError(f"layer_types: {shown} for {num_layers} layers (num_hidden_layers)")
