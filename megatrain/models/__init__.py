"""Architecture adapters: Hugging Face config + tensor names -> per-unit tensor specs and stateless templates."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import MegatrainError, load_json
from .base import ModelAdapter, PackedTensor, TensorSpec, Unit
from .decoder import DecoderAdapter
from .fields import plan_fields
from .gemma import GemmaAdapter
from .gpt_oss import GptOssAdapter
from .limits import check_model_config
from .moe import MoEAdapter
from .olmo2 import Olmo2Adapter
from .phi3 import Phi3Adapter

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# model_type -> adapter class. All four share one decoder template, differing in flags read from config.json.
ADAPTERS: dict[str, type[ModelAdapter]] = {
    "llama": DecoderAdapter,
    "mistral": DecoderAdapter,
    "qwen2": DecoderAdapter,
    "qwen3": DecoderAdapter,
    "gemma2": GemmaAdapter,
    "gemma3_text": GemmaAdapter,
    "qwen3_moe": MoEAdapter,
    "mixtral": MoEAdapter,
    "olmoe": MoEAdapter,
    "gpt_oss": GptOssAdapter,
    "phi3": Phi3Adapter,
    "olmo2": Olmo2Adapter,
}


def load_hf_config(model_path: str | Path, plan_only: bool = False) -> PretrainedConfig:
    """Read and validate `config.json` of a model directory, with errors that name the file. plan_only: what the
    planner reads of it, without transformers where the family allows (fields.py), else AutoConfig's."""
    path = Path(model_path)
    if not path.is_dir():
        raise MegatrainError(f"model.path: {path} is not a directory" if path.exists() else
                             f"model.path: directory {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise MegatrainError(f"model.path: {cfg_file} is missing (a Hugging Face model directory needs config.json)")
    raw = load_json(cfg_file)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise MegatrainError(f"{cfg_file}: no 'model_type' key; supported model types: {', '.join(sorted(ADAPTERS))}")
    if not isinstance(raw["model_type"], str):
        raise MegatrainError(f"{cfg_file}: model_type must be a string, got {type(raw['model_type']).__name__}; "
                             f"supported: {', '.join(sorted(ADAPTERS))}")
    if raw["model_type"] not in ADAPTERS:
        raise MegatrainError(
            f"{cfg_file}: model_type '{raw['model_type']}' is not supported; supported: {', '.join(sorted(ADAPTERS))}"
        )
    if raw["model_type"] == "mistral" and "layer_types" in raw:  # (AutoConfig's heuristic, as AutoModel loads it)
        raise MegatrainError(f"{cfg_file}: layer_types: transformers reads a mistral config.json that has layer_types "
                             "as a Ministral model (a window on the layers layer_types names), which megatrain does not "
                             "support; without the key it is Mistral (the window on every layer)")
    check_model_config(raw, cfg_file)  # sizes, heads, numbers, window: before anything is built from them
    fields = plan_fields(raw) if plan_only else None
    if fields is not None:
        check_model_config(fields, cfg_file)
        return fields
    from transformers import AutoConfig

    try:
        hf_config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)  # never the folder's code
    except Exception as e:  # transformers raises many types for a bad config, some over several lines
        raise MegatrainError(f"{cfg_file}: cannot be read as a {raw['model_type']} config: "
                             f"{' '.join(str(e).split())}") from None
    if hf_config.model_type != raw["model_type"]:
        raise MegatrainError(f"{cfg_file}: transformers reads this model_type '{raw['model_type']}' config as "
                             f"'{hf_config.model_type}', which megatrain does not support")
    check_model_config(hf_config, cfg_file)  # with the defaults transformers fills in
    return hf_config


def get_adapter(hf_config: PretrainedConfig) -> ModelAdapter:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ADAPTERS:
        raise MegatrainError(f"model_type '{model_type}' is not supported; supported: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[model_type](hf_config)


__all__ = ["ADAPTERS", "ModelAdapter", "PackedTensor", "TensorSpec", "Unit", "get_adapter", "load_hf_config"]
