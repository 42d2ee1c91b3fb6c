"""The config file and the command line: bytes that are not UTF-8, duplicate keys, non-finite numbers and a
folder given as the config are each one error naming the file, the line and the key."""

from __future__ import annotations

import pytest

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.errors import ConfigError, MegatrainError


def config_error(path, *overrides) -> str:
    with pytest.raises(MegatrainError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def test_config_file_that_is_not_utf8_names_file_line_and_byte(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_bytes(b"model:\n  path: x\ntrain:\n  lr: 1e-4  # caf\xe9\n")
    msg = config_error(p)
    assert msg == f"{p}:4: not valid UTF-8 (byte 0xe9 at column 18, byte offset 41); save the file as UTF-8"
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    assert err == f"megatrain: error: {msg}\n"


def test_duplicate_keys_name_the_key_and_both_lines(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ntrain:\n  lr: 1.0e-4\n  steps: 3\n  lr: 1.0e-3\nmodel:\n  init: random\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    msg = str(e.value)
    assert "2 problems in the config" in msg
    assert f"{p}:6: train.lr: duplicate key (first on line 4); the later one would silently win" in msg
    assert f"{p}:7: model: duplicate key (first on line 1)" in msg
    # a merge key (<<) is not a duplicate
    p.write_text("base: &b\n  path: x\nmodel:\n  <<: *b\n  path: y\n")
    assert "duplicate key" not in config_error(p)


def test_duplicate_keys_inside_a_list_of_datasets(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ndata:\n  datasets:\n    - path: a.jsonl\n      path: b.jsonl\n")
    assert f"{p}:6: data.datasets[0].path: duplicate key (first on line 5)" in config_error(p)


@pytest.mark.parametrize("line, key, shown", [
    ("train:\n  max_grad_norm: .inf\n", "train.max_grad_norm", "inf"),
    ("train:\n  weight_decay: .nan\n", "train.weight_decay", "nan"),
    ("train:\n  betas: [0.9, .inf]\n", "train.betas[1]", "inf"),
    ("memory:\n  gpu_budget_gb: .Inf\n", "memory.gpu_budget_gb", "inf"),
    ("train:\n  init_std: nan\n", "train.init_std", "'nan'"),
    ("data:\n  eval_fraction: -.inf\n", "data.eval_fraction", "-inf"),
])
def test_non_finite_numbers_in_the_file_name_key_and_line(tmp_path, line, key, shown):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\n" + line)
    msg = config_error(p)
    assert f"{p}:4: {key}: must be a finite number (got {shown})" in msg, msg


def test_non_finite_dataset_weight_names_its_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ndata:\n  datasets:\n    - path: a.jsonl\n    - path: b.jsonl\n"
                 "      weight: .inf\n")
    assert f"{p}:7: data.datasets[1].weight: must be a finite number (got inf)" in config_error(p)


@pytest.mark.parametrize("override, key", [
    ("train.max_grad_norm=inf", "train.max_grad_norm"),
    ("train.max_grad_norm=.inf", "train.max_grad_norm"),
    ("train.lr=nan", "train.lr"),
    ("memory.host_budget_gb=1e999", "memory.host_budget_gb"),
    ("data.datasets=[{path: a.jsonl, weight: .nan}]", "data.datasets[0].weight"),
])
def test_non_finite_numbers_on_the_command_line(tmp_path, override, key):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\n")
    msg = config_error(p, override)
    assert f"command line: {key}: must be a finite number" in msg, msg


def test_a_directory_given_as_the_config_file(tmp_path, capsys):
    (tmp_path / "conf").mkdir()
    assert config_error(tmp_path / "conf") == f"config file {tmp_path / 'conf'} is a directory, not a YAML file"
    assert config_error(tmp_path / "nope.yaml") == f"config file {tmp_path / 'nope.yaml'} does not exist"
    assert main(["plan", str(tmp_path / "conf")]) == 2
    assert capsys.readouterr().err == f"megatrain: error: config file {tmp_path / 'conf'} is a directory, " \
                                      f"not a YAML file\n"


def test_override_values_are_checked_like_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\n")
    assert config_error(p, "data.datasets=[{path: a.jsonl, path: b.jsonl}]") == \
        "command line: data.datasets[0].path: duplicate key; the later one would silently win"
    assert config_error(p, "train.betas=[0.9,").startswith("command line: train.betas: malformed YAML value '[0.9,'")


@pytest.mark.parametrize("text,override", [("on", "on"), ("off", "off"), ("'on'", "'on'"), ("auto", "auto")])
def test_engine_compile_on_and_off_unquoted(tmp_path, text, override):
    """YAML 1.1 reads unquoted on / off as booleans: `compile: on` in a file and `engine.compile=on` on the command
    line mean the words the key documents."""
    want = text.strip("'")
    p = tmp_path / "run.yaml"
    p.write_text(f"model:\n  path: {tmp_path}\nengine:\n  compile: {text}\n")
    assert load_config(p).engine.compile == want
    assert load_config(None, [f"model.path={tmp_path}", f"engine.compile={override}"]).engine.compile == want


def test_engine_compile_other_values_are_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"engine.compile: Input should be 'auto', 'on' or 'off' \(got 'fast'\)"):
        load_config(None, [f"model.path={tmp_path}", "engine.compile=fast"])


# ---- one line per problem (errors.py's rule) ----------------------------------------------------------------------
def _stderr_lines(capsys, *argv) -> list[str]:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.rstrip("\n").split("\n")


def test_one_problem_is_one_line(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ntrain:\n  lr: fast\n")
    assert _stderr_lines(capsys, "plan", str(p)) == [f"megatrain: error: {p}:4: train.lr: Input should be a valid "
                                                     f"number, unable to parse string as a number (got 'fast')"]


def test_several_problems_a_count_then_one_line_each_naming_its_key(tmp_path, capsys):
    """A key or a value holding a line break broke its problem over two lines: it is shown escaped."""
    p = tmp_path / "c.yaml"
    p.write_text('model: {path: m}\ntrain:\n  lr_schedule: "exp\\nfoo"\n  "st\\neps": 3\n')
    lines = _stderr_lines(capsys, "plan", str(p))
    assert lines == ["megatrain: error: 2 problems in the config:",
                     f"  {p}:3: train.lr_schedule: Input should be 'constant', 'linear' or 'cosine' (got 'exp\\nfoo')",
                     f"  {p}:4: train.st\\neps: unknown key; did you mean 'train.steps'?"], lines


def test_a_library_message_over_several_lines_is_one_line(tmp_path, capsys, monkeypatch):
    """transformers' config errors span lines (a validator's name, then the reason): the problem stays one line,
    naming the file."""
    import transformers

    from conftest import make_model_dir

    model = tmp_path / "model"
    make_model_dir(model, "llama")
    capsys.readouterr()  # (the model's save progress)

    def refuse(*a, **kw):
        raise ValueError("Class validation error for validator 'validate_architecture':\n    ValueError: bad")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    p = tmp_path / "c.yaml"
    p.write_text(f"model:\n  path: {model}\n")
    lines = _stderr_lines(capsys, "plan", str(p))
    assert lines == [f"megatrain: error: {model / 'config.json'}: cannot be read as a llama config: Class validation "
                     f"error for validator 'validate_architecture': ValueError: bad"], lines


def test_an_argument_holding_a_line_break_is_one_error_line(capsys):
    lines = _stderr_lines(capsys, "export", "a", "b", "--dtype", "fp\n8")
    assert lines[0].startswith("usage: megatrain export") and lines[-1].startswith("megatrain: error: argument --dtype")
    assert sum(line.startswith("megatrain: error: ") for line in lines) == 1 and "fp\\n8" in lines[-1], lines


def test_a_section_given_on_the_command_line_merges_into_the_file(tmp_path):
    """`train={steps: 2}` sets steps and keeps the file's other train keys (it used to replace the section with
    the schema's defaults: another learning rate and batch size, without a word)."""
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ntrain:\n  lr: 3.0e-3\n  micro_batch_size: 4\n  steps: 9\n")
    cfg = load_config(p, ["train={steps: 2}"])
    assert (cfg.train.steps, cfg.train.lr, cfg.train.micro_batch_size) == (2, 3.0e-3, 4)
    cfg = load_config(p, ["train.lr=1e-3", "train={steps: 2}"])  # different keys of one section: both kept
    assert (cfg.train.steps, cfg.train.lr, cfg.train.micro_batch_size) == (2, 1e-3, 4)


def test_a_key_given_again_on_the_command_line_takes_the_later_value(tmp_path):
    """Overrides compose (a script's common ones, then a run's own): the later wins, also inside a mapping."""
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ntrain:\n  micro_batch_size: 4\n")
    cfg = load_config(p, ["train.lr=1", "train.lr=2e-3", "train={steps: 3}"])
    assert (cfg.train.lr, cfg.train.steps, cfg.train.micro_batch_size) == (2e-3, 3, 4)
    cfg = load_config(p, ["train={lr: 1, steps: 3}", "train.lr=2e-3"])
    assert (cfg.train.lr, cfg.train.steps) == (2e-3, 3)


def test_an_unknown_key_from_the_command_line_is_blamed_on_it(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ndata:\n  path: d.jsonl\n")
    assert config_error(p, "data.bogus.x=1").startswith("command line: data.bogus")
    assert config_error(p, "foo.bar=1").startswith("command line: foo")
    p.write_text("model:\n  path: x\ndata:\n  bogus: 1\n")
    assert config_error(p, "data.path=d.jsonl").startswith(f"{p}:4: data.bogus")  # the file's own stays its
