"""What a run or an export may write over: export.at_end replaces only its own run's earlier export, `resume: PATH`
writes into output.dir only where nothing is lost, export.dir and data.cache_dir never hold or sit in what the run
owns or reads, and paths the system would refuse later (no such home, a loop of links, a name too long, a full
disk) are one line naming them. Found by a red-team pass; each case lost data or ended in a traceback before."""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from megatrain.checkpoint.export import INDEX, check_export_target, export_checkpoint
from megatrain.errors import MegatrainError
from test_checkpoint_helpers import run, setup_run


def error(cfg, *overrides) -> str:
    with pytest.raises(MegatrainError) as e:
        run(cfg, *overrides)
    return str(e.value)


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished run (steps 1-2 saved) with its export, shared by the tests that only read it."""
    tmp = tmp_path_factory.mktemp("trained")
    cfg = setup_run(tmp, train={"steps": 2}, checkpoint={"every": 1, "keep": 0}, export={"at_end": True})
    run(cfg)
    return tmp, cfg


# ---- export.at_end replaces only this run's own export ------------------------------------------------------------
def test_export_at_end_refuses_a_model_folder_and_another_runs_export(trained, tmp_path):
    tmp, cfg = trained
    hf = tmp_path / "hfmodel"  # a sharded Hugging Face model: it has the export's index file
    shutil.copytree(tmp / "run" / "export", hf)
    meta = json.loads((hf / INDEX).read_text())
    del meta["metadata"]["megatrain_checkpoint"]
    (hf / INDEX).write_text(json.dumps(meta))
    other = tmp_path / "other"  # another run's export
    shutil.copytree(tmp / "run" / "export", other)
    for folder in (hf, other):
        before = snapshot(folder)
        msg = error(cfg, f"output.dir={tmp_path / 'fresh'}", "export.at_end=true", f"export.dir={folder}")
        assert msg == f"export: {folder} is not empty; choose another directory"
        assert snapshot(folder) == before and not (tmp_path / "fresh").exists()


def test_export_at_end_of_a_resumed_run_replaces_its_export_but_not_a_users_file(trained, tmp_path):
    tmp, cfg = trained
    out = tmp_path / "run"  # the run's folder moved: its export names checkpoints where they were
    shutil.copytree(tmp / "run", out)
    (out / "export" / "README.md").write_text("my notes")
    assert error(cfg, f"output.dir={out}", "resume=auto", "train.steps=3") == \
        f"export: {out / 'export'} is not empty; choose another directory"
    (out / "export" / "README.md").unlink()
    summary = run(cfg, f"output.dir={out}", "resume=auto", "train.steps=3")
    meta = json.loads((out / "export" / INDEX).read_text())["metadata"]
    assert summary["export"] == str(out / "export") and meta["step"] == 3
    assert sorted(p.name for p in (out / "export").iterdir()) == meta["megatrain_files"]


def test_export_dir_may_not_hold_output_dir(trained, tmp_path):
    _, cfg = trained
    out = tmp_path / "a" / "run"
    for export in (out, tmp_path / "a"):
        msg = error(cfg, f"output.dir={out}", "export.at_end=true", f"export.dir={export}")
        assert msg.startswith(f"export.dir: {export} {'is' if export == out else 'holds'} output.dir ({out})"), msg
    assert not (tmp_path / "a").exists()


def test_export_into_a_link_writes_the_folder_it_points_to(trained, tmp_path):
    tmp, _ = trained
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    export_checkpoint(tmp / "run", tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real" / INDEX).is_file()


def test_a_users_folder_named_like_the_exports_partial_one_is_kept(trained, tmp_path):
    tmp, _ = trained
    mine = tmp_path / ".mine.partial"
    mine.mkdir()
    (mine / "data.txt").write_text("precious")
    with pytest.raises(MegatrainError, match=r"\.mine\.partial is in the way .* not an interrupted export's"):
        export_checkpoint(tmp / "run", tmp_path / "mine")
    assert (mine / "data.txt").read_text() == "precious" and not (tmp_path / "mine").exists()


def test_a_full_disk_during_an_export_is_one_line_and_leaves_nothing(trained, tmp_path, monkeypatch):
    tmp, _ = trained
    import megatrain.checkpoint.export as export

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export, "_write_configs", full)
    with pytest.raises(MegatrainError) as e:
        export_checkpoint(tmp / "run", tmp_path / "hf")
    assert str(e.value).startswith(f"export: writing {tmp_path / 'hf'} failed (No space left on device); nothing "
                                   f"was exported")
    assert list(tmp_path.iterdir()) == []


# ---- resume: PATH writes into output.dir only where nothing is lost ------------------------------------------------
def test_resume_from_a_path_refuses_a_foreign_folder_the_checkpoint_and_another_runs_checkpoints(trained, tmp_path):
    tmp, cfg = trained
    step2 = tmp / "run" / "checkpoints" / "step-2"
    folder = tmp_path / "notes"  # a folder of the user's
    folder.mkdir()
    (folder / "notes.txt").write_text("precious")
    msg = error(cfg, f"output.dir={folder}", f"resume={step2}", "train.steps=3")
    assert msg.startswith(f"output.dir: {folder} holds notes.txt, which a megatrain run does not write"), msg

    copy = tmp_path / "copy"
    shutil.copytree(tmp / "run", copy)
    before = snapshot(copy)
    inner = copy / "checkpoints" / "step-2"
    for out in (inner, copy / "checkpoints"):
        msg = error(cfg, f"output.dir={out}", f"resume={inner}", "train.steps=3")
        assert msg.startswith(f"output.dir: {out} is the checkpoint"), msg

    other = tmp_path / "other"  # another run's output.dir, its own checkpoints in it
    shutil.copytree(tmp / "run", other)
    msg = error(cfg, f"output.dir={other}", f"resume={inner}", "train.steps=3")
    assert msg.startswith(f"output.dir: {other} holds checkpoints of its own run (step-2), not {inner}'s"), msg
    assert snapshot(copy) == before and (folder / "notes.txt").read_text() == "precious"


def test_resume_from_a_path_into_an_empty_output_dir_trains(trained, tmp_path):
    tmp, cfg = trained
    out = tmp_path / "new"
    run(cfg, f"output.dir={out}", f"resume={tmp / 'run' / 'checkpoints' / 'step-1'}", "train.steps=2",
        "export.at_end=false")
    assert (out / "checkpoints" / "step-2" / "manifest.json").is_file()


# ---- data.cache_dir and paths the system would refuse --------------------------------------------------------------
def test_cache_dir_is_a_folder_outside_what_the_run_writes(trained, tmp_path):
    tmp, cfg = trained
    (tmp_path / "afile").write_text("x")
    assert error(cfg, f"output.dir={tmp_path / 'o'}", f"data.cache_dir={tmp_path / 'afile'}").startswith(
        f"data.cache_dir: {tmp_path / 'afile'} is a file")
    msg = error(cfg, f"output.dir={tmp_path / 'o'}", f"data.cache_dir={tmp_path / 'o' / 'cache'}")
    assert msg.startswith(f"data.cache_dir: {tmp_path / 'o' / 'cache'} lies inside output.dir"), msg
    assert not (tmp_path / "o").exists()


def test_paths_the_system_would_refuse_are_one_line(trained, tmp_path):
    tmp, cfg = trained
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    long = tmp_path / ("e" * 250)
    cases = [("output.dir=~no-such-user-here/x", "output.dir: ~no-such-user-here/x: there is no home folder for "
                                                 "'~no-such-user-here'"),
             (f"model.path={tmp_path / 'loopA'}", f"model.path: {tmp_path / 'loopA'}: its symbolic links form a loop"),
             (f"output.dir={tmp_path / 'loopA'}", f"output.dir: {tmp_path / 'loopA'}: its symbolic links form a loop"),
             (f"output.dir={long}", f"output.dir: {long}: the name 'eeeeeeeeeeeeeeeeeeeeeeee...' is 250 bytes long; "
                                    f"the file system takes at most 246 here")]
    for override, want in cases:
        assert error(cfg, override) == want
    for target, want in (("~no-such-user-here/x", "there is no home folder"), (long, "is 250 bytes long")):
        with pytest.raises(MegatrainError, match=want):
            check_export_target(target)


# ---- a checkpoint's own files: every key read is checked, the file named ------------------------------------------
def edited_checkpoint(trained, tmp_path, manifest=None, state=None, name="step-2"):
    """A copy of the trained run's step-2 as tmp_path/run/checkpoints/NAME, its manifest and run state edited
    (the run state's sha256 in the manifest updated, so the edit is read, not refused as a corrupted file)."""
    import hashlib

    tmp, _ = trained
    ckpt = tmp_path / "run" / "checkpoints" / name
    shutil.copytree(tmp / "run" / "checkpoints" / "step-2", ckpt)
    m = json.loads((ckpt / "manifest.json").read_text())
    if state is not None:
        s = json.loads((ckpt / "run_state.json").read_text())
        state(s)
        data = json.dumps(s).encode()
        (ckpt / "run_state.json").write_bytes(data)
        m["files"]["run_state.json"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    if manifest is not None:
        manifest(m)
    (ckpt / "manifest.json").write_text(json.dumps(m))
    return ckpt


UNIT = "unit-00001-layer0.safetensors"


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m["files"][UNIT].pop("bytes"), f"the entry of {UNIT} has no 'bytes' (a whole number)"),
    (lambda m: m["files"]["run_state.json"].pop("sha256"), "the entry of run_state.json has no 'sha256' (a string)"),
    (lambda m: m["files"][UNIT].update(chunk_bytes=0), f"the entry of {UNIT} has no 'chunk_bytes'"),
    (lambda m: m["files"][UNIT].update(sha256_chunks=None), f"the entry of {UNIT} does not list one sha256 per chunk"),
    (lambda m: m.pop("step"), "'step' is missing or not a whole number >= 0"),
    (lambda m: m.update(step=-5), "'step' is missing or not a whole number >= 0"),
])
def test_a_malformed_manifest_is_named(trained, tmp_path, edit, problem):
    ckpt = edited_checkpoint(trained, tmp_path, manifest=edit)
    _, cfg = trained
    for act in (lambda: run(cfg, f"output.dir={tmp_path / 'run'}", "resume=auto", "train.steps=3"),
                lambda: export_checkpoint(ckpt, tmp_path / "hf")):
        with pytest.raises(MegatrainError) as e:
            act()
        assert str(e.value).startswith(f"{ckpt / 'manifest.json'}: {problem}"), str(e.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("edit, problem", [
    (lambda s: s.update(step="abc"), "step 'abc', the manifest's is 2"),
    (lambda s: s.update(loader={}), "'loader' is not a run state's (it lacks epoch)"),
    (lambda s: s.update(loader=None), "'loader' is not a run state's (it lacks everything: not an object)"),
    (lambda s: s.update(rng={"python": 1}), "'rng' is not a run state's (it lacks torch)"),
    (lambda s: s.update(summary=[1]), "'summary' is not an object"),
])
def test_a_malformed_run_state_is_named_before_anything_is_written(trained, tmp_path, edit, problem):
    ckpt = edited_checkpoint(trained, tmp_path, state=edit)
    before = snapshot(tmp_path / "run")
    assert error(trained[1], f"output.dir={tmp_path / 'run'}", "resume=auto", "train.steps=3") == \
        f"{ckpt / 'run_state.json'}: {problem}"
    assert snapshot(tmp_path / "run") == before


def test_a_checkpoint_folder_named_for_another_step_is_refused(trained, tmp_path):
    ckpt = edited_checkpoint(trained, tmp_path, name="step-10")
    msg = error(trained[1], f"output.dir={tmp_path / 'run'}", "resume=auto", "train.steps=12")
    assert msg.startswith(f"{ckpt / 'manifest.json'}: the checkpoint of step 2 sits in a folder named step-10"), msg


def test_an_export_whose_checkpoint_a_running_run_removes_says_so(trained, tmp_path, monkeypatch):
    import megatrain.checkpoint.export as export
    from megatrain.checkpoint.folder_lock import FolderLock

    tmp, _ = trained
    run_dir = tmp_path / "run"
    shutil.copytree(tmp / "run", run_dir)
    ckpt = run_dir / "checkpoints" / "step-2"
    read = export.load_hf_config

    def pruned_meanwhile(path, *a, **kw):  # the run's save of step 3 removes step-2 while the export reads it
        shutil.rmtree(ckpt)
        return read(path, *a, **kw)

    monkeypatch.setattr(export, "load_hf_config", pruned_meanwhile)
    lock = FolderLock(run_dir, "train").acquire()
    try:
        with pytest.raises(MegatrainError) as e:
            export_checkpoint(run_dir, tmp_path / "hf")
    finally:
        lock.release()
    assert str(e.value).startswith(f"export: {ckpt} was removed while it was read, by the run that holds {run_dir} "
                                   f"(pid "), str(e.value)
    assert not (tmp_path / "hf").exists()


def test_a_full_disk_is_named_as_full_not_as_a_missing_o_direct(tmp_path, monkeypatch):
    import os

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    from megatrain.runtime.disk_tier import DiskTier

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(MegatrainError, match=rf"memory.disk_path {tmp_path}: the disk is full \(No space left on "
                                             rf"device\); make room on it"):
        DiskTier(tmp_path, ("exp_avg_sq",), [4096], 4096)
    assert list(tmp_path.iterdir()) == []


def test_small_sizes_in_the_plans_disk_lines_are_not_rounded_to_zero():
    from megatrain.planner.estimate import size_text

    assert (size_text(3 * 2**20), size_text(5 * 2**30)) == ("3.0 MiB", "5.0 GiB")


def test_a_checkpoint_resumes_only_under_the_objective_that_wrote_it(trained, tmp_path):
    ckpt = edited_checkpoint(trained, tmp_path, state=lambda s: s["config"]["train"].update(objective="dpo"))
    before = snapshot(tmp_path / "run")
    assert error(trained[1], f"output.dir={tmp_path / 'run'}", "resume=auto", "train.steps=3") == \
        f"train.objective: sft, but the checkpoint {ckpt} was written by a dpo run; resume it with train.objective: " \
        f"dpo, or start the sft run from its weights in another output.dir (model.path: an export of it)"
    assert snapshot(tmp_path / "run") == before


def test_a_resume_whose_checkpoint_a_running_run_removes_says_so(trained, tmp_path):
    import torch

    from megatrain.checkpoint.folder_lock import FolderLock
    from megatrain.checkpoint.resume import load_store, open_checkpoint
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime.store import HostStore

    tmp, _ = trained
    run_dir = tmp_path / "run"
    shutil.copytree(tmp / "run", run_dir)
    ckpt = run_dir / "checkpoints" / "step-2"
    r = open_checkpoint(ckpt)
    store = HostStore(get_adapter(load_hf_config(ckpt)), torch.float32)
    shutil.rmtree(ckpt)  # the other run's save of step 3 removed it after it was opened
    with FolderLock(run_dir, "train"):
        with pytest.raises(MegatrainError) as e:
            load_store(r, store)
    assert str(e.value).startswith(f"resume: {ckpt} was removed while it was read, by the run that holds {run_dir} "
                                   f"(pid "), str(e.value)
