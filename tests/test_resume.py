"""Resume is exact: a run interrupted after N steps and resumed gives the same losses and bit-identical final
parameters and Adam states as the run that was never interrupted; and resume refuses what it cannot continue."""

import json
import shutil

import pytest

from megatrain.config import load_config
from megatrain.errors import MegatrainError
from megatrain.run.trainer import prepare
from test_checkpoint_helpers import losses, records, run, setup_run, unit_hashes


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bit_exact_with_accumulation_and_packing(tmp_path, monkeypatch, precision):
    cfg = setup_run(tmp_path, train={"precision": precision}, checkpoint={"every": 3, "keep": 0})
    # Slow writer: step 4's optimizer catches up with the step-3 save; with the plan's staging pool (this host's
    # headroom) it copies the units not yet written instead of waiting for the writer.
    monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.03")
    monkeypatch.setenv("MEGATRAIN_SAVE_STATS", str(tmp_path / "saves.jsonl"))
    run(cfg)
    monkeypatch.delenv("MEGATRAIN_TEST_SAVE_DELAY_S")
    monkeypatch.delenv("MEGATRAIN_SAVE_STATS")
    saves = {r["step"]: r for r in map(json.loads, (tmp_path / "saves.jsonl").read_text().splitlines())}
    assert saves[3]["staging_limit_bytes"] > 0 and saves[3]["waits"] == 0  # staged, or written first
    full = tmp_path / "run"
    assert losses(full).keys() == set(range(1, 7))

    # The interrupted run: its output.dir as a crash after step 6 was logged but before step-6 was saved.
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "step-6")
    summary = run(cfg, f"output.dir={cut}", "resume=auto")
    assert losses(cut) == losses(full)  # every step once, the same floats
    assert unit_hashes(cut / "checkpoints" / "step-6") == unit_hashes(full / "checkpoints" / "step-6")
    assert summary["first_loss"] == losses(full)[1] and summary["last_loss"] == losses(full)[6]
    evals = [r["step"] for r in records(cut) if "loss" not in r]
    assert evals == sorted(set(evals))  # evaluation records not duplicated either

    if precision == "fp32":  # resume: PATH into a fresh output.dir
        other = tmp_path / "other"
        run(cfg, f"output.dir={other}", f"resume={full / 'checkpoints' / 'step-3'}")
        assert losses(other) == {s: v for s, v in losses(full).items() if s > 3}
        assert unit_hashes(other / "checkpoints" / "step-6") == unit_hashes(full / "checkpoints" / "step-6")


def test_keep_auto_and_continuing_past_the_end(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 4}, checkpoint={"every": 1, "keep": 2})
    first = run(cfg)
    ckpts = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert ckpts == ["step-3", "step-4"]  # the newest two, no temporary directories left
    assert first["checkpoint"].endswith("step-4")
    again = run(cfg, "resume=auto")  # already at train.steps: nothing to do
    assert "last_loss" not in again and len(losses(tmp_path / "run")) == 4
    (tmp_path / "model" / "model.safetensors").unlink()  # resume reads weights from the checkpoint only
    run(cfg, "resume=auto", "train.steps=6")  # a longer run continues from step 4
    assert sorted(losses(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 2})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # killed before its first save
    with pytest.raises(MegatrainError, match="resume=auto"):
        prepare(load_config(cfg))  # a non-empty output.dir needs resume (or overwrite)
    run(cfg, "resume=auto")
    assert sorted(losses(tmp_path / "run")) == [1, 2] and losses(tmp_path / "run")[1] != 9.0


def prepare_error(cfg, *overrides) -> str:
    with pytest.raises(MegatrainError) as e:
        prepare(load_config(cfg, list(overrides)))
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_resume_refuses_a_different_model(tmp_path):
    import json

    cfg = setup_run(tmp_path, train={"steps": 2})
    run(cfg)
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "model", changed)
    c = json.loads((changed / "config.json").read_text())
    c["rms_norm_eps"], c["intermediate_size"] = 1e-5, 128
    (changed / "config.json").write_text(json.dumps(c))
    msg = prepare_error(cfg, f"model.path={changed}", "resume=auto")
    assert "intermediate_size (checkpoint 160, now 128)" in msg and "rms_norm_eps" in msg
    assert str(changed / "config.json") in msg


def test_resume_detects_corrupted_and_truncated_files(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 2})
    run(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    unit = ckpt / "unit-00002-layer1.safetensors"
    data = bytearray(unit.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one weight
    unit.write_bytes(bytes(data))
    msg = prepare_error(cfg, "resume=auto")
    assert str(unit) in msg and "checksum mismatch" in msg
    unit.write_bytes(bytes(data[: len(data) // 3]))
    msg = prepare_error(cfg, "resume=auto")
    assert str(unit) in msg and "truncated" in msg
    state = ckpt / "run_state.json"
    state.write_text(state.read_text().replace('"step": 2', '"step": 1'))
    msg = prepare_error(cfg, f"resume={ckpt}")
    assert str(state) in msg


def test_resume_bad_paths(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 3}, checkpoint={"every": 1, "keep": 0})
    assert "resume: " in prepare_error(cfg, f"resume={tmp_path / 'nope'}")
    assert "does not exist" in prepare_error(cfg, f"resume={tmp_path / 'nope'}")
    assert "no complete checkpoint" in prepare_error(cfg, f"resume={tmp_path / 'model'}")
    run(cfg)
    # resuming an older checkpoint into the run that has newer ones: a later resume=auto would pick those
    msg = prepare_error(cfg, f"resume={tmp_path / 'run' / 'checkpoints' / 'step-1'}")
    assert "step-3" in msg and "newer" in msg
    (tmp_path / "run" / "checkpoints" / "step-3" / "manifest.json").unlink()
    assert "not a complete checkpoint" in prepare_error(cfg, f"resume={tmp_path / 'run' / 'checkpoints' / 'step-3'}")


def test_config_notes_name_real_changes_only():
    """The checkpoint's config went through JSON (tuples became lists): equal values are not reported as changed."""
    from megatrain.checkpoint.resume import Resumed, config_notes

    saved = {"train": {"betas": [0.9, 0.999], "steps": 40, "lr": 1e-3}, "data": {"paths": [["a", 1.0]]}}
    r = Resumed(path=None, step=5, state={"config": saved, "versions": {}}, manifest={"world": {"world_size": 1}})
    now = {"train": {"betas": (0.9, 0.999), "steps": 7, "lr": 1e-3}, "data": {"paths": [("a", 1.0)]}}
    assert config_notes(r, now) == ["train.steps: 40 -> 7"]
    now["train"]["betas"] = (0.9, 0.95)
    assert config_notes(r, now) == ["train.betas: [0.9, 0.999] -> (0.9, 0.95)", "train.steps: 40 -> 7"]


def test_a_final_evaluation_lost_with_the_run_is_made_on_resume(tmp_path):
    """The final checkpoint is written while the last evaluation runs: a run stopped during that evaluation has its
    last checkpoint and not the record. Resumed at its last step, it evaluates then (once, not again after)."""
    cfg = setup_run(tmp_path, train={"steps": 2, "eval_every": 1}, data={"eval_fraction": 0.25})
    run(cfg)
    out = tmp_path / "run"
    evals = lambda: [r for r in records(out) if "eval_loss" in r]  # noqa: E731
    last = evals()[-1]
    assert last["step"] == 2
    kept = [line for line in (out / "metrics.jsonl").read_text().splitlines() if json.loads(line) != last]
    (out / "metrics.jsonl").write_text("".join(x + "\n" for x in kept))  # stopped during it
    run(cfg, "resume=auto")
    assert evals()[-1] == {**last, "eval_loss": evals()[-1]["eval_loss"]} and [r["step"] for r in evals()] == [0, 1, 2]
    assert evals()[-1]["eval_loss"] == pytest.approx(last["eval_loss"], rel=0, abs=0)
    run(cfg, "resume=auto")
    assert [r["step"] for r in evals()] == [0, 1, 2]  # logged: not made again


def test_an_evaluation_cut_short_by_a_stop_is_made_on_resume(tmp_path):
    """A stop during the evaluation at step N cuts it short (not logged) and saves step N: the resumed run makes it,
    so its records equal the uninterrupted run's."""
    cfg = setup_run(tmp_path, train={"steps": 4, "eval_every": 2}, data={"eval_fraction": 0.25},
                    checkpoint={"every": 2, "keep": 0})
    run(cfg)
    whole = tmp_path / "run"
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    shutil.rmtree(cut / "checkpoints" / "step-4")
    kept = [r for r in records(cut) if r["step"] < 2 or (r["step"] == 2 and "loss" in r)]  # stopped during eval 2
    (cut / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    run(cfg, f"output.dir={cut}", "resume=auto")
    evals = lambda o: [r for r in records(o) if "eval_loss" in r]  # noqa: E731
    assert evals(cut) == evals(whole) and [r["step"] for r in evals(cut)] == [0, 2, 4]
