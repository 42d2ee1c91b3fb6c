"""The class-wide check of issue 33: every subcommand, fed each kind of bad input, exits with status 2 and prints
the user error the one way errors.py states (one `megatrain: error:` line naming the culprit; several problems of
one config: a count, then one indented line each; argparse's usage line may precede an argument error), with no
traceback, and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from megatrain.cli import main
from test_inputs import setup, write_config  # noqa: F401  (setup: a fixture)

PREFIX = "megatrain: error: "


def check_error(capsys, argv, root: Path) -> list[str]:
    """Run `megatrain ARGV`; assert the rule; return the error's lines (without the prefix)."""
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2, (rc, err[-2000:])
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if not line.startswith(("usage:", " " * 8))]  # argparse's usage
    assert lines and lines[0].startswith(PREFIX) and sum(line.startswith(PREFIX) for line in err.splitlines()) == 1, err
    if len(lines) > 1:  # several problems: the count, then one indented line each
        n = int(lines[0][len(PREFIX):].split()[0])
        assert lines[0] == f"{PREFIX}{n} problems in the config:" and len(lines) == n + 1, err
        assert all(line.startswith("  ") for line in lines[1:]), err
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before, "a failed command wrote files"
    return [line[len(PREFIX):] if line.startswith(PREFIX) else line.strip() for line in lines]


def _edit_model(model_dir: Path, **keys) -> None:
    c = json.loads((model_dir / "config.json").read_text())
    c.update(keys)
    (model_dir / "config.json").write_text(json.dumps(c))


# (name, what it does to the setup -> (config path, overrides), the commands it applies to, what the error names)
def _missing_file(tmp, model, data, cfg):
    return tmp / "nope.yaml", []


def _malformed_yaml(tmp, model, data, cfg):
    cfg.write_text("model: {path: m\ntrain: [\n")
    return cfg, []


def _unknown_keys(tmp, model, data, cfg):
    return cfg, ["train.stepz=1", "train.lrr=2"]


def _key_with_a_line_break(tmp, model, data, cfg):
    raw = yaml.safe_load(cfg.read_text())
    raw["train"]["st\neps"] = 3
    cfg.write_text(yaml.safe_dump(raw))
    return cfg, []


def _model_path_missing(tmp, model, data, cfg):
    return cfg, [f"model.path={tmp / 'no-model'}"]


def _data_path_missing(tmp, model, data, cfg):
    return cfg, [f"data.path={tmp / 'no-data.jsonl'}"]


def _bad_head_count(tmp, model, data, cfg):
    _edit_model(model, num_key_value_heads=3)
    return cfg, []


def _layers_beyond_the_bound(tmp, model, data, cfg):
    _edit_model(model, num_hidden_layers=10**7)
    return cfg, []


def _grad_accum_beyond_the_bound(tmp, model, data, cfg):
    return cfg, ["train.grad_accum_steps=1000000000"]


def _betas_out_of_range(tmp, model, data, cfg):
    return cfg, ["train.betas=[0.9, 1.0]"]


ALL, RUNS = ("train", "plan", "data"), ("train", "plan")
CASES = [(_missing_file, ALL, "does not exist"), (_malformed_yaml, ALL, "malformed YAML"),
         (_unknown_keys, ALL, "train.stepz"), (_key_with_a_line_break, ALL, "train.st\\neps"),
         (_model_path_missing, ALL, "model.path"), (_data_path_missing, ("train", "data"), "data.path"),
         (_bad_head_count, RUNS, "num_key_value_heads"), (_layers_beyond_the_bound, RUNS, "num_hidden_layers"),
         (_grad_accum_beyond_the_bound, RUNS, "train.grad_accum_steps"), (_betas_out_of_range, ALL, "train.betas")]


@pytest.mark.parametrize("command", ALL)
@pytest.mark.parametrize("case,commands,culprit", CASES, ids=[c[0].__name__.strip("_") for c in CASES])
def test_config_subcommands(setup, capsys, command, case, commands, culprit):
    if command not in commands:
        pytest.skip(f"{command} does not read what this case breaks")
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    path, overrides = case(tmp_path, model_dir, data, cfg)
    lines = check_error(capsys, [command, path, *overrides], tmp_path)
    assert any(culprit in line for line in lines), lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,culprit", [
    (lambda t: ["export", t / "no-checkpoint", t / "o"], "no-checkpoint"),
    (lambda t: ["export", t / "run", t / "afile" / "o"], "holds no complete checkpoint"),
    (lambda t: ["export", t / "run", t / "o", "--max-shard-mb", "nan"], "--max-shard-mb"),
    (lambda t: ["export", t / "run", t / "o", "--dtype", "fp\n8"], "fp\\n8"),
    (lambda t: ["probe", "--layer", "nowhere"], "--layer"),
    (lambda t: ["probe", "--bogus"], "--bogus"),
    (lambda t: ["train", "--bogus"], "--bogus"),
    (lambda t: ["nonsense"], "nonsense"),
])
def test_other_subcommands(tmp_path, capsys, argv, culprit):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "run").mkdir()
    lines = check_error(capsys, argv(tmp_path), tmp_path)
    assert any(culprit in line for line in lines), lines
