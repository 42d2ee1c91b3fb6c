"""What a hostile or careless user's files do: paths that try to leave their folder, files that ask for custom code,
library errors on a user's file, values that pass the schema but fail late. Each case is one error line naming the
culprit, raised before anything is written, and nothing is written outside where it belongs."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatrain.checkpoint.export import export_checkpoint
from megatrain.checkpoint.layout import read_manifest
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.errors import ConfigError, MegatrainError
from test_checkpoint_helpers import records, run, setup_run
from test_inputs import error_of, setup, write_config  # noqa: F401  (setup: a fixture)

PREFIX = "megatrain: error: "


def one_line_error(capsys, argv) -> str:
    rc = main(list(argv))
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith(PREFIX) and err.count(PREFIX) == 1, err
    return lines[-1][len(PREFIX):]


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


# ---- paths that escape ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt")
    run(setup_run(tmp, train={"steps": 1}))
    return tmp / "run" / "checkpoints" / "step-1"


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["tokenizer/../../../escaped.json", "/etc/escaped.json", "tokenizer/./../x.json",
                                  "tokenizer\\..\\..\\x.json", ""])
def test_manifest_entry_outside_the_checkpoint_is_refused(tmp_path, checkpoint, name):
    """A manifest names files inside its checkpoint; an entry that leaves it (.., absolute, backslashes, empty) is
    refused when the manifest is read, so neither export nor resume ever reads or writes through it."""
    ckpt = _copy_checkpoint(checkpoint, tmp_path / "a" / "b" / "step-1")
    target = (ckpt / name) if name and not name.startswith("/") else None
    payload = b'{"x": 1}'
    if target is not None and "\\" not in name:
        target.resolve().parent.mkdir(parents=True, exist_ok=True)
        target.resolve().write_bytes(payload)
    m = json.loads((ckpt / "manifest.json").read_text())
    m["files"][name] = {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    (ckpt / "manifest.json").write_text(json.dumps(m))
    before = files_under(tmp_path)
    with pytest.raises(MegatrainError) as e:
        read_manifest(ckpt)
    assert str(e.value).startswith(f"{ckpt / 'manifest.json'}: ") and "\n" not in str(e.value)
    assert "outside" in str(e.value) or "not a relative path" in str(e.value), str(e.value)
    with pytest.raises(MegatrainError):
        export_checkpoint(ckpt, tmp_path / "a" / "out")
    assert files_under(tmp_path) == before


def test_manifest_unit_file_outside_the_checkpoint_is_refused(tmp_path, checkpoint):
    ckpt = _copy_checkpoint(checkpoint, tmp_path / "step-1")
    m = json.loads((ckpt / "manifest.json").read_text())
    m["units"][0]["file"] = "../" + m["units"][0]["file"]
    (ckpt / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(MegatrainError, match="outside"):
        read_manifest(ckpt)


@pytest.mark.parametrize("file_name", ["../secret.jsonl", "/tmp/secret.jsonl", "sub/../../secret.jsonl"])
def test_dataset_info_file_name_outside_its_folder_is_refused(setup, file_name):
    tmp_path, model_dir, data = setup
    reg = tmp_path / "reg"
    reg.mkdir()
    (tmp_path / "secret.jsonl").write_text(json.dumps({"instruction": "a", "output": "b"}) + "\n")
    (reg / "dataset_info.json").write_text(json.dumps({"d": {"file_name": file_name}}))
    cfg = write_config(tmp_path, model_dir, data)
    raw = yaml.safe_load(cfg.read_text())
    raw["data"] = {"dataset_info": str(reg), "datasets": [{"name": "d"}], "max_seq_len": 32,
                   "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}
    cfg.write_text(yaml.safe_dump(raw))
    msg = error_of(tmp_path, cfg)
    assert msg.startswith(f"{reg / 'dataset_info.json'}: dataset 'd': file_name: '{file_name}'"), msg
    assert "outside" in msg or "not a relative path" in msg, msg


# ---- no custom code ---------------------------------------------------------------------------------------------
def test_tokenizer_and_config_are_opened_without_remote_code(setup, monkeypatch):
    """Every from_pretrained megatrain calls passes trust_remote_code=False: on a terminal transformers would
    otherwise ask, and a "y" would run the folder's Python."""
    import transformers

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoConfig):
        real = cls.from_pretrained.__func__

        def spy(klass, *a, _real=real, _name=cls.__name__, **kw):
            seen.append((_name, kw.get("trust_remote_code", "unset")))
            return _real(klass, *a, **kw)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    tmp_path, model_dir, data = setup
    from megatrain.data import load_tokenizer
    from megatrain.models import load_hf_config

    load_tokenizer(model_dir)
    load_hf_config(model_dir)
    assert {n for n, _ in seen} == {"AutoTokenizer", "AutoConfig"}
    assert all(v is False for _, v in seen), seen


def test_a_folder_asking_for_custom_code_never_runs_it(setup, capsys):
    """tokenizer_config.json's auto_map names a class in the folder's own Python file: it is never imported, and
    the run says that the folder asked for it."""
    tmp_path, model_dir, data = setup
    marker = tmp_path / "code-ran"
    (model_dir / "evil_tokenizer.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n"
                                                 "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    tc["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    tc["tokenizer_class"] = "EvilTokenizer"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tc))
    from megatrain.data import load_tokenizer

    with pytest.raises(MegatrainError) as e:
        load_tokenizer(model_dir)
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and str(model_dir) in msg and "custom code" in msg, msg


# ---- a library's error on a user's file: one line naming the file -------------------------------------------------
def test_truncated_safetensors_shard(setup, capsys):
    tmp_path, model_dir, data = setup
    from safetensors.torch import load_file, save_file

    single = model_dir / "model.safetensors"
    tensors = load_file(single)
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in shards.items():
        save_file({n: tensors[n].contiguous() for n in ns}, model_dir / f, metadata={"format": "pt"})
    single.unlink()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}))
    shard = model_dir / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])  # an interrupted download
    cfg = write_config(tmp_path, model_dir, data)
    msg = one_line_error(capsys, ["train", str(cfg)])
    assert msg.startswith(f"{shard}: ") and "truncated" in msg, msg
    assert not (tmp_path / "out").exists()


def test_model_type_given_as_a_list(setup, capsys):
    tmp_path, model_dir, data = setup
    c = json.loads((model_dir / "config.json").read_text())
    c["model_type"] = ["llama"]
    (model_dir / "config.json").write_text(json.dumps(c))
    msg = one_line_error(capsys, ["train", str(write_config(tmp_path, model_dir, data))])
    assert msg.startswith(f"{model_dir / 'config.json'}: model_type") and "string" in msg, msg


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_export_max_shard_mb_must_be_a_positive_number(tmp_path, checkpoint, capsys, value):
    msg = one_line_error(capsys, ["export", str(checkpoint), str(tmp_path / "o"), "--max-shard-mb", value])
    assert "--max-shard-mb" in msg, msg
    assert not (tmp_path / "o").exists()


# ---- late or wrong errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("betas", [[0.9, 1.0], [1.5, 0.999], [-0.1, 0.999], [0.9, 1.2]])
def test_adam_betas_outside_zero_one(setup, betas):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data, betas=betas)
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert "train.betas" in str(e.value) and "[0, 1)" in str(e.value), str(e.value)


def test_home_in_every_path_is_expanded_once(setup, monkeypatch):
    """`~` means the user's home wherever a path is read or written: the config holds the expanded path, so no
    folder named `~` appears in the working directory."""
    tmp_path, model_dir, data = setup
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write_config(tmp_path, model_dir, data),
                      ["output.dir=~/runs/a", "export.dir=~/exp", "resume=~/old", "plan.profile=~/p.json"])
    assert cfg.output.dir == str(home / "runs" / "a")
    assert cfg.export.dir == str(home / "exp")
    assert cfg.resume == str(home / "old")
    assert cfg.plan.profile == str(home / "p.json")
    cfg = load_config(write_config(tmp_path, model_dir, data), ["model.path=~/m", "data.path=~/d.jsonl"])
    assert cfg.model.path == str(home / "m")


# ---- data dropped silently --------------------------------------------------------------------------------------
def test_compressed_file_in_a_data_folder_is_named(setup):
    tmp_path, model_dir, data = setup
    import gzip

    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text(data.read_text())
    with gzip.open(folder / "b.jsonl.gz", "wt") as f:
        f.write(data.read_text())
    cfg = write_config(tmp_path, model_dir, folder)
    msg = error_of(tmp_path, cfg)
    assert str(folder / "b.jsonl.gz") in msg and "compressed" in msg, msg


# ---- resource bounds before work ----------------------------------------------------------------------------------
def test_yaml_alias_bomb_is_refused_quickly(tmp_path):
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for k in range(1, 12):
        lines.append(f"{chr(97 + k)}: &{chr(97 + k)} [" + ", ".join([f"*{chr(96 + k)}"] * 10) + "]")
    lines.append("model: {path: m}")
    p = tmp_path / "bomb.yaml"
    p.write_text("\n".join(lines) + "\n")
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30)); "
            "from megatrain.cli import main; sys.exit(main(['plan', sys.argv[1]]))")
    r = subprocess.run([sys.executable, "-c", code, str(p)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"{PREFIX}{p}: ") and "alias" in last, last


# ---- inputs and outputs never overlap ---------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["export_is_model", "export_in_model", "output_is_model", "output_in_model",
                                  "output_holds_model", "export_is_data", "export_in_checkpoints",
                                  "tokenizer_is_export"])
def test_outputs_never_overlap_inputs(setup, case):
    """An output folder that is, holds, or lies inside an input (the model, its tokenizer, the data) would
    replace what the run reads: `export.at_end` with export.dir = model.path deleted the input model's other
    files. Each pair is refused before anything is written, naming both keys."""
    tmp_path, model_dir, data = setup
    extra = {"export_is_model": ["export.at_end=true", f"export.dir={model_dir}"],
             "export_in_model": ["export.at_end=true", f"export.dir={model_dir / 'hf'}"],
             "output_is_model": [f"output.dir={model_dir}", "output.overwrite=true"],
             "output_in_model": [f"output.dir={model_dir / 'run'}"],
             "output_holds_model": [f"output.dir={tmp_path}", "output.overwrite=true"],
             "export_is_data": ["export.at_end=true", f"export.dir={data}"],
             "export_in_checkpoints": ["export.at_end=true", f"export.dir={tmp_path / 'out' / 'checkpoints' / 'x'}"],
             "tokenizer_is_export": ["export.at_end=true", f"export.dir={tmp_path / 'tok'}",
                                     f"model.tokenizer={tmp_path / 'tok'}"]}[case]
    if case == "tokenizer_is_export":
        import shutil

        shutil.copytree(model_dir, tmp_path / "tok")
    cfg = write_config(tmp_path, model_dir, data)
    before = files_under(tmp_path)
    msg = error_of(tmp_path, cfg, *extra)
    assert "\n" not in msg and ("overlap" in msg or "inside" in msg or "checkpoints" in msg), msg
    assert files_under(tmp_path) == before


def test_cli_export_into_its_own_checkpoint_is_refused(tmp_path, checkpoint, capsys):
    ckpt = _copy_checkpoint(checkpoint, tmp_path / "run" / "checkpoints" / "step-1")
    before = files_under(tmp_path)
    for out in (ckpt, ckpt / "hf", tmp_path / "run" / "checkpoints" / "hf"):
        msg = one_line_error(capsys, ["export", str(ckpt), str(out)])
        assert "checkpoint" in msg, msg
    assert files_under(tmp_path) == before


def _all_actions():
    import argparse

    from megatrain.cli import _parser
    from megatrain.planner import probe

    def walk(p):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sp in a.choices.values():
                    yield from walk(sp)
            else:
                yield p.prog, a

    yield from walk(_parser())
    yield from walk(probe.parser())


def test_every_numeric_option_is_range_checked():
    """The class behind `--max-shard-mb nan`: a bare int/float option accepts nan, inf, 0 and negatives, which fail
    later with a traceback. Every numeric option of every subcommand uses a checked type."""
    bare = [f"{prog} {'/'.join(a.option_strings)}" for prog, a in _all_actions() if a.type in (int, float)]
    assert not bare, bare


# ---- one run per output.dir -------------------------------------------------------------------------------------
def test_a_second_run_on_a_locked_output_dir_is_refused(tmp_path):
    """Two runs on one output.dir both exited 0 and one's checkpoints disappeared. The output.dir lock refuses the
    second with the holder named, before it writes anything; once the holder ends, the folder is free."""
    from megatrain.checkpoint.folder_lock import FolderLock

    cfg = setup_run(tmp_path, train={"steps": 1}, resume="auto")
    out = tmp_path / "run"
    code = ("import sys, time; from megatrain.checkpoint.folder_lock import FolderLock; "
            "FolderLock(sys.argv[1], 'output.dir').acquire(); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    try:
        assert holder.stdout.readline().strip() == "held"
        before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
        with pytest.raises(MegatrainError) as e:
            run(cfg)
        assert str(e.value).startswith(f"output.dir: {out} is in use by another run (pid {holder.pid} on ")
        assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    finally:
        holder.kill()
        holder.wait()
    run(cfg)  # the holder died (as kill -9 would leave it): its lock went with it
    with FolderLock(out, "output.dir"):  # and the finished run released its own
        pass


def test_export_with_leftovers_beside_its_target(tmp_path, checkpoint, capsys):
    """A killed export leaves `.NAME.partial` (its lock file in it, no longer held): the next export removes it. A
    *file* of that name is not ours and is named, not replaced; an export still writing there (its lock held) is
    refused."""
    from megatrain.checkpoint.folder_lock import FolderLock

    out = tmp_path / "hf"
    partial = tmp_path / ".hf.partial"
    partial.write_text("someone's notes")
    msg = one_line_error(capsys, ["export", str(checkpoint), str(out)])
    assert msg.startswith(f"export: {partial} is in the way"), msg
    assert partial.read_text() == "someone's notes" and not out.exists()
    partial.unlink()
    partial.mkdir()
    (partial / "model-00001-of-00009.safetensors").write_bytes(b"x")  # a killed export's shard
    with FolderLock(partial, "export"):
        msg = one_line_error(capsys, ["export", str(checkpoint), str(out)])
        assert msg.startswith(f"export: another export is writing {out} (pid {os.getpid()} on "), msg
    assert main(["export", str(checkpoint), str(out)]) == 0  # the killed export's folder: its lock file, not held
    assert not partial.exists() and (out / "config.json").is_file()
    assert not any(p.name.startswith(".") for p in out.iterdir())


# ---- resume=auto never turns a non-empty folder into a fresh start that replaces it --------------------------------
def test_resume_auto_in_a_model_folder_is_refused(setup):
    """resume=auto used to switch the "output.dir is not empty" guard off even with no checkpoint to resume: a run
    started in a model's folder then wrote its config.json over the model's."""
    tmp_path, model_dir, data = setup
    out = tmp_path / "elsewhere"
    out.mkdir()
    (out / "config.json").write_text((model_dir / "config.json").read_text())
    (out / "notes.txt").write_text("mine")
    cfg = write_config(tmp_path, model_dir, data)
    before = {p: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(MegatrainError) as e:
        from megatrain.run.trainer import prepare

        prepare(load_config(cfg, [f"output.dir={out}", "resume=auto"]))
    assert str(e.value).startswith(f"output.dir: {out} holds config.json, which a megatrain run does not write")
    assert {p: p.read_bytes() for p in out.iterdir()} == before


def test_resume_auto_with_every_checkpoint_gone_keeps_the_metrics(tmp_path):
    """With every checkpoint's manifest deleted, resume=auto found nothing and started over, wiping metrics.jsonl.
    It is refused, naming the checkpoints that would be lost; output.overwrite=true starts over on purpose. (A run
    killed before its first save has no checkpoint folder: resume=auto starts it over, test_resume.)"""
    cfg = setup_run(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "keep": 0}, resume="auto")
    run(cfg)
    out = tmp_path / "run"
    for m in out.glob("checkpoints/step-*/manifest.json"):
        m.unlink()
    metrics = (out / "metrics.jsonl").read_bytes()
    with pytest.raises(MegatrainError) as e:
        run(cfg)
    assert str(e.value).startswith(f"output.dir: {out / 'checkpoints'} holds step-1, step-2 but no complete ")
    assert (out / "metrics.jsonl").read_bytes() == metrics
    run(cfg, "output.overwrite=true")


def test_the_same_command_again_after_a_run_that_trained_nothing(tmp_path):
    """A run stopped before step 1 (a signal at start-up, a reward failing at the first rollout) leaves its config,
    plan and metrics (the step-0 evaluation): the identical command starts it again, as nothing can be lost. A
    folder whose run trained a step is still refused."""
    cfg = setup_run(tmp_path, train={"steps": 2})
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / "plan.json").write_text("{}")
    (out / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval_loss": 3.0}) + "\n")
    (out / "checkpoints").mkdir()
    run(cfg)
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2]
    with pytest.raises(MegatrainError, match="is not empty"):
        run(cfg)
