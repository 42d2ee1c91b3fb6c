"""A background save writes the units in the order the optimizer updated them in the last step (head first without
clipping, forward with it), so the next step's first update waits only for its own unit; the checkpoint is the same
bytes in any order, holds exactly step N, and resumes exactly."""

import json

import pytest
import torch

from conftest import make_model_dir
from megatrain.checkpoint import CheckpointSaver
from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.runtime.schedule import gradient_order
from megatrain.runtime.store import HostStore
from reference import Megatrain, random_batches
from test_checkpoint import snapshot, state
from test_noclip import step_after_backward, step_without_clipping


class Written:
    """The saver's listener: the order in which units are reported written (the first report of each)."""

    def __init__(self):
        self.units = []

    def begin_save(self, step):
        pass

    def unit_written(self, step, unit):
        if unit not in self.units:
            self.units.append(unit)


@pytest.mark.parametrize("clipping", [False, True], ids=["no-clipping", "clipping"])
def test_units_are_written_in_the_optimizers_order_and_the_state_is_step_n(tmp_path, monkeypatch, clipping):
    make_model_dir(tmp_path / "model", "llama", seed=21)
    m = Megatrain(tmp_path / "model", dtype=torch.bfloat16, threaded_optimizer=True)
    listener = Written()
    saver = CheckpointSaver(tmp_path / "ckpt", m.store, m.pipeline, keep=0, listener=listener)
    take = step_after_backward if clipping else step_without_clipping
    n = len(m.store.tiles)
    try:
        for s in range(2):
            take(m, random_batches(2, 2, 97, [9, 12], seed=s), 1e-3)
        m.pipeline.drain()
        expected = list(range(n)) if clipping else gradient_order(n)
        assert saver.write_order() == expected and (clipping or expected[0] == n - 1)
        at_save = snapshot(m.store)
        monkeypatch.setenv("MEGATRAIN_TEST_SAVE_DELAY_S", "0.05")
        saver.save(2, state(2))
        for s in range(2, 4):  # the next steps' updates wait for the writer, unit by unit, in the same order
            take(m, random_batches(2, 2, 97, [9, 12], seed=s), 1e-3)
        path = saver.wait()
        m.pipeline.drain()
    finally:
        m.close()
    assert listener.units == expected
    manifest = json.loads((path / "manifest.json").read_text())
    assert [u["name"] for u in manifest["units"]] == [t.unit.name for t in m.store.tiles]  # unit order, as before
    fresh = HostStore(m.adapter, torch.bfloat16)
    load_store(open_checkpoint(path), fresh)
    for a, b in zip(snapshot(fresh), at_save):
        assert torch.equal(a, b)


def test_any_write_order_gives_the_same_files(tmp_path):
    make_model_dir(tmp_path / "model", "qwen2", seed=22)
    m = Megatrain(tmp_path / "model")
    try:
        m.step(random_batches(1, 2, 97, [8], seed=1))
        n = len(m.store.tiles)
        paths = []
        for name, order in (("forward", range(n)), ("backward", reversed(range(n))), ("partial", [1, 0])):
            saver = CheckpointSaver(tmp_path / name, m.store)
            for u in order:
                saver.before_update(u)
            assert saver.write_order() == (list(range(n - 1, -1, -1)) if name == "backward" else list(range(n)))
            saver.save(1, state(1))
            paths.append(saver.wait())
    finally:
        m.close()
    files = [sorted(p.iterdir()) for p in paths]
    assert [f.name for f in files[0]] == [f.name for f in files[1]] == [f.name for f in files[2]]
    for a, b, c in zip(*files):
        assert a.read_bytes() == b.read_bytes() == c.read_bytes(), a.name
