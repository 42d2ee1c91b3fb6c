"""YAML + `key.sub=value` overrides -> one validated `Config`.

Every problem is reported at once, each naming the key, the bad value, what is allowed, and where the key was
written (file and line, or the command line). Unknown keys are rejected with the nearest valid name (in a list
entry too: grpo.rewards[i], data.datasets[i]); so are a key given twice in one mapping, numbers that are not finite
(nan, inf), a boolean where a number goes (YAML's true, yes, on: rl/config.py's Section) and a file that is not UTF-8.
Relative input paths (model.path, model.tokenizer, data.*path) in a config file are resolved against the file's
folder, those given on the command line against the working directory; output.dir, resume and export.dir are
relative to the working directory.

On the command line (`load_command_line`) no config file and no overrides means the embedded demo; overrides alone
start from the schema's defaults. `check_paths` checks that every path of a config that exists is of the right
kind (a folder, a file) and that the folders the run writes are not files nor under one.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from .data.config import DataConfig
from .config_checks import TooLarge, check_overlaps, check_yaml_size, expand_home, objective_problems
from .config_checks import key_name as _key_name
from .errors import TOO_DEEP, ConfigError, MegatrainError, check_dir_target, decode_utf8, load_json
from .rl.config import GRPOConfig, RewardSpec, Section, resolve_reward_paths  # noqa: F401 (RewardSpec: grpo.rewards[i])
from .runtime.knobs import Knob, knobs
from .runtime.schedule import Placement

DEFAULT_CONFIG = Path(__file__).parent / "defaults" / "default.yaml"


class ModelConfig(Section):
    """The model to train."""

    path: str = Field(description="Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
    init: Literal["pretrained", "random"] = Field(
        "pretrained", description="pretrained: the weights in model.path; random: a fresh init of its architecture "
                                  "(train.init_std)")
    tokenizer: str | None = Field(None, description="tokenizer directory, if not model.path")


class TrainConfig(Section):
    """The optimization: steps, batch, AdamW and its learning rate, precision, device, evaluation."""

    steps: int = Field(100, gt=0, description="optimizer steps to run")
    micro_batch_size: int = Field(1, gt=0, description="rows per micro-batch")
    grad_accum_steps: int = Field(1, gt=0, description="micro-batches per optimizer step, their gradients accumulated")
    lr: float = Field(1e-5, gt=0, description="AdamW's peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2)")
    eps: float = Field(1e-8, gt=0, description="AdamW's epsilon")
    warmup_steps: int = Field(0, ge=0, description="steps of linear warmup up to train.lr")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine", description="the learning rate after warmup: constant, or a linear or cosine decay to "
                              "min_lr_ratio x lr at the last step")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's floor, as a share of train.lr")
    max_grad_norm: float | None = Field(
        1.0, ge=0, description="clip the global gradient norm to this (null or 0: no clipping; then each unit's "
                               "update starts as soon as its gradient is complete, during backward)")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed of the data order and of a random init")
    precision: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="compute and streaming dtype (auto: bf16 where the device computes it natively - CUDA "
                            "with bf16 tensor cores, a CPU with AVX512_BF16 or AMX - else fp32; planner/precision.py)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the step runs (auto: CUDA when "
                                                                      "torch sees a device)")
    eval_every: int = Field(0, ge=0, description="steps between evaluations (0: only at the end, if eval data)")
    exact_match_path: str | None = Field(None, description="alpaca JSONL whose answers greedy decoding must match")
    init_std: float | None = Field(None, gt=0, description="std of random init; default: config.json's "
                                                          "initializer_range")
    objective: Literal["sft", "dpo", "ipo", "simpo", "orpo", "grpo"] = Field(
        "sft", description="sft: next-token loss; dpo, ipo, simpo, orpo: preference optimization on (prompt, chosen, "
                           "rejected) pairs, as TRL names them (the preference section; docs/preference.md); grpo: "
                           "online RL on completions sampled for prompts and scored by rewards (the grpo section; "
                           "docs/grpo.md)")

    @field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in v):  # beta = 1 never forgets; outside [0, 1) the moments diverge at step 2
            raise ValueError("each of Adam's betas must lie in [0, 1)")
        return v

    @property
    def clipping(self) -> bool:
        """Whether the step clips the global gradient norm (null or 0 turn it off: runtime.adamw.clip_coefficient
        is then 1, and the optimizer need not wait for the norm)."""
        return bool(self.max_grad_norm)


class EngineConfig(Section):
    """How the GPU runs the step: the LM head's chunks, weight slots, compiling."""

    loss_chunk_tokens: int = Field(0, ge=0, description="target tokens per LM-head chunk (0: from vocabulary size)")
    num_slots: int = Field(2, ge=2, description="GPU weight slots (double buffering needs 2)")
    compile: Literal["auto", "on", "off"] = Field(
        "auto", description="torch.compile the layer template (auto: on CUDA only; fuses the elementwise work)")
    tune_first: Literal["auto", "on", "off"] = Field(
        "auto", description="compile and tune the layers' kernels on a copy of the model with one layer of each kind, "
                            "beside the host store's allocation and fill where host RAM holds both (else before it), "
                            "so the autotuner's page-locked copies never add to the run's steps (run/tune_first.py; "
                            "auto: when the layers are compiled on CUDA in one process)")

    @field_validator("compile", "tune_first", mode="before")
    @classmethod
    def _on_off(cls, v):
        """YAML 1.1 reads an unquoted `on` / `off` (in a file, or `engine.compile=on` on the command line) as a
        boolean (`true` / `false` too): take it as the word."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class PreferenceConfig(Section):
    """Preference optimization (train.objective dpo, ipo, simpo, orpo; docs/preference.md). train.micro_batch_size
    counts pairs; data.max_seq_len bounds each side."""

    beta: float = Field(0.1, gt=0, description="dpo, ipo, simpo: beta (TRL's DPOConfig.beta, CPOConfig.beta)")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="dpo, simpo: the conservative-DPO label smoothing")
    simpo_gamma: float = Field(0.5, ge=0, description="simpo: the target reward margin gamma (CPOConfig.simpo_gamma)")
    orpo_lambda: float = Field(0.1, gt=0, description="orpo: weight of the odds-ratio term beside the SFT term "
                                                      "(ORPOConfig.beta, the paper's lambda)")
    reference: Literal["auto", "precompute", "stream"] = Field(
        "auto", description="dpo, ipo: the reference log-probs, computed by a forward pass over every pair before "
                            "step 1 and stored with the run (precompute), or from a frozen bf16 copy of the weights "
                            "streamed each step, +2 B/param host RAM (stream); auto: the cheaper, as the plan says")
    reference_path: str | None = Field(None, description="dpo, ipo: a model folder of the same architecture as the "
                                                         "reference (default: the policy at step 0)")


class _Budgets(Section):
    gpu_budget_gb: float | None = Field(None, gt=0, description="GPU memory the run may use, in GiB (default: "
                                                               "what the device has free)")
    host_budget_gb: float | None = Field(None, gt=0, description="host RAM the run may use, in GiB (default: "
                                                                "what this machine has free, cgroup-aware)")


def _knob_field(k: Knob) -> tuple:
    """The memory.* field of a placement knob: its type, bounds and description from its declaration; unset (null)
    lets the planner choose."""
    kind = Literal[k.choices] if k.choices else int  # type: ignore[valid-type]
    return kind | None, Field(None, description=k.description, **({"ge": k.ge} if k.ge is not None else {}))


# one key per field of runtime.schedule.Placement, in its order (runtime/knobs.py)
_PlacementKeys = create_model("_PlacementKeys", __base__=_Budgets, **{k.name: _knob_field(k) for k in knobs(Placement)})


class MemoryConfig(_PlacementKeys):
    """Where things live. The planner chooses every placement from the budgets; a key set here fixes that choice."""

    disk_path: str | None = Field(None, description="a folder on a local SSD for the optimizer states host RAM "
                                                    "cannot hold (the SSD tier): the planner moves Adam v, then m, "
                                                    "then the fp32 master there when memory.host_budget_gb is too "
                                                    "small, read ahead of each unit's update and written behind it "
                                                    "(O_DIRECT)")
    disk_states: list[Literal["v", "m", "master"]] | None = Field(
        None, description="with disk_path: the states kept on the SSD, any of v, m, master (default: chosen, "
                          "none when host RAM holds everything); the master needs the bf16 streaming copy")


class OutputConfig(Section):
    """Where the run writes."""

    dir: str = Field("runs/megatrain", description="the run's folder: metrics, logs, checkpoints, the export")
    tensorboard: bool = Field(False, description="also write TensorBoard events (output.dir/tensorboard)")
    overwrite: bool = Field(False, description="allow writing into a non-empty output.dir")
    wandb: bool = Field(False, description="also log metrics to Weights & Biases (needs the wandb package)")


class PlanConfig(Section):
    """The plan made before the run (`megatrain plan` prints it)."""

    profile: str | None = Field(None, description="machine profile written by `megatrain probe` (default: "
                                                  "~/.cache/megatrain/profile.json if present, else H200 defaults)")
    check: bool = Field(True, description="`megatrain train` refuses, before loading weights, a run the plan says "
                                          "will not fit")


class CheckpointConfig(Section):
    """Checkpoints for exact resume."""

    every: int = Field(0, ge=0, description="steps between checkpoints in output.dir/checkpoints (0: only at the end)")
    keep: int = Field(2, ge=0, description="newest complete checkpoints kept (0: all)")
    at_end: bool = Field(True, description="save a checkpoint when training finishes")


class ExportConfig(Section):
    """A Hugging Face model directory of the trained weights."""

    at_end: bool = Field(False, description="export a Hugging Face model directory when training finishes")
    dir: str | None = Field(None, description="where the export goes (default: output.dir/export)")
    dtype: Literal["bf16", "fp32"] = Field("bf16", description="dtype of the exported weights")
    max_shard_mb: float = Field(5000.0, gt=0, description="largest safetensors shard, in MB")


class Config(Section):
    model: ModelConfig
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    engine: EngineConfig = EngineConfig()
    memory: MemoryConfig = MemoryConfig()
    output: OutputConfig = OutputConfig()
    plan: PlanConfig = PlanConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    export: ExportConfig = ExportConfig()
    preference: PreferenceConfig = PreferenceConfig()
    grpo: GRPOConfig = GRPOConfig()
    resume: str | None = Field(None, description="'auto': continue from the newest complete checkpoint in "
                                                 "output.dir (none yet: start fresh); or a checkpoint directory")

    @model_validator(mode="after")
    def _expand_home(self) -> "Config":
        expand_home(self)  # `~` expanded once, so that the checks and the writes see the same folder
        return self


# keys that moved, old -> new: a config using the old one is told the new name
MOVED_KEYS = {("engine", "spill_layers"): "memory.spill_layers",
              ("engine", "offload_grad_units"): "memory.grads_to_host",
              ("engine", "gpu_memory_budget_gb"): "memory.gpu_budget_gb",
              ("plan", "host_memory_gb"): "memory.host_budget_gb"}
# data paths: DataConfig.resolve_relative
INPUT_PATHS = (("model", "path"), ("model", "tokenizer"), ("train", "exact_match_path"),
               ("preference", "reference_path"))
MERGE_TAG = "tag:yaml.org,2002:merge"
DEMO_HINT = ("give a config file (megatrain train my_run.yaml) or model.path=... on the command line; "
             "`megatrain train` alone runs the embedded demo")


def _key_lines(node, prefix=(), duplicates=None) -> dict[tuple, int]:
    """Map each key path in a YAML document to its 1-based line number (list items by index); a key given twice
    in one mapping is added to `duplicates` as (path, first line, line)."""
    out: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        for k, v in node.value:
            if k.tag == MERGE_TAG or not isinstance(k, yaml.ScalarNode):  # a list as a key: construction refuses it
                continue
            path = prefix + (k.value,)
            line = k.start_mark.line + 1
            if k.value in seen and duplicates is not None:
                duplicates.append((path, seen[k.value], line))
            seen.setdefault(k.value, line)
            out[path] = line
            out.update(_key_lines(v, path, duplicates))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.setdefault(prefix + (i,), v.start_mark.line + 1)
            out.update(_key_lines(v, prefix + (i,), duplicates))
    return out


def _parse_yaml(text: str, prefix: tuple = ()) -> tuple[Any, dict[tuple, int], list]:
    """A YAML document -> (its value, the line of each key path, the duplicate keys as (path, first line, line)).
    Raises yaml.YAMLError (TooLarge for a document too large to build)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            check_yaml_size(node)
        duplicates: list = []
        lines = _key_lines(node, prefix, duplicates)  # before construction, which flattens merge keys in place
        return (loader.construct_document(node) if node is not None else None), lines, duplicates
    finally:
        loader.dispose()


def _read(path: Path) -> tuple[dict, dict[tuple, int]]:
    """The raw mapping of a config file and the line of each key."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a directory, not a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw, lines, duplicates = _parse_yaml(decode_utf8(path.read_bytes(), path))
    except TooLarge as e:
        raise ConfigError(f"{path}: refused: the YAML {e}") from None
    except RecursionError:  # PyYAML composes and constructs nested collections recursively
        raise ConfigError(f"{path}: malformed YAML: {TOO_DEEP}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {getattr(e, 'problem', e)}") from None
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, train, ...)")
    if duplicates:
        raise ConfigError(*[f"{path}:{line}: {_key_name(key)}: duplicate key (first on line {first}); the later "
                            f"one would silently win" for key, first, line in duplicates])
    return raw, lines


def _resolve_inputs(raw: dict, base: Path, registry: bool | None = None) -> None:
    """Rewrite the relative input paths of a raw config mapping against `base`."""
    for section, key in INPUT_PATHS:
        sec = raw.get(section)
        v = sec.get(key) if isinstance(sec, dict) else None
        if isinstance(v, str) and v and not Path(v).expanduser().is_absolute():
            sec[key] = str(base / v)
    if isinstance(raw.get("data"), dict):
        DataConfig.resolve_relative(raw["data"], base, registry)
    if isinstance(raw.get("grpo"), dict):
        resolve_reward_paths(raw["grpo"], base)


def _set(d: dict, path: list[str], value: Any) -> None:
    for k in path[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {'.'.join(path)}: '{k}' is not a section")
        d = nxt
    d[path[-1]] = value


def _get(d: Any, path: list[str]) -> tuple[bool, Any]:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return False, None
        d = d[k]
    return True, d


def _apply_overrides(raw: dict, overrides) -> set[tuple]:
    """Set each `key.sub=value` (a YAML value) in `raw`; relative input paths among them are resolved against the
    working directory. Returns the key paths set."""
    parsed = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key.sub=value")
        key, value = item.split("=", 1)
        parts = key.strip().split(".")
        try:
            v, _, duplicates = _parse_yaml(value, tuple(parts)) if value != "" else (None, {}, [])
        except (yaml.YAMLError, RecursionError) as e:
            why = TOO_DEEP if isinstance(e, RecursionError) else getattr(e, "problem", e)
            raise ConfigError(f"command line: {key.strip()}: malformed YAML value {value!r}: {why}") from None
        if duplicates:
            raise ConfigError(*[f"command line: {_key_name(k)}: duplicate key; the later one would silently win"
                                for k, _, _ in duplicates])
        parsed.append((parts, v))
    given: dict = {}
    for parts, v in parsed:
        _set(given, parts, v)
    data = raw.get("data") if isinstance(raw.get("data"), dict) else {}
    registry = bool(data.get("dataset_info")) or None  # plain dataset entries are then names, not paths
    _resolve_inputs(given, Path.cwd(), registry)
    for parts, v in parsed:
        found, resolved = _get(given, parts)
        _set(raw, parts, _merged(_get(raw, parts)[1], resolved if found else v))
    return {tuple(p) for p, _ in parsed}


def _merged(old: Any, new: Any) -> Any:
    """An override's value over what the file has there: a mapping merges into a section (`train={steps: 2}` keeps
    the file's other train keys), anything else replaces it."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return new
    return {**old, **{k: _merged(old.get(k), v) for k, v in new.items()}}


def _describe(err: dict, where: str) -> str:
    loc = tuple(err["loc"])
    key = _key_name(loc)
    if err["type"] == "extra_forbidden" and loc in MOVED_KEYS:
        return f"{where}{key}: moved: it is now {MOVED_KEYS[loc]}"
    if err["type"] == "extra_forbidden":
        names = Config.keys_at(loc[:-1])
        head, colon, rest = str(loc[-1]).partition(":")
        if colon and head in names:  # flow YAML reads {name:regex} as one key, name:regex, without a value
            return f"{where}{key}: unknown key; did you mean '{head}: {rest}'? (YAML needs a space after the colon)"
        close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
        hint = f"; did you mean '{_key_name(loc[:-1] + (close[0],))}'?" if close else \
            f"; valid keys here: {', '.join(names)}"
        return f"{where}{key}: unknown key{hint}"
    if err["type"] == "missing" and loc in (("model",), ("model", "path")):
        return f"{where}model.path: required: {DEMO_HINT}"
    if err["type"] == "missing":
        return f"{where}{key}: required key is missing"
    got = err.get("input")
    if err["type"] == "finite_number":
        return f"{where}{key}: must be a finite number (got {got!r})"
    return f"{where}{key}: {err['msg']} (got {got!r})"


def _validate(raw: dict, lines: dict[tuple, int], path: Path | None, from_cli: set[tuple]) -> Config:
    def where(loc: tuple) -> str:  # keys are str, list indices int: as in `lines`
        if any(loc[:k] in from_cli for k in range(1, len(loc) + 1)) or \
                (loc not in lines and any(c[:len(loc)] == loc for c in from_cli)):  # (data.bogus.x=1: data.bogus)
            return "command line: "
        line = lines.get(loc) or lines.get(loc[:-1]) or lines.get(loc[:1])
        return f"{path}:{line}: " if line else (f"{path}: " if path else "")

    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(*[_describe(err, where(tuple(err["loc"]))) for err in e.errors()]) from None
    from .data import is_preference, is_prompt  # (their modules, and what they import, when a config is read)

    if problems := objective_problems(cfg, is_preference(cfg.data), is_prompt(cfg.data)):  # objective and data agree
        raise ConfigError(*[where(loc) + msg for loc, msg in problems])
    return cfg


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
    """Read, merge overrides, validate. Raises ConfigError listing every problem. No path: the embedded demo."""
    path = Path(path) if path else DEFAULT_CONFIG
    raw, lines = _read(path)
    _resolve_inputs(raw, path.resolve().parent)
    from_cli = _apply_overrides(raw, overrides)
    return _validate(raw, lines, path, from_cli)


def load_command_line(config: str | Path | None, overrides: list[str] = ()) -> Config:
    """What `megatrain train|plan|data [CONFIG] [key=value ...]` means: CONFIG with the overrides; neither: the
    embedded demo; overrides alone: the schema's defaults with the overrides (none of the demo's settings)."""
    if config or not overrides:
        return load_config(config, overrides)
    raw: dict = {}
    return _validate(raw, {}, None, _apply_overrides(raw, overrides))


def check_paths(cfg: Config, outputs: bool = True, default_profile: Path | None = None) -> None:
    """Each path of the config that exists is of the kind it must be (a missing one is reported by what reads it);
    the machine profile (plan.profile, else `default_profile` if there is one) parses; with `outputs`, output.dir
    (and export.dir when exporting) can be created: neither is a file nor lies under one."""

    def kind(key: str, value: str | None, folder: bool, expected: str) -> None:
        if not value:
            return
        p = Path(value).expanduser()
        if folder and p.is_file():
            raise MegatrainError(f"{key}: {p} is a file; expected {expected}")
        if not folder and p.is_dir():
            raise MegatrainError(f"{key}: {p} is a directory; expected {expected}")

    kind("model.path", cfg.model.path, True,
         "a Hugging Face model directory (config.json, *.safetensors, tokenizer files)")
    kind("model.tokenizer", cfg.model.tokenizer, True,
         "a directory of tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    kind("train.exact_match_path", cfg.train.exact_match_path, False, "an alpaca JSON-lines file")
    kind("preference.reference_path", cfg.preference.reference_path, True, "a Hugging Face model directory")
    if cfg.data.chat_template and "{" not in cfg.data.chat_template:
        kind("data.chat_template", cfg.data.chat_template, False, "a Jinja file (or the template itself)")
    kind("plan.profile", cfg.plan.profile, False, "a profile written by `megatrain probe`")
    kind("data.cache_dir", cfg.data.cache_dir, True, "a folder for the tokenised data")
    check_memory(cfg, disk=outputs)
    if cfg.resume and cfg.resume != "auto":
        kind("resume", cfg.resume, True, "a checkpoint directory (step-N) or a run's output.dir")
    profile = Path(cfg.plan.profile).expanduser() if cfg.plan.profile else default_profile
    if profile is not None and profile.is_file():
        try:
            load_json(profile)
        except MegatrainError as e:
            raise MegatrainError(f"plan.profile: {e}") from None
    if outputs:
        check_dir_target(cfg.output.dir, "output.dir")
        if cfg.export.at_end:
            check_dir_target(cfg.export.dir or Path(cfg.output.dir) / "export", "export.dir")
        if cfg.data.cache_dir:
            check_dir_target(cfg.data.cache_dir, "data.cache_dir")
        check_overlaps(cfg)


def check_memory(cfg: Config, disk: bool = True) -> None:
    """The memory keys that depend on each other or on the machine: memory.disk_states needs memory.disk_path, the
    master on disk needs the bf16 streaming copy; with `disk` (a run, not a plan for another machine),
    memory.disk_path is a writable folder. MegatrainError naming the key; nothing is written."""
    m = cfg.memory
    if m.disk_states and not m.disk_path:
        raise MegatrainError(f"memory.disk_states: {m.disk_states} needs memory.disk_path (a folder on a local SSD) "
                             f"to put them in")
    if m.disk_states and "master" in m.disk_states and (cfg.train.precision == "fp32" or m.stream_dtype == "fp32"):
        raise MegatrainError("memory.disk_states: 'master' on disk needs the bf16 streaming copy in RAM; with "
                             + ("train.precision=fp32" if cfg.train.precision == "fp32" else "memory.stream_dtype=fp32")
                             + " the GPU streams the fp32 master itself, so it stays in RAM (use [v, m])")
    if disk and m.disk_path:
        import os

        p = Path(m.disk_path).expanduser()
        if not p.exists():
            raise MegatrainError(f"memory.disk_path: {p} does not exist; create the folder (on a local SSD) or unset "
                                 f"memory.disk_path")
        if not p.is_dir():
            raise MegatrainError(f"memory.disk_path: {p} is not a folder")
        if not os.access(p, os.W_OK | os.X_OK):
            raise MegatrainError(f"memory.disk_path: {p} is not writable by this user")
