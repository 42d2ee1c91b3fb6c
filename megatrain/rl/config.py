"""The `grpo:` config section (train.objective grpo; docs/grpo.md): rollouts, the loss and the rewards.

Kept apart from megatrain/config.py (which holds it as Config.grpo) so that the reward code and the section's
checks read one definition; nothing here imports the rest of megatrain. Section, the base of every config
section, lives here too: rl is the leaf that both megatrain/config.py and megatrain/data/config.py may import.
"""

from __future__ import annotations

import re
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

BUILTIN_REWARDS = ("exact_match", "regex", "numeric")
FIELD_REWARDS = ("exact_match", "numeric")  # the built-ins that read row[field]
FLOAT32_MAX = 3.4028234663852886e38  # rewards, their sum and the advantages are float32 (torch.finfo)


def is_user_reward(name: str) -> bool:
    """Whether a reward name is a user function (path.py:function or module:function), not a built-in."""
    return name not in BUILTIN_REWARDS


def _number_kind(annotation) -> str | None:
    """'an integer' or 'a number' where a field of this type takes one (int, float, or one of them or null)."""
    if annotation in (int, float):
        return "an integer" if annotation is int else "a number"
    if get_origin(annotation) in (Union, UnionType) and bool not in get_args(annotation):
        return next(filter(None, map(_number_kind, get_args(annotation))), None)
    return None


def _bool_as_number(annotation, value) -> str | None:
    """What a field of type `annotation` wanted ('an integer', 'a number') where `value` puts a boolean in place of
    a number, there or inside a list or tuple of numbers (train.betas); else None."""
    if isinstance(value, bool):
        return _number_kind(annotation)
    if isinstance(value, (list, tuple)) and get_origin(annotation) in (list, tuple):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return next((k for i, v in enumerate(value) if args and
                     (k := _bool_as_number(args[min(i, len(args) - 1)], v))), None)
    return None


def _held_model(annotation) -> type[BaseModel] | None:
    """The model a field of this type holds: itself, or its entries' (list[RewardSpec], list[DatasetSpec] | None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(_held_model, get_args(annotation))), None)


class Section(BaseModel):
    """The base of every config section: unknown keys, non-finite numbers and a boolean where a number goes are
    refused. Pydantic's lax mode reads true as 1 (`grpo.top_k: true` sampled greedily; YAML's unquoted yes, no, on,
    off are booleans too); its strict mode would also refuse `1e-5`, a string to YAML 1.1, so booleans are singled
    out here, once for every field of every section."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        if kind := _bool_as_number(cls.model_fields[info.field_name].annotation, v):
            raise PydanticCustomError("bool_not_number", "Input should be {kind}, not a boolean (which YAML makes "
                                      "of an unquoted true, false, yes, no, on or off)", {"kind": kind})
        return v

    @classmethod
    def keys_at(cls, loc: tuple) -> list[str]:
        """The keys valid at `loc` below this section: a subsection's, or an entry's of a list of them (('grpo',
        'rewards', 0) -> name, weight, field, pattern); [] where no section is known."""
        model: Any = cls
        for k in loc:
            if not isinstance(k, int):  # a list entry's model comes with its list's field
                field = getattr(model, "model_fields", {}).get(k)
                model = _held_model(field.annotation) if field else None
        return list(getattr(model, "model_fields", {}))


class RewardSpec(Section):
    """One reward: a built-in or a user function, and its weight in the sum."""

    name: str = Field(description="exact_match (completion.strip() == row[field].strip()), regex (1.0 where "
                                  "re.search(pattern, completion) finds a match; (?s) lets . match line breaks), "
                                  "numeric (the completion's final number - after GSM8K's ####, in \\boxed{}, else "
                                  "the last - equals row[field]'s), or a user function as path.py:function (a path "
                                  "relative to the config's folder) or module:function, called once per rollout "
                                  "batch as fn(prompts, completions, rows) -> one float per completion")
    weight: float = Field(1.0, description="the reward of a completion is the sum of weight x value")
    field: str = Field("answer", description="exact_match, numeric: the row's column holding the expected answer")
    pattern: str | None = Field(None, description="regex: the regular expression searched for in the completion")

    @field_validator("weight")
    @classmethod
    def _weight_in_float32(cls, v: float) -> float:
        if abs(v) > FLOAT32_MAX:  # finite as a Python float, inf once the rewards are summed in float32
            raise ValueError(f"{v:g} is beyond float32's range (+-{FLOAT32_MAX:.4g}), in which the rewards are "
                             f"summed; scale the weights down")
        return v

    @model_validator(mode="after")
    def _consistent(self):
        n = self.name
        if "field" in self.model_fields_set and n not in FIELD_REWARDS:  # never read: a misunderstanding
            raise ValueError(f"field: only exact_match and numeric read a row's field, not {n}"
                             + (" (a user function gets the whole rows)" if is_user_reward(n) else
                                " (it searches the completion for its pattern)"))
        if is_user_reward(n):
            mod, _, fn = n.rpartition(":")
            if not mod.strip() or not fn.strip() or not fn.strip().isidentifier():
                raise ValueError(f"unknown reward '{n}': a built-in ({', '.join(BUILTIN_REWARDS)}) or a user "
                                 f"function as path.py:function or module:function")
        if n == "regex":
            if self.pattern is None:
                raise ValueError("the regex reward needs a pattern")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {e}") from None
        elif self.pattern is not None:
            raise ValueError(f"pattern: only the regex reward reads a pattern, not {n}")
        return self


class GRPOConfig(Section):
    """Online RL with group-relative advantages (train.objective grpo; docs/grpo.md), as TRL's GRPOConfig names its
    keys. train.micro_batch_size counts completions; data.format is prompt; data.max_seq_len bounds prompt +
    completion."""

    prompts_per_rollout: int = Field(64, gt=0, description="prompts sampled per rollout batch; the batch's "
                                                           "prompts_per_rollout x num_generations completions are "
                                                           "split into optimizer steps of train.micro_batch_size x "
                                                           "train.grad_accum_steps completions (evenly: checked)")
    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (a group)")
    num_iterations: int = Field(1, gt=0, description="optimizer passes over each rollout batch (TRL's mu)")
    max_new_tokens: int = Field(256, gt=0, description="longest completion in tokens; a prompt may have "
                                                       "data.max_seq_len - max_new_tokens")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens holding this "
                                                      "much probability (1: off)")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens (0: off)")
    stop: list[str] = Field(default_factory=list, description="strings that end a completion (kept in it), "
                                                              "besides EOS")
    epsilon: float = Field(0.2, ge=0, description="the clipped ratio's lower bound, 1 - epsilon")
    epsilon_high: float | None = Field(None, ge=0, description="the clipped ratio's upper bound, 1 + epsilon_high "
                                                               "(null: epsilon; DAPO's clip-higher uses 0.28)")
    beta: float = Field(0.0, ge=0, description="weight of the KL term to the reference model, the policy at step 0 "
                                               "(k3 estimator; > 0 keeps a frozen copy of the weights in host RAM)")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo", description="how token losses are aggregated: grpo (each completion's token mean, then the mean "
                            "over completions), dr_grpo (token sums / (completions x max_new_tokens)), dapo (the "
                            "mean over all tokens of the step)")
    scale_rewards: bool = Field(True, description="divide each group's advantages by its reward std (false: "
                                                  "Dr. GRPO's unscaled advantages)")
    rollout: Literal["auto", "resident", "streamed"] = Field(
        "auto", description="how rollouts decode: resident (the bf16 weights copied to the GPU beside the KV "
                            "cache), streamed (each decode step streams the layers once); auto: as the plan says")
    rewards: list[RewardSpec] = Field(default_factory=list, description="one or more rewards; a completion's "
                                                                        "reward is their weighted sum")

    @field_validator("rewards", mode="before")
    @classmethod
    def _names(cls, v):
        """A plain string entry is a reward name of weight 1."""
        return [{"name": e} if isinstance(e, str) else e for e in v] if isinstance(v, list) else v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: list[str]) -> list[str]:
        if any(not s for s in v):
            raise ValueError("a stop string must not be empty")
        return v

    @property
    def completions_per_rollout(self) -> int:
        return self.prompts_per_rollout * self.num_generations


def reward_path(name: str) -> str | None:
    """The file part of a user reward named path.py:function (None for a built-in or module:function)."""
    if not is_user_reward(name) or ":" not in name:
        return None
    mod = name.rpartition(":")[0]
    return mod if mod.lower().endswith(".py") or "/" in mod else None


def resolve_reward_paths(raw: dict, base) -> None:
    """Rewrite the relative path.py of each user reward of a raw `grpo:` mapping against `base` (the config file's
    folder, or the working directory for the command line), as other input paths are."""
    from pathlib import Path

    entries = raw.get("rewards")
    for i, e in enumerate(entries if isinstance(entries, list) else []):
        name = e.get("name") if isinstance(e, dict) else e
        path = reward_path(name) if isinstance(name, str) else None
        if path is None or Path(path).expanduser().is_absolute():
            continue
        fixed = f"{Path(base) / path}:{name.rpartition(':')[2]}"
        if isinstance(e, dict):
            e["name"] = fixed
        else:
            entries[i] = fixed
