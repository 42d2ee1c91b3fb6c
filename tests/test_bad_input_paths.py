"""Every file the run reads and every folder it writes: the wrong kind of path, a file in the way, a broken
tokenizer or exact-match file. Each is one error naming the key and the path, raised before anything is written
to output.dir (the run's first write is in trainer.start)."""

from __future__ import annotations

import json

import pytest
import yaml

from megatrain.checkpoint.export import check_export_target
from megatrain.cli import main
from megatrain.errors import MegatrainError
from test_inputs import error_of, setup, write_config  # noqa: F401  (setup: a fixture)

PREFIX = "megatrain: error: "


def cli_error(capsys, tmp_path, *argv) -> str:
    """`megatrain ARGV` fails with one error line, exit status 2, and output.dir (tmp_path/out) never appears."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()  # (datasets' progress bars come before)
    assert "Traceback" not in err and lines[-1].startswith(PREFIX) and err.count(PREFIX) == 1, err
    assert not (tmp_path / "out").exists(), "nothing may be written before the inputs are checked"
    return lines[-1][len(PREFIX):]


def add(cfg_path, section: str, **kw):
    raw = yaml.safe_load(cfg_path.read_text())
    raw.setdefault(section, {}).update(kw)
    cfg_path.write_text(yaml.safe_dump(raw))
    return cfg_path


def alpaca(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# ---- the exact-match file: read and checked before the run starts ---------------------------------------------------
def test_missing_exact_match_file(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data, exact_match_path=str(tmp_path / "em.jsonl"))
    assert error_of(tmp_path, cfg) == f"train.exact_match_path: {tmp_path / 'em.jsonl'} does not exist"
    assert cli_error(capsys, tmp_path, "train", str(cfg)) == \
        f"train.exact_match_path: {tmp_path / 'em.jsonl'} does not exist"


@pytest.mark.parametrize("content, problem", [
    (b'{"instruction": "a", "output": "b"}\n{"instruction": "a"\n', ":2: malformed JSON"),
    (b'{"instruction": "a", "output": "b"}\n{"instruction": "a"}\n', ":2: missing key 'output'"),
    (b'{"instruction": "a", "output": 3}\n', ":1: 'output' must be a string, got int"),
    (b'{"instruction": ["a"], "output": "b"}\n', ":1: 'instruction' must be a string, got list"),
    (b'{"instruction": "a", "input": 1, "output": "b"}\n', ":1: 'input' must be a string, got int"),
    (b'["a", "b"]\n', ":1: expected an alpaca row (an object with instruction, output), got list"),
    (b'{"instruction": "caf\xe9", "output": "b"}\n', ":1: not valid UTF-8 (byte 0xe9 at column 21, byte offset 20)"),
    (b"\n\n", " holds no rows"),
])
def test_malformed_exact_match_file(setup, capsys, content, problem):
    tmp_path, model_dir, data = setup
    em = tmp_path / "em.jsonl"
    em.write_bytes(content)
    cfg = add(write_config(tmp_path, model_dir, data, exact_match_path=str(em)), "data", chat_template=CHAT)
    msg = cli_error(capsys, tmp_path, "train", str(cfg))
    assert msg.startswith(f"train.exact_match_path: {em}{problem}"), msg


def test_exact_match_needs_a_chat_template(setup, capsys):
    """A case that passed every check and failed at the step-0 evaluation, after config.json and metrics.jsonl
    were written: greedy decoding renders its prompts with the tokenizer's chat template, which this one lacks."""
    tmp_path, model_dir, data = setup
    em = alpaca(tmp_path / "em.jsonl", [{"instruction": "hello", "output": "world"}])
    cfg = write_config(tmp_path, model_dir, data, exact_match_path=str(em))
    msg = cli_error(capsys, tmp_path, "train", str(cfg))
    assert msg == ("train.exact_match_path: the prompts are rendered with the tokenizer's chat template, but the "
                   "tokenizer has none; set data.chat_template")
    # with a template the same run trains and evaluates
    add(cfg, "data", chat_template=CHAT)
    assert main(["train", str(cfg)]) == 0
    records = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_exact_match" in r for r in records)


# ---- folders the run writes ----------------------------------------------------------------------------------------
def test_output_dir_that_is_a_file_or_under_one(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    (tmp_path / "afile").write_text("x")
    msg = cli_error(capsys, tmp_path, "train", str(cfg), f"output.dir={tmp_path / 'afile'}")
    assert msg == f"output.dir: {tmp_path / 'afile'} is a file, not a directory"
    msg = cli_error(capsys, tmp_path, "train", str(cfg), f"output.dir={tmp_path / 'afile' / 'run' / 'x'}")
    assert msg == f"output.dir: {tmp_path / 'afile' / 'run' / 'x'} lies under {tmp_path / 'afile'}, which is a file"


def test_export_dir_under_a_file_is_refused_before_training(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    (tmp_path / "afile").write_text("x")
    msg = cli_error(capsys, tmp_path, "train", str(cfg), "export.at_end=true",
                    f"export.dir={tmp_path / 'afile' / 'export'}")
    assert msg == f"export.dir: {tmp_path / 'afile' / 'export'} lies under {tmp_path / 'afile'}, which is a file"
    msg = cli_error(capsys, tmp_path, "train", str(cfg), "export.at_end=true", f"export.dir={tmp_path / 'afile'}")
    assert msg == f"export.dir: {tmp_path / 'afile'} is a file, not a directory"


def test_export_command_target_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(MegatrainError) as e:
        check_export_target(tmp_path / "afile" / "model")
    assert str(e.value) == f"export: {tmp_path / 'afile' / 'model'} lies under {tmp_path / 'afile'}, which is a file"
    with pytest.raises(MegatrainError) as e:
        check_export_target(tmp_path / "afile")
    assert str(e.value) == f"export: {tmp_path / 'afile'} is a file, not a directory"


def test_export_source_that_is_a_file(tmp_path):
    from megatrain.cli import main

    (tmp_path / "afile").write_text("x")
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["export", str(tmp_path / "afile"), str(tmp_path / "out")])
    assert rc == 2 and err.getvalue().strip() == (f"megatrain: error: export: {tmp_path / 'afile'} is a file; "
                                                  f"expected a checkpoint directory (step-N) or a run's output.dir")
    assert not (tmp_path / "out").exists()


# ---- inputs of the wrong kind --------------------------------------------------------------------------------------
def test_paths_of_the_wrong_kind(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    afile = tmp_path / "afile"
    afile.write_text("x")
    (tmp_path / "adir").mkdir()
    adir = tmp_path / "adir"
    cases = [
        (f"model.path={afile}", f"model.path: {afile} is a file; expected a Hugging Face model directory "
                                f"(config.json, *.safetensors, tokenizer files)"),
        (f"model.tokenizer={afile}", f"model.tokenizer: {afile} is a file; expected a directory of tokenizer files "
                                     f"(tokenizer.json, tokenizer_config.json, ...)"),
        (f"data.chat_template={adir}", f"data.chat_template: {adir} is a directory; expected a Jinja file (or the "
                                       f"template itself)"),
        (f"train.exact_match_path={adir}", f"train.exact_match_path: {adir} is a directory; expected an alpaca "
                                           f"JSON-lines file"),
        (f"plan.profile={adir}", f"plan.profile: {adir} is a directory; expected a profile written by "
                                 f"`megatrain probe`"),
        (f"resume={afile}", f"resume: {afile} is a file; expected a checkpoint directory (step-N) or a run's "
                            f"output.dir"),
    ]
    for override, want in cases:
        assert cli_error(capsys, tmp_path, "train", str(cfg), override) == want
    assert cli_error(capsys, tmp_path, "plan", str(cfg), "model.path=/dev/null") == \
        "model.path: /dev/null is not a directory"  # (not "does not exist": it does, as a device)
    assert cli_error(capsys, tmp_path, "plan", str(cfg), f"model.path={afile}") == cases[0][1]
    assert cli_error(capsys, tmp_path, "data", str(cfg), f"data.chat_template={adir}") == cases[2][1]


def test_profile_that_is_not_json(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    prof = tmp_path / "profile.json"
    prof.write_text('{"version": 1,\n  "cpu": }\n')
    assert cli_error(capsys, tmp_path, "train", str(cfg), f"plan.profile={prof}").startswith(
        f"plan.profile: {prof}:2: malformed JSON")
    assert cli_error(capsys, tmp_path, "plan", str(cfg), f"plan.profile={prof}").startswith(
        f"plan.profile: {prof}:2: malformed JSON")


# ---- the model directory's files -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, content, problem", [
    ("tokenizer.json", b'{"version": "1.0",\n "model": }', "tokenizer.json:2: malformed JSON"),
    ("tokenizer_config.json", b'{"a": 1,\n\n "b": ]', "tokenizer_config.json:3: malformed JSON"),
    ("tokenizer_config.json", b'{"eos_token": "\xff"}', "tokenizer_config.json:1: not valid UTF-8 (byte 0xff"),
    ("special_tokens_map.json", b'{', "special_tokens_map.json:1: malformed JSON"),
    ("chat_template.jinja", b"{{ 'caf\xe9' }}", "chat_template.jinja:1: not valid UTF-8 (byte 0xe9"),
])
def test_broken_tokenizer_file_is_named(setup, capsys, name, content, problem):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    (model_dir / name).write_bytes(content)
    msg = cli_error(capsys, tmp_path, "train", str(cfg))
    assert msg.startswith(f"tokenizer: cannot load the tokenizer in {model_dir}: {problem}"), msg


def test_config_json_that_is_not_utf8(setup, capsys):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    raw = (model_dir / "config.json").read_bytes()
    (model_dir / "config.json").write_bytes(raw.replace(b'"llama"', b'"ll\xe1ma"'))
    msg = cli_error(capsys, tmp_path, "train", str(cfg))
    assert msg.startswith(f"{model_dir / 'config.json'}:") and "not valid UTF-8 (byte 0xe1" in msg, msg
    assert cli_error(capsys, tmp_path, "plan", str(cfg)) == msg


def test_generation_config_that_is_not_json(setup, capsys):
    """Copied into every checkpoint and export without being read: a broken one surfaced only when the export was
    loaded."""
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    (model_dir / "generation_config.json").write_text('{"eos_token_id": 2,\n}')
    assert cli_error(capsys, tmp_path, "train", str(cfg)).startswith(
        f"{model_dir / 'generation_config.json'}:2: malformed JSON")


def test_cuda_plan_with_a_profile_probed_without_a_gpu(setup, capsys):
    """A profile written where no GPU was (its disk or CPU only) leaves a CUDA plan no GPU memory: the refusal says
    which profile and what to do, not an empty name."""
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"disk": {"read_bps": 12e9, "write_bps": 12e9, "path": "/nvme"}}))
    rc = main(["plan", str(cfg), "train.device=cuda", f"plan.profile={prof}"])
    out = capsys.readouterr()
    assert rc != 0 and "Traceback" not in out.err
    assert f"0.0 GiB available ({prof} was probed without a GPU; `megatrain probe` on the GPU's host)" in \
        out.out + out.err
