"""The `data:` section of the config (validated by pydantic; unknown keys rejected)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(None, description="JSON/JSONL file with the training examples")
    format: Literal["text", "alpaca"] = "text"
    max_seq_len: int = Field(2048, gt=1)
    text_field: str = "text"
    overlong: Literal["truncate", "drop"] = "truncate"
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)

    @staticmethod
    def resolve_relative(raw: dict, base: Path) -> None:
        """Rewrite relative input paths of a raw `data:` mapping against the config file's folder `base`."""
        for key in ("path", "eval_path"):
            v = raw.get(key)
            if isinstance(v, str) and not Path(v).expanduser().is_absolute():
                raw[key] = str(base / v)
