"""What a run writes stays where it belongs and what it saved stays usable:

- a checkpoint holds the model's config files as they were at start-up, whatever happens to model.path during the
  run (an edited config.json made later checkpoints neither resumable nor exportable);
- the run's own files in output.dir (the lock, config.json, plan.json, metrics.jsonl) are never written through a
  symbolic link (a link to a file elsewhere had that file truncated and overwritten); checkpoints/ may be a link;
- a checkpoints folder that cannot be written is refused before training, and a save that fails on the filesystem
  (permissions, a read-only filesystem, a full disk) is one line naming the folder, the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

from conftest import make_model_dir
from test_checkpoint_helpers import records, run, setup_run
from megatrain.checkpoint import CheckpointSaver, verify_checkpoint
from megatrain.checkpoint.folder_lock import LOCK_FILE, FolderLock, check_run_files, open_own, write_own
from megatrain.checkpoint.state import model_files_writer
from megatrain.cli import main
from megatrain.errors import MegatrainError
from megatrain.models import get_adapter, load_hf_config
from megatrain.run.metrics import MetricsLogger
from megatrain.runtime.store import HostStore

PREFIX = "megatrain: error: "
ROOT = os.geteuid() == 0  # root writes through 0o555: the permission tests that rely on it are skipped


def one_line_error(capsys, argv) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and err.count(PREFIX) == 1, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(PREFIX), err
    return line[len(PREFIX):]


def state(n: int) -> dict:
    return {"step": n, "loader": {}, "rng": {}, "config": {}}


def small_store(model_dir) -> HostStore:
    return HostStore(get_adapter(load_hf_config(model_dir)), torch.bfloat16)


def tree(folder) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---- A: a checkpoint's config files are the ones read at start-up ----------------------------------------------
def test_the_writer_keeps_the_config_bytes_read_when_made(tmp_path):
    model = tmp_path / "model"
    make_model_dir(model, "llama")
    (model / "generation_config.json").write_text('{"bos_token_id": 1}\n')
    original = {n: (model / n).read_bytes() for n in ("config.json", "generation_config.json")}
    write = model_files_writer(model, None)
    cfg = json.loads(original["config.json"])
    (model / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 5}))
    (model / "generation_config.json").write_text("{}")
    (tmp_path / "a").mkdir()
    write(tmp_path / "a")
    shutil.rmtree(model)
    (tmp_path / "b").mkdir()
    write(tmp_path / "b")  # the model folder gone: the save still writes them
    for d in ("a", "b"):
        assert {n: (tmp_path / d / n).read_bytes() for n in original} == original


def test_a_model_without_a_readable_config_is_one_line(tmp_path):
    with pytest.raises(MegatrainError) as e:
        model_files_writer(tmp_path / "gone", None)
    assert str(e.value).startswith(f"model.path: cannot read {tmp_path / 'gone' / 'config.json'}: ")


def test_a_run_whose_model_folder_changes_keeps_resumable_checkpoints(tmp_path, monkeypatch):
    """config.json edited after step 1 and removed after step 2: steps 2 and 3 still record the original, verify and
    resume."""
    cfg = setup_run(tmp_path, train={"steps": 3}, checkpoint={"every": 1, "keep": 0})
    model = tmp_path / "model"
    original = (model / "config.json").read_bytes()
    step_done = CheckpointSaver.step_done

    def meddle(self, step, *a, **kw):
        started = step_done(self, step, *a, **kw)
        if step == 1:
            edited = {**json.loads(original), "num_hidden_layers": 5}
            (model / "config.json").write_text(json.dumps(edited))
        elif step == 2:
            (model / "config.json").unlink()
        return started

    monkeypatch.setattr(CheckpointSaver, "step_done", meddle)
    run(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    for n in (1, 2, 3):
        verify_checkpoint(ckpts / f"step-{n}")
        assert (ckpts / f"step-{n}" / "config.json").read_bytes() == original
    monkeypatch.undo()
    (model / "config.json").write_bytes(original)  # resume reads the model's config: it must equal the checkpoint's
    summary = run(cfg, "resume=auto", "train.steps=4")
    assert summary["checkpoint"].endswith("step-4")


# ---- B: the run's own files are never written through a symbolic link ------------------------------------------
@pytest.mark.parametrize("name", [LOCK_FILE, "config.json", "plan.json", "metrics.jsonl"])
def test_a_run_file_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, capsys, name):
    cfg = setup_run(tmp_path, train={"steps": 1})
    out = tmp_path / "run"
    out.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("someone's file\n")
    (out / name).symlink_to(outside)
    msg = one_line_error(capsys, ["train", str(cfg), "output.overwrite=true"])
    assert msg == f"output.dir: {out / name} is a symbolic link; megatrain writes its own file there: remove the link"
    assert outside.read_text() == "someone's file\n"
    assert sorted(p.name for p in out.iterdir()) == [name]  # nothing else written either


def test_a_dangling_link_creates_nothing_elsewhere(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(tmp_path / "elsewhere" / "m.jsonl")
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(MegatrainError, match="metrics.jsonl is a symbolic link"):
        check_run_files(out)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_link_made_after_the_check_is_still_not_followed(tmp_path):
    """The writers themselves open with O_NOFOLLOW: the lock, config.json and plan.json, metrics.jsonl."""
    out = tmp_path / "run"
    out.mkdir()
    outside = tmp_path / "precious.txt"
    outside.write_text("keep\n")
    for name in (LOCK_FILE, "config.json", "metrics.jsonl"):
        (out / name).symlink_to(outside)
    with pytest.raises(MegatrainError, match=r"\.megatrain\.lock is a symbolic link"):
        FolderLock(out, "output.dir").acquire()
    with pytest.raises(MegatrainError, match=r"config\.json is a symbolic link"):
        write_own(out / "config.json", "{}")
    with pytest.raises(MegatrainError, match=r"metrics\.jsonl is a symbolic link"):
        MetricsLogger(out, 3)
    assert outside.read_text() == "keep\n"


def test_the_run_files_are_written_and_appended_as_before(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    write_own(out / "plan.json", "a long first version")
    write_own(out / "plan.json", "{}")
    assert (out / "plan.json").read_text() == "{}"  # replaced, not overwritten in place
    for i in range(2):
        log = MetricsLogger(out, 3)
        log.log({"step": i, "eval_loss": 1.0})
        log.close()
    assert [r["step"] for r in records(out)] == [0, 1]
    fd = open_own(out / "x", os.O_WRONLY | os.O_CREAT)
    os.close(fd)


def test_a_folder_in_place_of_a_run_file_is_named(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(MegatrainError) as e:
        check_run_files(tmp_path)
    assert str(e.value) == (f"output.dir: {tmp_path / 'config.json'} is not a file; megatrain writes its own file "
                            f"there: move it away")


def test_checkpoints_may_be_a_link_to_another_disk(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 2}, checkpoint={"every": 1, "keep": 1}, resume="auto")
    other = tmp_path / "other-disk"
    other.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(other)
    run(cfg)
    assert sorted(p.name for p in other.iterdir()) == ["step-2"]
    verify_checkpoint(other / "step-2")


# ---- C: a checkpoints folder that cannot be written ------------------------------------------------------------
def refuse_mkdir_under(monkeypatch, folder, error=PermissionError(13, "Permission denied")):
    """os.mkdir and Path.mkdir fail under `folder`, as in a folder without write permission (or chattr +i)."""
    real_mkdir = os.mkdir

    def mkdir(path, *a, **kw):
        if pathlib.Path(path).parent == folder:
            raise type(error)(error.errno, error.strerror, str(path))
        return real_mkdir(path, *a, **kw)

    monkeypatch.setattr(os, "mkdir", mkdir)


def test_an_unwritable_checkpoints_folder_is_refused_before_training(tmp_path, monkeypatch):
    cfg = setup_run(tmp_path, train={"steps": 2}, checkpoint={"every": 2})
    run(cfg)
    out, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    before = tree(out)
    refuse_mkdir_under(monkeypatch, ckpts)
    with pytest.raises(MegatrainError) as e:
        run(cfg, "resume=auto", "train.steps=4")
    assert str(e.value) == (f"output.dir: {ckpts} cannot be written (Permission denied); the run saves its "
                            f"checkpoints there: make it writable or choose another output.dir")
    assert tree(out) == before  # no step trained, nothing written


@pytest.mark.skipif(ROOT, reason="root writes into a 0o555 folder")
def test_a_read_only_checkpoints_folder_is_refused(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    os.chmod(tmp_path / "checkpoints", 0o555)
    try:
        with pytest.raises(MegatrainError, match=r"checkpoints cannot be written \(Permission denied\)"):
            check_run_files(tmp_path)
    finally:
        os.chmod(tmp_path / "checkpoints", 0o755)


def test_an_immutable_checkpoints_folder_is_refused(tmp_path):
    """chattr +i, as the red team did (root only, where the filesystem has the flag)."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    if not (ROOT and shutil.which("chattr")) or subprocess.run(["chattr", "+i", str(ckpts)],
                                                               capture_output=True).returncode:
        pytest.skip("chattr +i needs root and a filesystem with the flag")
    try:
        with pytest.raises(MegatrainError, match=r"checkpoints cannot be written \(Operation not permitted\)"):
            check_run_files(tmp_path)
    finally:
        subprocess.run(["chattr", "-i", str(ckpts)], check=True)
    assert list(ckpts.iterdir()) == []


def test_a_dangling_checkpoints_link_is_refused(tmp_path):
    (tmp_path / "checkpoints").symlink_to(tmp_path / "unmounted")
    with pytest.raises(MegatrainError, match=r"checkpoints cannot be written \(No such file or directory\)"):
        check_run_files(tmp_path)


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), OSError(30, "Read-only file system")],
                         ids=["permission", "read-only"])
def test_a_save_that_cannot_create_its_folder_is_one_line(tmp_path, monkeypatch, error):
    make_model_dir(tmp_path / "model", "llama", seed=1)
    store = small_store(tmp_path / "model")
    root = tmp_path / "ckpt"
    saver = CheckpointSaver(root, store)
    saver.save(1, state(1))
    first = saver.wait()
    before = tree(first)
    refuse_mkdir_under(monkeypatch, root, error)
    with pytest.raises(MegatrainError) as e:
        saver.save(2, state(2))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint: saving step 2 to {root / 'step-2'} failed: ")
    assert error.strerror in msg and str(root / ".step-2.tmp") in msg
    assert sorted(p.name for p in root.iterdir()) == ["step-1"] and tree(first) == before
    verify_checkpoint(first)


def test_a_save_whose_small_files_fail_leaves_no_tmp(tmp_path):
    make_model_dir(tmp_path / "model", "llama", seed=1)
    root = tmp_path / "ckpt"
    saver = CheckpointSaver(root, small_store(tmp_path / "model"))

    def no_space(dest):
        raise OSError(28, "No space left on device")

    with pytest.raises(MegatrainError, match=r"saving step 3 to .*step-3 failed: OSError: .*No space left"):
        saver.save(3, state(3), no_space)
    assert list(root.iterdir()) == []


def test_a_save_failing_after_training_is_one_line_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys):
    """The red team's case (chattr +i on checkpoints/ once the run has started): steps 3 and 4 train, the save of
    step 4 cannot create its folder; one line, exit 2, step-2 as it was."""
    cfg = setup_run(tmp_path, train={"steps": 2}, checkpoint={"every": 2})
    run(cfg)
    ckpts = tmp_path / "run" / "checkpoints"
    before = tree(ckpts / "step-2")
    real_mkdir = pathlib.Path.mkdir

    def mkdir(self, *a, **kw):  # only the save's own folder: the check before training passes
        if self.parent == ckpts and self.name.startswith(".step-4"):
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    msg = one_line_error(capsys, ["train", str(cfg), "resume=auto", "train.steps=4"])
    assert msg.startswith(f"checkpoint: saving step 4 to {ckpts / 'step-4'} failed: PermissionError: ")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-2"] and tree(ckpts / "step-2") == before
    assert max(r["step"] for r in records(tmp_path / "run")) == 4  # it did train, and says so


def test_an_older_checkpoint_that_cannot_be_removed_is_not_called_a_failed_save(tmp_path, monkeypatch):
    make_model_dir(tmp_path / "model", "llama", seed=1)
    root = tmp_path / "ckpt"
    saver = CheckpointSaver(root, small_store(tmp_path / "model"), keep=1)
    saver.save(1, state(1))
    saver.wait()
    real_rename = os.rename

    def rename(src, dst, *a, **kw):  # step-1's folder cannot be moved away (chattr +i on it)
        if str(dst).endswith(".deleting"):
            raise PermissionError(1, "Operation not permitted", str(src))
        return real_rename(src, dst, *a, **kw)

    monkeypatch.setattr(os, "rename", rename)
    saver.save(2, state(2))
    with pytest.raises(MegatrainError) as e:
        saver.wait()
    assert str(e.value) == (f"checkpoint: step 2 is saved in {root / 'step-2'}, but an older checkpoint could not be "
                            f"removed (Operation not permitted: {root / 'step-1'}); remove it, then resume=auto "
                            f"continues from step 2")
    verify_checkpoint(root / "step-2")
    verify_checkpoint(root / "step-1")
