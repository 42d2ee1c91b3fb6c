"""The precompute pass's bookkeeping (run/reference.py, Reference._pass): its waves' log-probs stay on the device
until a part is stored and are then copied to host together, so each must still land on its own pair ids, with the
parts of an interrupted pass and the parts stored every PART_SECONDS. The engine here scores a row by its pair id
and side (random values drawn per pair id), so a log-prob filed under the wrong pair or side shows."""

from __future__ import annotations

import types

import pytest
import torch

from megatrain.run import reference as ref_lib
from megatrain.run.reference import Reference, _load


class Batches(list):
    """A set's batches by pair id (data.PairBatches' interface: a sequence of batches and its `pairs`)."""

    def __init__(self, n_pairs: int, mbs: int, T: int = 5):
        super().__init__()
        self.pairs = list(range(n_pairs))
        for a in range(0, n_pairs, mbs):
            ids = list(range(a, min(a + mbs, n_pairs)))
            x = torch.randint(0, 50, (2 * len(ids), T))
            self.append({"input_ids": x, "labels": x.clone(), "pair_ids": torch.tensor(ids)})


class Engine:
    """sequence_logps: row 2i / 2i+1 of a micro-batch scores values[pair_ids[i]] (chosen, rejected)."""

    device = torch.device("cpu")

    def __init__(self, values: torch.Tensor):
        self.values, self.calls = values, 0

    def sequence_logps(self, mbs, weights="policy"):
        self.calls += 1
        logp = torch.cat([self.values[mb.pair_ids].reshape(-1) for mb in mbs])
        return logp, torch.ones_like(logp, dtype=torch.int64)


class Log:
    def __init__(self):
        self.records, self.lines = [], []

    def log(self, r):
        self.records.append(r)

    def info(self, line):
        self.lines.append(line)


def fake_run(tmp_path, engine, mbs: int, accum: int):
    world = types.SimpleNamespace(rank=0, size=1)
    ranks = types.SimpleNamespace(world=world, phase=lambda name: None, all_sum=lambda xs: xs)
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(grad_accum_steps=accum, micro_batch_size=mbs, seed=0,
                                                            init_std=0.02),
                                model=types.SimpleNamespace(path=str(tmp_path), init="random"),
                                preference=types.SimpleNamespace(reference_path=None))
    return types.SimpleNamespace(cfg=cfg, ranks=ranks, engine=engine, writes=True, plan=None, out_dir=tmp_path)


@pytest.mark.parametrize("part_seconds", [1e9, 0.0])  # every wave collected at the end / a part after each wave
@pytest.mark.parametrize("n_train, n_eval, mbs, accum", [(23, 7, 3, 2), (8, 0, 4, 1)])
def test_every_pair_gets_its_own_log_probs(tmp_path, monkeypatch, part_seconds, n_train, n_eval, mbs, accum):
    monkeypatch.setattr(ref_lib, "PART_SECONDS", part_seconds)
    g = torch.Generator().manual_seed(n_train * 100 + n_eval)
    values = torch.randn(max(n_train, n_eval), 2, generator=g, dtype=torch.float64).float() * 50
    sides = {"train": Batches(n_train, mbs)} | ({"eval": Batches(n_eval, mbs)} if n_eval else {})
    engine = Engine(values)
    r = Reference("precompute", "test")
    r.fingerprint = "fp"
    r.file = tmp_path / "reference" / "fp.safetensors"
    (tmp_path / "reference").mkdir()
    log = Log()
    r._pass(fake_run(tmp_path, engine, mbs, accum), log, sides, tmp_path / "reference", None)
    assert engine.calls == sum(-(-len(b) // accum) for b in sides.values())  # one wave per accum batches
    for side, b in sides.items():
        assert torch.equal(r.tables[side], values[: len(b.pairs)]), side
    stored, _ = _load(r.file)
    assert all(torch.equal(stored[s], r.tables[s]) for s in sides)
    assert not (tmp_path / "reference" / "fp.partial").exists()  # the parts are gone once the table is whole
    (rec,) = log.records
    assert rec["reference_pairs"] == n_train + n_eval and "reference_waves" not in rec  # (GPU only: CUDA events)


def test_a_pass_goes_on_from_an_interrupted_ones_parts(tmp_path, monkeypatch):
    """Parts of an earlier pass (some pairs of the first waves) are kept; only the waves not complete are scored."""
    monkeypatch.setattr(ref_lib, "PART_SECONDS", 1e9)
    n, mbs, accum = 20, 2, 2
    values = torch.randn(n, 2, generator=torch.Generator().manual_seed(7)) * 30
    parts = tmp_path / "reference" / "fp.partial"
    parts.mkdir(parents=True)
    done = [0, 1, 2, 3, 4, 5, 6, 7, 9]  # waves 0 and 1 whole (pairs 0-7), wave 2 only in part (pair 9)
    ref_lib._save(parts / "part-r0-1-00000.safetensors",
                  {"pair_ids": torch.tensor(done), "logps": values[done]}, {"side": "train"})
    engine = Engine(values)
    r = Reference("precompute", "test")
    r.fingerprint, r.file = "fp", tmp_path / "reference" / "fp.safetensors"
    log = Log()
    r._pass(fake_run(tmp_path, engine, mbs, accum), log, {"train": Batches(n, mbs)}, tmp_path / "reference", None)
    assert engine.calls == 3  # waves 2, 3 and 4 (pairs 8-19)
    assert torch.equal(r.tables["train"], values)
    assert log.records[0]["reference_pairs"] == n - len(done)
