"""The command line as a new user meets it: overrides without a config file start from the schema's defaults (not
the demo's), and every user error of every subcommand is one `megatrain: error: ...` line with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

import pytest

from megatrain.cli import main
from test_inputs import setup  # noqa: F401  (fixture: a tiny model with its tokenizer, a text data file)

PREFIX = "megatrain: error: "


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(capsys, *argv) -> str:
    """Run a command that must fail on the user's input: exit 2, no traceback, the last stderr line the error."""
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(PREFIX), err
    return last[len(PREFIX):]


# ---- 1. overrides without a config file ----------------------------------------------------------------------------
def test_overrides_without_a_config_file_start_from_the_schema_defaults(setup, capsys, monkeypatch):  # noqa: F811
    tmp_path, model_dir, data = setup
    monkeypatch.chdir(tmp_path)
    # relative paths on the command line are relative to the working directory; nothing of the demo is kept
    # (its eval set and exact-match file would be read through this model's tokenizer, which has no chat template)
    rc, _, err = run_cli(capsys, "train", "model.path=model", "data.path=train.jsonl", "data.max_seq_len=32",
                         "train.steps=2", "train.micro_batch_size=2", "train.precision=fp32", "output.dir=out")
    assert rc == 0, err
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model"]["path"] == str(model_dir) and saved["model"]["init"] == "pretrained"
    assert saved["data"]["path"] == str(data) and saved["data"]["format"] == "text"
    assert saved["data"]["eval_path"] is None and saved["train"]["exact_match_path"] is None
    assert saved["train"]["lr"] == 1e-5  # the schema's default, not the demo's 3e-3
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert not any("eval_loss" in r or "eval_exact_match" in r for r in records)


def test_data_command_with_overrides_only_reads_the_users_files(setup, capsys, monkeypatch):  # noqa: F811
    tmp_path, model_dir, data = setup
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "data", "model.path=model", "data.path=train.jsonl", "data.max_seq_len=32",
                           "--preview", "1")
    assert rc == 0, err
    assert "train.jsonl" in out and "reverse" not in out


def test_missing_model_path_says_what_to_give(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"text": "hi"}\n')
    for command in ("train", "plan", "data"):
        msg = one_error(capsys, command, "data.path=train.jsonl")
        assert "model.path" in msg and "required" in msg
        assert "config file" in msg and "model.path=..." in msg
        assert "`megatrain train` alone runs the embedded demo" in msg
    assert not (tmp_path / "runs").exists()


def test_data_command_without_arguments_shows_the_demo(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    rc, out, err = run_cli(capsys, "data", "--preview", "1")
    assert rc == 0, err
    assert "reverse-train.jsonl" in out


# ---- 3. one prefix and one exit status ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: command"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["data", "--preview", "many"], "argument --preview: expected a whole number of at least 0, got 'many'"),
    (["export"], "the following arguments are required: CHECKPOINT_OR_RUN_DIR, OUT_DIR"),
    (["export", "a", "b", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["probe", "--compile", "sometimes"], "argument --compile: invalid choice: 'sometimes'"),
    (["probe", "--bogus"], "unrecognized arguments: --bogus"),
    (["probe", "--layer", "nowhere"], "probe: --layer 'nowhere': expected MODEL_DIR:MICROxSEQ"),
    (["probe", "--layer", "nowhere:2x16"], "probe: --layer 'nowhere:2x16': nowhere/config.json does not exist"),
])
def test_argument_errors_share_the_prefix_and_exit_status(capsys, argv, message):
    msg = one_error(capsys, *argv)
    assert msg.startswith(message), msg


def test_argument_errors_keep_the_usage_line(capsys):
    rc, _, err = run_cli(capsys, "train", "--bogus")
    lines = err.strip().splitlines()
    assert rc == 2 and lines[0].startswith("usage: megatrain ")
    assert lines[-1] == f"{PREFIX}unrecognized arguments: --bogus"
    rc, _, err = run_cli(capsys, "probe", "--bogus")
    lines = err.strip().splitlines()
    assert rc == 2 and lines[0].startswith("usage: megatrain probe")
    assert lines[-1] == f"{PREFIX}unrecognized arguments: --bogus"


def test_probe_output_under_a_file_is_refused_before_measuring(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    msg = one_error(capsys, "probe", "--out", str(tmp_path / "afile" / "profile.json"))
    assert msg == f"probe: --out: {tmp_path / 'afile' / 'profile.json'} lies under {tmp_path / 'afile'}, which is a file"
    msg = one_error(capsys, "probe", "--out", str(tmp_path))
    assert msg == f"probe: --out: {tmp_path} is a directory, not a file"


def test_probe_keeps_a_file_that_is_not_a_profile_and_refuses_empty_shapes(tmp_path, capsys):
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    msg = one_error(capsys, "probe", "--out", str(precious))
    assert msg == f"probe: --out {precious} exists and is not a profile megatrain probe wrote; choose another path"
    assert precious.read_text() == "mine"
    link = tmp_path / "link.json"
    link.symlink_to(precious)
    assert one_error(capsys, "probe", "--out", str(link)).endswith("is a symbolic link; give the file's own path")
    tiny = Path(__file__).resolve().parents[1] / "megatrain" / "defaults" / "tiny-llama"
    msg = one_error(capsys, "probe", "--out", str(tmp_path / "p.json"), "--layer", f"{tiny}:0x5")
    assert msg.endswith("rows and tokens must be whole numbers above 0")


def test_a_seed_beyond_64_bits_is_a_config_error(tmp_path, capsys):
    tiny = Path(__file__).resolve().parents[1] / "megatrain" / "defaults" / "default.yaml"
    msg = one_error(capsys, "plan", str(tiny), "train.seed=18446744073709551616")
    assert msg.startswith("command line: train.seed: Input should be less than or equal to 9223372036854775807")


def test_every_subcommand_reports_user_errors_the_same_way(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert one_error(capsys, "train", "model.path=nope") == f"model.path: directory {tmp_path / 'nope'} does not exist"
    assert one_error(capsys, "plan", "model.path=nope") == f"model.path: directory {tmp_path / 'nope'} does not exist"
    assert one_error(capsys, "data", "model.path=nope") == "data.path: no training data given (set data.path or " \
                                                            "data.datasets)"
    assert one_error(capsys, "export", "nope", "o") == "export: nope does not exist"
    assert not (tmp_path / "o").exists() and not (tmp_path / "runs").exists()


def test_the_installed_command_prints_no_traceback(tmp_path):
    """The same through a real process: `python -m megatrain.cli`."""
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"model:\n  path: caf\xe9\n")
    for argv in (["train", str(bad)], ["probe", "--layer", "x"], ["train", "--bogus"]):
        r = subprocess.run([sys.executable, "-m", "megatrain.cli", *argv], capture_output=True, text=True,
                           cwd=tmp_path, timeout=300)
        assert r.returncode == 2, (argv, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.strip().splitlines()[-1].startswith(PREFIX), r.stderr
