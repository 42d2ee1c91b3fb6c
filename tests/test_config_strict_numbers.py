"""A boolean where the config wants a number is one line naming the key, in a file as on the command line (lax
pydantic read `top_k: true` as 1, `beta: yes` as 1.0); ints for floats, `1e-5`, `1.0e-5` and null still load. An
unknown key inside an entry of a list of objects (grpo.rewards, data.datasets) is told that entry's keys."""

from __future__ import annotations

from types import UnionType
from typing import Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from megatrain.cli import main
from megatrain.config import Config, load_command_line, load_config
from megatrain.data.config import DatasetSpec
from megatrain.errors import ConfigError
from megatrain.rl.config import RewardSpec

# the least valid entry of each list of objects, beside which a numeric key is set (a new entry model needs one)
ENTRY = {RewardSpec: "name: numeric", DatasetSpec: "path: a.jsonl"}
BOOL_NOT_NUMBER = "not a boolean (which YAML makes of an unquoted true, false, yes, no, on or off) (got "


def _number(t) -> bool:
    """Whether a field of type `t` takes a number: int, float, or one of them or null (not bool)."""
    if t in (int, float):
        return True
    return get_origin(t) in (Union, UnionType) and bool not in get_args(t) and any(map(_number, get_args(t)))


def _entry_model(t) -> type[BaseModel] | None:
    if get_origin(t) is list and isinstance(get_args(t)[0], type) and issubclass(get_args(t)[0], BaseModel):
        return get_args(t)[0]
    return next(filter(None, map(_entry_model, get_args(t))), None) if get_origin(t) in (Union, UnionType) else None


def numeric_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(id, override, key the error names) for every numeric field below `model`: each set to true, in a list
    entry (with ENTRY's keys) where it is one, each number of a tuple of numbers (train.betas) true too."""
    out = []
    for name, f in model.model_fields.items():
        t, key = f.annotation, f"{prefix}{name}"
        if isinstance(t, type) and issubclass(t, BaseModel):
            out += numeric_keys(t, f"{key}.")
        elif sub := _entry_model(t):
            out += [(f"{key}[0].{k}", f"{key}=[{{{ENTRY[sub]}, {k}: true}}]", f"{key}[0].{k}")
                    for k, sf in sub.model_fields.items() if _number(sf.annotation)]
        elif _number(t):
            out.append((key, f"{key}=true", key))
        elif get_origin(t) in (tuple, list) and all(map(_number, get_args(t))):
            out.append((key, f"{key}=[{', '.join(['true'] * len(get_args(t)))}]", key))
    return out


NUMERIC = numeric_keys()


def test_the_walk_finds_every_section_and_list_entry():
    keys = {k for _, _, k in NUMERIC}
    assert {"train.lr", "train.steps", "train.micro_batch_size", "train.betas", "train.max_grad_norm",
            "preference.beta", "grpo.top_k", "grpo.max_new_tokens", "grpo.rewards[0].weight", "export.max_shard_mb",
            "data.datasets[0].weight", "data.eval_datasets[0].num_samples", "data.num_proc", "memory.gpu_budget_gb",
            "checkpoint.every", "engine.num_slots"} <= keys, keys
    assert {k.split(".")[0] for k in keys} >= {"train", "engine", "memory", "preference", "grpo", "data", "export",
                                                "checkpoint"}


@pytest.mark.parametrize("override, key", [n[1:] for n in NUMERIC], ids=[n[0] for n in NUMERIC])
def test_true_for_a_number_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_command_line(None, ["model.path=m", override])
    assert len(e.value.problems) == 1, e.value.problems
    assert e.value.problems[0].startswith(f"command line: {key}: Input should be "), e.value.problems
    assert BOOL_NOT_NUMBER in e.value.problems[0], e.value.problems


@pytest.mark.parametrize("value", ["yes", "true", "on", "off", "no", "false", "True"])
def test_yes_in_a_file_and_on_the_command_line(tmp_path, capsys, value):
    p = tmp_path / "c.yaml"
    p.write_text(f"model:\n  path: m\npreference:\n  beta: {value}\n")
    got = "True" if value.lower() in ("yes", "true", "on") else "False"
    line = f"preference.beta: Input should be a number, {BOOL_NOT_NUMBER}{got})"
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.problems == [f"{p}:4: {line}"]
    with pytest.raises(ConfigError) as e:
        load_config(p, [f"preference.beta={value}"])
    assert e.value.problems == [f"command line: {line}"]
    assert main(["plan", str(p)]) == 2
    assert capsys.readouterr().err == f"megatrain: error: {p}:4: {line}\n"


def test_an_integer_key_says_integer_and_all_problems_are_listed(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: m\ngrpo:\n  top_k: true\n  rewards:\n    - {name: numeric, weight: yes}\n"
                 "train:\n  betas: [0.9, no]\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert e.value.problems == [
        f"{p}:8: train.betas: Input should be a number, {BOOL_NOT_NUMBER}[0.9, False])",
        f"{p}:4: grpo.top_k: Input should be an integer, {BOOL_NOT_NUMBER}True)",
        f"{p}:6: grpo.rewards[0].weight: Input should be a number, {BOOL_NOT_NUMBER}True)"]


def _file_and_command_line(tmp_path, settings: dict[str, str]) -> list[Config]:
    """The config of `settings` ({section.key: YAML value}) read from a file and from overrides alone."""
    sections: dict[str, str] = {}
    for k, v in settings.items():
        section, key = k.split(".")
        sections[section] = sections.get(section, f"{section}:\n") + f"  {key}: {v}\n"
    p = tmp_path / "c.yaml"
    p.write_text("".join(sections.values()))
    return [load_config(p), load_command_line(None, [f"{k}={v}" for k, v in settings.items()])]


def test_numbers_ints_exponents_and_null_still_load(tmp_path):
    for cfg in _file_and_command_line(tmp_path, {
            "model.path": "m", "train.lr": "1e-5", "train.eps": "1.0e-7", "train.max_grad_norm": "null",
            "train.betas": "[0, 0.95]", "memory.gpu_budget_gb": "40", "memory.host_budget_gb": "~",
            "data.num_proc": "null", "export.max_shard_mb": "100", "output.tensorboard": "yes",
            "engine.compile": "on"}):
        assert (cfg.train.lr, cfg.train.eps, cfg.train.max_grad_norm, cfg.train.betas) == (1e-5, 1e-7, None, (0, 0.95))
        assert (cfg.memory.gpu_budget_gb, cfg.memory.host_budget_gb, cfg.data.num_proc) == (40.0, None, None)
        assert type(cfg.train.lr) is float and type(cfg.export.max_shard_mb) is float
        assert cfg.output.tensorboard is True and cfg.engine.compile == "on"  # booleans where booleans go
    for cfg in _file_and_command_line(tmp_path, {
            "model.path": "m", "train.objective": "dpo", "data.path": "d.jsonl", "data.format": "preference",
            "preference.beta": "1"}):
        assert cfg.preference.beta == 1.0 and type(cfg.preference.beta) is float
    for cfg in _file_and_command_line(tmp_path, {
            "model.path": "m", "train.objective": "grpo", "data.path": "d.jsonl", "data.format": "prompt",
            "grpo.top_k": "5", "grpo.epsilon_high": "~", "grpo.rewards": "[{name: numeric, weight: 2}]"}):
        assert (cfg.grpo.top_k, cfg.grpo.epsilon_high, cfg.grpo.rewards[0].weight) == (5, None, 2.0)


# ---- unknown keys inside an entry of a list of objects -----------------------------------------------------------
def test_keys_at_a_list_entry():
    assert Config.keys_at(("grpo", "rewards", 0)) == ["name", "weight", "field", "pattern"]
    assert Config.keys_at(("data", "eval_datasets", 3)) == list(DatasetSpec.model_fields)
    assert Config.keys_at(("train",)) == list(Config.model_fields["train"].annotation.model_fields)
    assert Config.keys_at(("train", "lr")) == [] and Config.keys_at(("nope",)) == []


@pytest.mark.parametrize("override, line", [
    ("grpo.rewards=[{name:regex}]",  # flow YAML without a space after the colon: one key, name:regex
     "command line: grpo.rewards[0].name:regex: unknown key; did you mean 'name: regex'? (YAML needs a space after "
     "the colon)"),
    ("grpo.rewards=[numeric, {name: numeric, wieght: 2}]",
     "command line: grpo.rewards[1].wieght: unknown key; did you mean 'grpo.rewards[1].weight'?"),
    ("grpo.rewards=[{name: numeric, colour: 2}]",
     "command line: grpo.rewards[0].colour: unknown key; valid keys here: name, weight, field, pattern"),
    ("data.datasets=[{pth: a.jsonl}]", "command line: data.datasets[0].pth: unknown key; did you mean "
                                       "'data.datasets[0].path'?"),
    ("data.eval_datasets=[{path: a.jsonl, xyz: 2}]",
     "command line: data.eval_datasets[0].xyz: unknown key; valid keys here: " + ", ".join(DatasetSpec.model_fields)),
])
def test_an_unknown_key_in_a_list_entry_is_told_the_entry_keys(override, line):
    with pytest.raises(ConfigError) as e:
        load_command_line(None, ["model.path=m", override])
    assert line in e.value.problems, e.value.problems


def test_a_reward_written_without_a_space_in_a_file(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: m\ngrpo:\n  rewards: [{name: numeric}, {name:regex}]\n")
    assert main(["plan", str(p)]) == 2
    assert capsys.readouterr().err.split("\n") == [
        "megatrain: error: 2 problems in the config:",
        f"  {p}:4: grpo.rewards[1].name: required key is missing",
        f"  {p}:4: grpo.rewards[1].name:regex: unknown key; did you mean 'name: regex'? (YAML needs a space after "
        f"the colon)", ""]
