"""Order and resume: the same seed gives the same batches, a restored sampler continues with exactly the next
one, epochs cover the data once each, and weights set how often a dataset is seen."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from data_fixtures.helpers import config, tokenizer, write_jsonl

from megatrain.data import build_train_loader
from megatrain.data.sampler import BatchShape, EpochPlanner, ResumableSampler
from megatrain.errors import MegatrainError

WORDS = "the quick brown fox jumps over the lazy dog and you are helpful".split()


def _texts(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    return [{"text": " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))} for _ in range(n)]


def _loader(tmp_path, seed=0, mbs=2, gas=2, **kw):
    path = tmp_path / "t.jsonl"
    if not path.exists():
        write_jsonl(path, _texts(23))
    return build_train_loader(config(tmp_path, path=str(path), **kw), tokenizer(), seed=seed, micro_batch_size=mbs,
                              grad_accum_steps=gas)


def _steps(loader, n):
    return [[{k: v.tolist() for k, v in b.items()} for b in loader.next_step()] for _ in range(n)]


@pytest.mark.parametrize("packing", [False, True])
def test_same_seed_same_order_other_seed_other_order(tmp_path, packing):
    kw = dict(packing=packing, max_seq_len=32)
    a, b, c = _loader(tmp_path, 1, **kw), _loader(tmp_path, 1, **kw), _loader(tmp_path, 2, **kw)
    first = _steps(a, 12)  # 23 examples in micro-batches of 2: several epochs
    assert first == _steps(b, 12)
    assert first != _steps(c, 12)


@pytest.mark.parametrize("packing", [False, True])
def test_restored_sampler_continues_with_exactly_the_next_batch(tmp_path, packing):
    kw = dict(packing=packing, max_seq_len=32)
    ref = _loader(tmp_path, 7, **kw)
    expected = _steps(ref, 15)
    for cut in (0, 3, 5, 6, 11):  # inside an epoch and right at its border
        run = _loader(tmp_path, 7, **kw)
        _steps(run, cut)
        state = run.state_dict()
        resumed = _loader(tmp_path, 7, **kw)
        resumed.load_state_dict(state)
        assert _steps(resumed, 15 - cut) == expected[cut:]


def test_every_epoch_covers_every_example_once_in_a_new_order():
    lengths = np.arange(1, 24)
    planner = EpochPlanner(lengths, np.zeros(23, dtype=np.int64), [23], seed=3, shape=BatchShape(4, 64))
    s = ResumableSampler(planner)
    epochs = {}
    while s.epoch < 3:
        mb = s.next()  # the epoch advances when its last micro-batch has been handed out
        for row in mb:
            epochs.setdefault(s.epoch, []).extend(row)
    del epochs[3]
    assert all(sorted(e) == list(range(23)) for e in epochs.values())
    assert epochs[0] != epochs[1] != epochs[2]


def test_length_grouping_pads_less_than_random_batches():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 500, size=1000)
    src = np.zeros(1000, dtype=np.int64)

    def padded(group):
        plan = EpochPlanner(lengths, src, [1000], 0, BatchShape(8, 512, group_by_length=group)).plan(0)
        return sum(len(mb) * max(lengths[r].sum() for r in mb) for mb in plan)

    assert padded(True) < 0.6 * padded(False)
    plan = EpochPlanner(lengths, src, [1000], 0, BatchShape(8, 512)).plan(0)
    assert lengths[plan[0][0]].sum() == lengths.max()  # the largest micro-batch comes first: OOM shows at once


def test_weights_set_how_often_each_dataset_is_seen(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"the dog {w}"} for w in WORDS[:10]])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"a fox {w}"} for w in WORDS[:10]])
    cfg = config(tmp_path, datasets=[{"path": str(a), "weight": 2.0}, {"path": str(b), "weight": 0.5}])
    loader = build_train_loader(cfg, tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)
    ex = loader.examples
    assert ex.quotas() == [20, 5]
    seen = []
    for epoch in (0, 1):
        plan = loader.sampler.planner.plan(epoch)
        keys = [k for mb in plan for row in mb for k in row]
        assert len(keys) == 25
        per_example = Counter(keys)
        assert all(per_example[k] == 2 for k in np.flatnonzero(ex.source == 0))  # weight 2: twice
        halves = {k for k in keys if ex.source[k] == 1}
        assert len(halves) == 5  # weight 0.5: half of b
        seen.append(halves)
    assert seen[0] != seen[1]  # ... a fresh half each epoch


def test_restoring_into_changed_data_or_batch_shape_is_an_error(tmp_path):
    state = _loader(tmp_path, 0).state_dict()
    other = _loader(tmp_path, 0, mbs=3)
    with pytest.raises(MegatrainError, match="micro_batch_size was 2 .* is 3"):
        other.load_state_dict(state)
