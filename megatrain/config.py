"""YAML + `key.sub=value` overrides -> one validated `Config`.

Every problem is reported at once, each naming the key, the bad value, what is allowed, and where the key was
written (file and line, or the command line). Unknown keys are rejected with the nearest valid name.
Relative input paths (model.path, model.tokenizer, data.*path) are resolved against the config file's folder;
output.dir, resume and export.dir are relative to the working directory.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .data.config import DataConfig
from .errors import ConfigError

DEFAULT_CONFIG = Path(__file__).parent / "defaults" / "default.yaml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelConfig(_Strict):
    path: str = Field(description="Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
    init: Literal["pretrained", "random"] = "pretrained"
    tokenizer: str | None = Field(None, description="tokenizer directory, if not model.path")


class TrainConfig(_Strict):
    steps: int = Field(100, gt=0)
    micro_batch_size: int = Field(1, gt=0)
    grad_accum_steps: int = Field(1, gt=0)
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = Field(1.0, ge=0)
    seed: int = 0
    precision: Literal["bf16", "fp32"] = "bf16"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    eval_every: int = Field(0, ge=0, description="steps between evaluations (0: only at the end, if eval data)")
    exact_match_path: str | None = Field(None, description="alpaca JSONL whose answers greedy decoding must match")
    init_std: float | None = Field(None, gt=0, description="std of random init; default: config.json's initializer_range")


class EngineConfig(_Strict):
    loss_chunk_tokens: int = Field(0, ge=0, description="target tokens per LM-head chunk (0: from vocabulary size)")
    num_slots: int = Field(2, ge=2, description="GPU weight slots (double buffering needs 2)")
    spill_layers: int = Field(0, ge=0, description="keep the layer-boundary checkpoints of this many lowest layers "
                              "in pinned host memory instead of on the GPU")
    offload_grad_units: int = Field(0, ge=0, description="send the gradients of this many units (head, last layer, "
                                    "...) to host memory during backward instead of keeping them on the GPU")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile the layer template (auto: on CUDA only; fuses the elementwise work)")
    gpu_memory_budget_gb: float | None = Field(
        None, gt=0, description="GPU memory the run may use, in GiB (default: what the device has free); the plan "
                                "refuses a run whose predicted peak exceeds it")


class OutputConfig(_Strict):
    dir: str = "runs/megatrain"
    tensorboard: bool = False
    overwrite: bool = Field(False, description="allow writing into a non-empty output.dir")
    wandb: bool = Field(False, description="also log metrics to Weights & Biases (needs the wandb package)")


class PlanConfig(_Strict):
    profile: str | None = Field(None, description="machine profile written by `megatrain probe` (default: "
                                                  "~/.cache/megatrain/profile.json if present, else H200 defaults)")
    host_memory_gb: float | None = Field(None, gt=0, description="host RAM the run may use, in GiB (default: what "
                                                                 "this machine has free, honouring cgroup limits)")
    check: bool = Field(True, description="`megatrain train` refuses, before loading weights, a run the plan says "
                                          "will not fit")


class CheckpointConfig(_Strict):
    every: int = Field(0, ge=0, description="steps between checkpoints in output.dir/checkpoints (0: only at the end)")
    keep: int = Field(2, ge=0, description="newest complete checkpoints kept (0: all)")
    at_end: bool = Field(True, description="save a checkpoint when training finishes")


class ExportConfig(_Strict):
    at_end: bool = Field(False, description="export a Hugging Face model directory when training finishes")
    dir: str | None = Field(None, description="where the export goes (default: output.dir/export)")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="dtype of the exported weights")
    max_shard_mb: float = Field(5000.0, gt=0, description="largest safetensors shard, in MB")


class Config(_Strict):
    model: ModelConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    output: OutputConfig = OutputConfig()
    plan: PlanConfig = PlanConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()
    resume: str | None = Field(None, description="'auto': continue from the newest complete checkpoint in "
                                                 "output.dir (none yet: start fresh); or a checkpoint directory")


INPUT_PATHS = (("model", "path"), ("model", "tokenizer"), ("train", "exact_match_path"))  # data paths: DataConfig.resolve_relative


def _key_lines(node, prefix=()) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line number."""
    out = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = prefix + (k.value,)
            out[path] = k.start_mark.line + 1
            out.update(_key_lines(v, path))
    return out


def _set(d: dict, path: list[str], value: Any) -> None:
    for k in path[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {'.'.join(path)}: '{k}' is not a section")
        d = nxt
    d[path[-1]] = value


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: Any = Config
    for k in loc:
        field = getattr(model, "model_fields", {}).get(k)
        if field is None:
            return None
        model = field.annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _describe(err: dict, where: str) -> str:
    loc = tuple(str(x) for x in err["loc"])
    key = ".".join(loc)
    if err["type"] == "extra_forbidden":
        parent = _model_at(loc[:-1])
        names = list(parent.model_fields) if parent else []
        close = difflib.get_close_matches(loc[-1], names, n=1, cutoff=0.5)
        hint = f"; did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else \
            f"; valid keys here: {', '.join(names)}"
        return f"{where}{key}: unknown key{hint}"
    if err["type"] == "missing":
        return f"{where}{key}: required key is missing"
    got = err.get("input")
    return f"{where}{key}: {err['msg']} (got {got!r})"


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read, merge overrides, validate. Raises ConfigError listing every problem."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        raw = yaml.safe_load(text) or {}
        lines = _key_lines(yaml.compose(text)) if raw else {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, train, ...)")
    base = path.resolve().parent
    for section, key in INPUT_PATHS:
        v = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(v, str) and not Path(v).expanduser().is_absolute():
            raw[section][key] = str(base / v)
    if isinstance(raw.get("data"), dict):
        DataConfig.resolve_relative(raw["data"], base)
    from_cli = set()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        _set(raw, parts, yaml.safe_load(value) if value != "" else None)
        from_cli.add(tuple(parts))
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = tuple(str(x) for x in err["loc"])
            if loc in from_cli or loc[:-1] in from_cli:
                where = "command line: "
            else:
                line = lines.get(loc) or lines.get(loc[:-1]) or lines.get(loc[:1])
                where = f"{path}:{line}: " if line else f"{path}: "
            problems.append(_describe(err, where))
        n = len(problems)
        raise ConfigError(f"{n} problem{'s' if n > 1 else ''} in the config:\n  " + "\n  ".join(problems)) from None
