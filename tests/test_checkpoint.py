"""Checkpoint saving: the background writer saves exactly step N's state while training goes on, files are
standard safetensors with checksums, failures are reported, signals only request a stop."""

import os
import signal

import pytest
import torch
from safetensors import safe_open

from conftest import make_model_dir
from megatrain.checkpoint import CheckpointSaver, StopOnSignal, verify_checkpoint
from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.errors import MegatrainError
from megatrain.runtime.store import HostStore
from reference import Megatrain, random_batches


def state(n: int) -> dict:
    return {"step": n, "loader": {}, "rng": {}, "config": {}}  # what a run state holds, here without a run


def snapshot(store):
    return [t.clone() for t in (store.master, store.exp_avg, store.exp_avg_sq)] + \
        [torch.stack([t.step for t in store.tiles])]


def step(m: Megatrain, seed: int) -> None:
    m.train_step(random_batches(2, 2, 97, [9, 12], seed=seed), lr=1e-3, max_norm=1.0)


@pytest.mark.parametrize("threaded", [True, False], ids=["worker-thread", "inline"])
def test_background_save_holds_exactly_step_n(tmp_path, monkeypatch, threaded):
    """Steps N+1, N+2 run while step N is written slowly; the files still hold step N, bit for bit."""
    make_model_dir(tmp_path / "model", "qwen2", seed=3)
    m = Megatrain(tmp_path / "model", dtype=torch.bfloat16, threaded_optimizer=threaded)  # threaded: as on CUDA
    pipeline = m.pipeline
    saver = CheckpointSaver(tmp_path / "ckpt", m.store, pipeline, keep=0)
    try:
        for s in range(2):
            step(m, seed=s)
        pipeline.drain()
        at_save = snapshot(m.store)
        monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.05")
        saver.save(2, state(2))
        assert saver.busy
        for s in range(2, 4):  # the optimizer catches up with the writer and waits for it, unit by unit
            step(m, seed=s)
        path = saver.wait()
        pipeline.drain()
    finally:
        m.close()
    after = snapshot(m.store)
    assert not torch.equal(after[0], at_save[0])  # training did go on
    fresh = HostStore(m.adapter, torch.bfloat16)
    load_store(open_checkpoint(path), fresh)
    for a, b in zip(snapshot(fresh), at_save):
        assert torch.equal(a, b)
    for a, b in zip(fresh.tiles, m.store.tiles):  # the streaming copy is derived from the master
        assert a.stream.dtype == torch.bfloat16


def test_unit_files_are_standard_safetensors(tmp_path):
    make_model_dir(tmp_path / "model", "llama", tied=True, seed=4)
    m = Megatrain(tmp_path / "model")
    m.step(random_batches(1, 2, 97, [8], seed=1))
    saver = CheckpointSaver(tmp_path / "ckpt", m.store)
    saver.save(1, state(1))
    path = saver.wait()
    manifest = verify_checkpoint(path)
    assert manifest["step"] == 1 and len(manifest["units"]) == len(m.store.tiles)
    tile = m.store.tiles[1]
    with safe_open(str(path / manifest["units"][1]["file"]), framework="pt") as f:
        for s, view in zip(tile.unit.specs, tile.views(tile.exp_avg).values()):
            assert torch.equal(f.get_tensor(f"exp_avg/{s.hf_name}"), view)
        assert f.get_tensor("step").item() == 1.0
        assert not any(k.startswith("master/lm_head") for k in f.keys())


def test_failed_save_is_reported_and_leaves_nothing(tmp_path, monkeypatch):
    from megatrain.checkpoint import fastio

    make_model_dir(tmp_path / "model", "llama", seed=5)
    m = Megatrain(tmp_path / "model")
    saver = CheckpointSaver(tmp_path / "ckpt", m.store)
    calls = []

    def full_disk(*a, **kw):  # the pool's write call: the disk fills after three chunks
        calls.append(1)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return original(*a, **kw)

    original = fastio.transfer
    monkeypatch.setattr(fastio, "transfer", full_disk)
    saver.save(7, state(7))
    for i in range(len(m.store.tiles)):
        saver.before_update(i)  # returns: an optimizer never waits on a dead writer
    with pytest.raises(MegatrainError, match=r"saving step 7 to .*step-7 failed: OSError.*No space left"):
        saver.wait()
    assert list((tmp_path / "ckpt").iterdir()) == []


def test_signals_request_a_stop_then_interrupt():
    with StopOnSignal() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
