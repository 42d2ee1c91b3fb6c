"""Periodic saves with a staging pool (checkpoint/saver.py): before the optimizer updates a unit the writer has not
written, the unit's state is copied into host RAM and the update goes on, so with room the optimizer never waits on
the writer; without room (no headroom) it waits as before. Either way the files hold the state at the save step,
byte for byte a quiet save's files, while training goes on after the save; and a full disk leaves the previous
checkpoint. The plan reports the pool's bound and the save's predicted cost."""

import json
import threading

import pytest
import torch

from conftest import make_model_dir
from megatrain.checkpoint import CheckpointSaver, fastio
from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.errors import MegatrainError
from megatrain.planner.io_time import io_lines, io_times, staging_limit
from megatrain.runtime.store import HostStore
from reference import Megatrain, random_batches
from test_checkpoint import snapshot, state
from test_checkpoint_helpers import full_disk_after
from test_noclip import step_after_backward, step_without_clipping


def unit_bytes(store) -> list[int]:
    """What each unit takes of the pool: its master, m and v (fp32), 12 B/param as the plan counts a checkpoint
    (its 4-byte step is copied with them, outside the bound)."""
    return [12 * t.numel for t in store.tiles]


def train_through_a_save(tmp, monkeypatch, staging, clipping=True, seed=5):
    """Two steps, a slow save of step 2 while steps 3 and 4 run; returns (saver, path, the state at step 2, after).
    The writer's first write waits until the optimizer is about to update its first unit after the save (a hook
    that runs before the saver's), then the writer pauses after each unit: the optimizer always finds units not
    yet written, whatever the machine's pace."""
    make_model_dir(tmp / "model", "llama", seed=seed)
    m = Megatrain(tmp / "model", dtype=torch.bfloat16, threaded_optimizer=True)  # as on CUDA: a worker thread
    take = step_after_backward if clipping else step_without_clipping
    gate, original = threading.Event(), fastio.transfer
    gate.set()
    m.pipeline.add_before_update(lambda u: gate.set())

    def gated(*a, **kw):
        assert gate.wait(timeout=60)
        return original(*a, **kw)
    monkeypatch.setattr(fastio, "transfer", gated)
    saver = CheckpointSaver(tmp / "ckpt", m.store, m.pipeline, keep=0, staging_bytes=staging(m.store))
    try:
        for s in range(2):
            take(m, random_batches(2, 2, 97, [9, 12], seed=s), 1e-3)
            saver.step_done(s + 1, lambda: state(s + 1))
        m.pipeline.drain()
        at_save = snapshot(m.store)  # a copy of the state at the save step
        monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.05")  # the writer pauses after each unit
        gate.clear()
        saver.save(2, state(2))
        for s in range(2, 4):  # the optimizer reaches units the writer has not written
            take(m, random_batches(2, 2, 97, [9, 12], seed=s), 1e-3)
            saver.step_done(s + 1, lambda: state(s + 1))
        m.pipeline.drain()
        path = saver.wait()
    finally:
        m.close()
    return m, saver, path, at_save


def assert_holds(m, path, at_save, tmp):
    """The checkpoint equals the copy taken at the save step, tensors and files (a quiet save of that state)."""
    assert not torch.equal(m.store.master, at_save[0])  # training went on after the save
    fresh = HostStore(m.adapter, torch.bfloat16)
    load_store(open_checkpoint(path), fresh)
    for a, b in zip(snapshot(fresh), at_save):
        assert torch.equal(a, b)
    quiet = CheckpointSaver(tmp / "quiet", fresh)
    quiet.save(2, state(2))
    ref = quiet.wait()
    names = sorted(p.name for p in ref.iterdir() if p.suffix == ".safetensors")
    assert names == sorted(p.name for p in path.iterdir() if p.suffix == ".safetensors") and names
    for n in names:
        assert (ref / n).read_bytes() == (path / n).read_bytes(), n
    a, b = (json.loads((p / "manifest.json").read_text())["files"] for p in (ref, path))
    assert {k: v for k, v in a.items() if k in names} == {k: v for k, v in b.items() if k in names}


@pytest.mark.parametrize("clipping", [True, False], ids=["clipping", "no-clipping"])
def test_with_room_the_optimizer_never_waits_and_the_files_hold_the_save_step(tmp_path, monkeypatch, clipping):
    m, saver, path, at_save = train_through_a_save(tmp_path, monkeypatch, lambda s: sum(unit_bytes(s)), clipping)
    st = saver.stats
    assert st["waits"] == 0 and st["wait_s"] == 0 and st["wait_s_by_step"] == {}
    assert st["staged_units"] >= 1 and st["staged_bytes"] > 0 and st["staged_peak_bytes"] <= st["staging_limit_bytes"]
    assert st["bytes"] > 0 and st["seconds"] > 0 and set(st["io_threads_s"]) >= {"gather_s", "hash_s", "write_s"}
    assert_holds(m, path, at_save, tmp_path)


def test_without_room_the_optimizer_waits_for_the_writer_and_the_files_hold_the_save_step(tmp_path, monkeypatch):
    m, saver, path, at_save = train_through_a_save(tmp_path, monkeypatch, lambda s: 0)
    st = saver.stats
    assert st["waits"] > 0 and st["wait_s"] > 0 and st["staged_units"] == 0 and st["staged_bytes"] == 0
    assert set(st["wait_s_by_step"]) <= {"3", "4", "5"} and sum(st["wait_s_by_step"].values()) == \
        pytest.approx(st["wait_s"])
    assert_holds(m, path, at_save, tmp_path)


def test_a_pool_of_one_checkpoint_stages_every_unit_while_the_writer_has_written_none(tmp_path, monkeypatch):
    """The plan's pool at most one checkpoint, 12 B/param (planner/io_time.staging_limit): with the writer held
    before its first byte, the optimizer stages every unit, none waits (each unit's 4-byte step, copied with its
    state, is not counted against that bound)."""
    make_model_dir(tmp_path / "model", "llama", seed=5)
    m = Megatrain(tmp_path / "model")
    gate, original = threading.Event(), fastio.transfer

    def held(*a, **kw):
        assert gate.wait(timeout=60)
        return original(*a, **kw)
    monkeypatch.setattr(fastio, "transfer", held)
    saver = CheckpointSaver(tmp_path / "ckpt", m.store, staging_bytes=12 * m.store.num_params)
    try:
        saver.save(2, state(2))
        updates = threading.Thread(target=lambda: [saver.before_update(i) for i in range(len(m.store.tiles))])
        updates.start()
        updates.join(timeout=20)
        staged_all = not updates.is_alive()
    finally:
        gate.set()
        saver.wait()
        m.close()
    assert staged_all, "an update waited for the writer with room in the pool"
    st = saver.stats
    assert st["waits"] == 0 and st["staged_units"] == len(m.store.tiles)
    assert st["staged_peak_bytes"] == st["staging_limit_bytes"] == sum(unit_bytes(m.store))


def test_a_pool_of_one_unit_stages_what_fits_and_never_holds_more(tmp_path, monkeypatch, tmp_path_factory):
    m, saver, path, at_save = train_through_a_save(tmp_path, monkeypatch, lambda s: max(unit_bytes(s)))
    st = saver.stats
    assert st["staged_units"] >= 1 and st["staged_peak_bytes"] <= st["staging_limit_bytes"]
    assert_holds(m, path, at_save, tmp_path)


def test_stats_are_appended_to_the_file_named(tmp_path, monkeypatch):
    out = tmp_path / "stats.jsonl"
    monkeypatch.setenv("MEGATRAIN_SAVE_STATS", str(out))
    m, saver, path, at_save = train_through_a_save(tmp_path, monkeypatch, lambda s: sum(unit_bytes(s)))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 1 and lines[0]["step"] == 2 and lines[0]["staged_units"] == saver.stats["staged_units"]


def test_a_full_disk_with_staged_units_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    make_model_dir(tmp_path / "model", "llama", seed=7)
    m = Megatrain(tmp_path / "model", dtype=torch.bfloat16, threaded_optimizer=True)
    root = tmp_path / "ckpt"
    saver = CheckpointSaver(root, m.store, m.pipeline, staging_bytes=sum(unit_bytes(m.store)))
    try:
        step_after_backward(m, random_batches(2, 2, 97, [9, 12], seed=0), 1e-3)
        saver.save(1, state(1))
        first = saver.wait()
        before = {p.name: p.read_bytes() for p in first.iterdir()}
        full_disk_after(monkeypatch, 1)  # ENOSPC after the first chunk
        monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.05")
        step_after_backward(m, random_batches(2, 2, 97, [9, 12], seed=1), 1e-3)
        saver.save(2, state(2))
        step_after_backward(m, random_batches(2, 2, 97, [9, 12], seed=2), 1e-3)  # units may be staged before the error
        m.pipeline.drain()
        with pytest.raises(MegatrainError) as e:
            saver.wait()
    finally:
        m.close()
    msg = str(e.value)
    assert "\n" not in msg and str(root / "step-2") in msg and "No space left on device" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before


def test_the_plan_bounds_the_pool_by_the_headroom_and_predicts_the_cost():
    params, step = 7_000_000_000, 10.0
    ckpt = 12 * params
    assert staging_limit(None, ckpt) == 0 and staging_limit(-5e9, ckpt) == 0
    assert staging_limit(40e9, ckpt) == 20e9  # half the headroom
    assert staging_limit(1e12, ckpt) == ckpt  # never more than a checkpoint
    none = io_times(params, 1.5e9, 2e9, step, every=5, file_dtype=None, headroom=0)
    some = io_times(params, 1.5e9, 2e9, step, every=5, file_dtype=None, headroom=40e9)
    room = io_times(params, 1.5e9, 2e9, step, every=5, file_dtype=None, headroom=1e12)
    assert none["staging_bytes"] == 0 and none["save_cost_s"] == pytest.approx(max(0, none["save_s"] - step))
    assert room["staging_bytes"] == ckpt and some["staging_bytes"] == 20e9
    assert room["save_cost_s"] < some["save_cost_s"] < none["save_cost_s"]
    assert room["save_share"] < none["save_share"]
    line = io_lines(some)[0]
    assert "staging 20.0 GB of host RAM" in line and f"a save costs {some['save_cost_s']:.0f} s" in line
    assert "the optimizer waits for the writer" in io_lines(none)[0]
