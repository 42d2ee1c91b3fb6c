"""The `data:` section of the config (validated by pydantic; unknown keys rejected).

One dataset is given inline (`path`, `format`, `columns`, `roles`, ...); several go in `datasets:`, whose entries
inherit the inline `format`/`columns`/`roles`/`sample_by`/`split` unless they set their own. An entry can name a
dataset of a LLaMA-Factory style `dataset_info.json` registry instead of giving a path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..rl.config import Section

Format = Literal["text", "alpaca", "sharegpt", "messages", "prompt_completion", "preference", "prompt"]
SampleBy = Literal["line", "paragraph", "document"]

# Logical column of each format -> default column name in the data. `role`/`content` name the keys inside each
# message of a conversation.
DEFAULT_COLUMNS: dict[str, dict[str, str]] = {
    "text": {"text": "text"},
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system",
               "history": "history"},
    "sharegpt": {"messages": "conversations", "system": "system", "tools": "tools", "role": "from",
                 "content": "value"},
    "messages": {"messages": "messages", "system": "system", "tools": "tools", "role": "role", "content": "content"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion", "system": "system"},
    # (prompt, chosen, rejected) pairs (preference.py); input/history: LLaMA-Factory's alpaca ranking layout
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system",
                   "tools": "tools", "input": "input", "history": "history", "role": "role", "content": "content"},
    # prompts without a completion (train.objective grpo; prompts.py): a string or messages in prompt, or messages
    "prompt": {"prompt": "prompt", "messages": "messages", "system": "system", "tools": "tools", "input": "input",
               "history": "history", "role": "role", "content": "content"},
}
CANONICAL_ROLES = ("system", "user", "assistant", "tool")
# Role names found in the data -> canonical role; `roles:` in the config is merged over these.
DEFAULT_ROLES: dict[str, dict[str, str]] = {
    "sharegpt": {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                 "observation": "tool", "tool": "tool", "function_call": "assistant"},
    "messages": {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool"},
}
DEFAULT_ROLES["preference"] = DEFAULT_ROLES["prompt"] = {**DEFAULT_ROLES["sharegpt"], **DEFAULT_ROLES["messages"]}


def _check_columns(fmt: str, columns: dict[str, str] | None) -> None:
    bad = sorted(set(columns or {}) - set(DEFAULT_COLUMNS[fmt]))
    if bad:
        raise ValueError(f"{', '.join(repr(b) for b in bad)} is not a column of format '{fmt}' "
                         f"(its columns: {', '.join(DEFAULT_COLUMNS[fmt])})")


def _check_roles(roles: dict[str, str] | None) -> None:
    for k, v in (roles or {}).items():
        if v not in CANONICAL_ROLES:
            raise ValueError(f"role '{k}' maps to '{v}'; a role must map to one of {', '.join(CANONICAL_ROLES)}")


class DatasetSpec(Section):
    """One entry of `data.datasets` / `data.eval_datasets`: a path or a registry name, and how to read it."""

    name: str | None = Field(None, description="dataset name in data.dataset_info (instead of path)")
    path: str | None = Field(None, description="file or directory: .json/.jsonl/.parquet/.csv/.txt, or a "
                                               "directory of them, or a directory written by datasets' save_to_disk")
    format: Format | None = Field(None, description="row format; default: data.format")
    columns: dict[str, str] | None = Field(None, description="logical column -> column name in the data; "
                                                             "default: data.columns")
    roles: dict[str, str] | None = Field(None, description="role name in the data -> system/user/assistant/tool")
    weight: float = Field(1.0, gt=0, description="times each example is seen per epoch (0.5: a fresh random "
                                                 "half every epoch, 2: twice)")
    num_samples: int | None = Field(None, gt=0, description="examples drawn per epoch (instead of weight)")
    sample_by: SampleBy | None = Field(None, description=".txt files: one example per line, paragraph or file")
    split: str | None = Field(None, description="split of a saved DatasetDict directory")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.name is None) == (self.path is None):
            raise ValueError("give exactly one of 'name' (a dataset_info entry) or 'path'")
        if self.format:
            _check_columns(self.format, self.columns)
        _check_roles(self.roles)
        return self


class DataConfig(Section):
    """The training and evaluation data, and how rows become tokens and batches."""

    # --- where the data is ----------------------------------------------------------------------------------
    path: str | None = Field(None, description="training data: .json/.jsonl/.parquet/.csv/.txt file, a "
                                               "directory of them, or a datasets save_to_disk directory")
    format: Format = Field("text", description="row format: text, alpaca, sharegpt, messages, prompt_completion, "
                                               "preference ((prompt, chosen, rejected) pairs), prompt (prompts "
                                               "without a completion, for train.objective grpo)")
    columns: dict[str, str] = Field(default_factory=dict, description="logical column -> column name in the data "
                                                                      "(e.g. {output: answer})")
    roles: dict[str, str] = Field(default_factory=dict, description="role name in the data -> system/user/"
                                                                    "assistant/tool (sharegpt, messages)")
    sample_by: SampleBy = Field("line", description=".txt files: one example per line, paragraph or file")
    split: str = Field("train", description="split to read from a saved DatasetDict directory")
    dataset_info: str | None = Field(None, description="LLaMA-Factory style dataset_info.json (or its folder): "
                                                       "a registry of datasets that data.datasets names")
    datasets: list[DatasetSpec] | None = Field(None, description="several training datasets, mixed by weight "
                                                                 "(instead of data.path)")
    eval_path: str | None = Field(None, description="evaluation data, read like data.path")
    eval_datasets: list[DatasetSpec] | None = Field(None, description="evaluation datasets (instead of eval_path)")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of each training file's rows held out "
                                                                  "for evaluation (fixed split, seed-independent)")
    # --- how rows become tokens ------------------------------------------------------------------------------
    max_seq_len: int = Field(2048, gt=1, description="longest example (or packed row) in tokens")
    overlong: Literal["truncate", "drop", "split"] = Field(
        "truncate", description="examples longer than max_seq_len: truncate, drop, or split into pieces (text only)")
    train_on_prompt: bool = Field(False, description="loss on every token, prompts and template text included")
    mask_history: bool = Field(False, description="loss only on the last assistant turn of a conversation")
    add_eos: bool = Field(True, description="text and plain prompt_completion: append the EOS token to each "
                                            "example (chat formats end turns as the chat template says)")
    chat_template: str | None = Field(None, description="Jinja chat template (or a .jinja file) replacing the "
                                                        "tokenizer's; it is set on the run's tokenizer, so exports "
                                                        "carry it")
    skip_bad_rows: bool = Field(False, description="skip and count malformed rows instead of stopping")
    # --- batching ----------------------------------------------------------------------------------------------
    packing: bool = Field(False, description="pack several examples into each max_seq_len row (attention and "
                                             "positions restart per example)")
    packing_strategy: Literal["best_fit", "greedy"] = Field(
        "best_fit", description="best_fit: fullest rows (best-fit decreasing, then rows shuffled); greedy: fill "
                                "rows in shuffled order")
    group_by_length: bool = Field(True, description="without packing: batch examples of similar length to "
                                                    "minimise padding")
    # --- caching -----------------------------------------------------------------------------------------------
    cache_dir: str | None = Field(None, description="datasets cache folder (default: the datasets library's "
                                                    "cache, e.g. ~/.cache/huggingface/datasets)")
    num_proc: int | None = Field(None, ge=1, le=1024, description="processes that tokenise; default: one per 4,096 rows, up "
                                     "to the cores this process may use")

    @field_validator("columns")
    @classmethod
    def _columns_fit_format(cls, v, info: ValidationInfo):
        if "format" in info.data:
            _check_columns(info.data["format"], v)
        return v

    @field_validator("roles")
    @classmethod
    def _roles_canonical(cls, v):
        _check_roles(v)
        return v

    @field_validator("datasets", "eval_datasets", mode="before")
    @classmethod
    def _names_or_paths(cls, v, info: ValidationInfo):
        """A plain string entry is a registry name when data.dataset_info is set, else a path."""
        if isinstance(v, list):
            key = "name" if info.data.get("dataset_info") else "path"
            v = [{key: e} if isinstance(e, str) else e for e in v]
        return v

    @model_validator(mode="after")
    def _consistent(self):
        if self.path and self.datasets:
            raise ValueError("give data.path or data.datasets, not both")
        if self.eval_path and self.eval_datasets:
            raise ValueError("give data.eval_path or data.eval_datasets, not both")
        if self.eval_fraction > 0 and (self.eval_path or self.eval_datasets):
            raise ValueError("give data.eval_fraction or an evaluation set (eval_path/eval_datasets), not both")
        if self.train_on_prompt and self.mask_history:
            raise ValueError("data.train_on_prompt (loss on every token) and data.mask_history exclude each other")
        for key, specs in (("datasets", self.datasets), ("eval_datasets", self.eval_datasets)):
            for i, s in enumerate(specs or []):
                if s.name and not self.dataset_info:
                    raise ValueError(f"data.{key}[{i}] names dataset '{s.name}' but data.dataset_info is not set")
                if s.format is None:
                    try:
                        _check_columns(self.format, s.columns)
                    except ValueError as e:
                        raise ValueError(f"data.{key}[{i}].columns: {e}") from None
        fmts = {s.format or self.format for s in self.datasets} if self.datasets else {self.format}
        if "preference" in fmts:
            if self.packing:
                raise ValueError("data.packing: preference pairs are not packed (a pair's chosen and rejected "
                                 "sequences are rows of one micro-batch); set data.packing: false")
            if self.train_on_prompt:
                raise ValueError("data.train_on_prompt: preference pairs carry loss on their completions only; "
                                 "set data.train_on_prompt: false")
        if self.overlong == "split":
            if fmts != {"text"}:
                raise ValueError("data.overlong: 'split' cuts documents into pieces and is for format 'text' only "
                                 "(use truncate or drop for conversations)")
        return self

    @staticmethod
    def resolve_relative(raw: dict, base: Path, registry: bool | None = None) -> None:
        """Rewrite relative input paths of a raw `data:` mapping against `base` (the config file's folder, or the
        working directory for command-line overrides). Plain-string dataset entries are registry names, not paths,
        when `raw` sets dataset_info or `registry` says one is set elsewhere."""

        def fix(v):
            return str(base / v) if isinstance(v, str) and not Path(v).expanduser().is_absolute() else v

        for key in ("path", "eval_path", "dataset_info"):
            if key in raw:
                raw[key] = fix(raw[key])
        tmpl = raw.get("chat_template")
        if isinstance(tmpl, str) and "{" not in tmpl and (base / tmpl).is_file():
            raw["chat_template"] = str(base / tmpl)
        for key in ("datasets", "eval_datasets"):
            entries = raw.get(key)
            if not isinstance(entries, list):
                continue
            for i, e in enumerate(entries):
                if isinstance(e, dict) and "path" in e:
                    e["path"] = fix(e["path"])
                elif isinstance(e, str) and not (raw.get("dataset_info") or registry):
                    entries[i] = fix(e)  # plain strings are paths unless a registry is given
