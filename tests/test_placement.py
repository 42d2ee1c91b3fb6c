"""Where things live never changes the result: every placement of the schedule (checkpoint every K layers, spilled
checkpoints, gradients parked on the GPU or sent to host, 1-3 wave groups with their accumulators on the GPU or in
host memory) trains exactly as the default placement does, bit for bit in fp32, and so still equals transformers +
torch AdamW."""

import pytest
import torch

from conftest import make_model_dir
from megatrain.runtime import Placement
from megatrain.runtime.schedule import group_sizes, step_schedule
from reference import Megatrain, random_batches

# 5 layers: blocks of K = 2 and 4 end short; 4 unequal micro-batches: 3 groups are uneven
LENGTHS, MICRO, STEPS = [7, 12, 9, 5], 4, 3


def train(model_dir, placement: Placement):
    mt = Megatrain(model_dir, placement=placement)
    out = []
    for step in range(STEPS):
        loss, norm, grads = mt.train_step(random_batches(MICRO, 2, 97, LENGTHS, seed=500 + step), lr=1e-3,
                                          max_norm=0.5, keep_grads=True)
        out.append((loss, norm, grads))
    mt.close()
    return out, mt.store


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("placement")
    make_model_dir(d, "qwen3", tied=True, seed=61, layers=5)
    return d


@pytest.fixture(scope="module")
def baseline(model_dir):
    return train(model_dir, Placement())


PLACEMENTS = [
    Placement(checkpoint_every=2),
    Placement(checkpoint_every=4),
    Placement(checkpoint_every=5),
    Placement(checkpoint_every=2, keep_top_layers=2),  # blocks (0,1) (2): the top two layers keep their inputs
    Placement(checkpoint_every=4, keep_top_layers=1, spill_layers=3),
    Placement(spill_layers=3),
    Placement(checkpoint_every=2, spill_layers=5),
    Placement(grads_to_host=3),
    Placement(grads_to_host=7),
    Placement(wave_groups=2),
    Placement(wave_groups=3),
    Placement(wave_groups=3, group_grads="host"),
    Placement(wave_groups=2, group_grads="host", checkpoint_every=2, spill_layers=4, grads_to_host=2),
    Placement(wave_groups=3, group_grads="host", grads_to_host=7),  # every accumulator waits in its gradient's buffer
]


def test_accumulators_wait_in_the_gradients_host_buffers(model_dir):
    """With every gradient sent to host, a wave group's accumulator parks in the buffer its finished gradient is
    copied into: the only host memory the groups add is the tied embedding's input side."""
    mt = Megatrain(model_dir, placement=Placement(wave_groups=2, group_grads="host", grads_to_host=7))
    mt.train_step(random_batches(MICRO, 2, 97, LENGTHS, seed=9), lr=1e-3, max_norm=0.5)
    assert mt.runtime.engine.accumulators.host_bytes() == 4 * mt.store.tiles[0].numel
    mt.close()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
def test_every_placement_is_the_same_step(model_dir, baseline, placement):
    (base, base_store), (got, store) = baseline, train(model_dir, placement)
    for (l0, n0, g0), (l1, n1, g1) in zip(base, got):
        assert l1 == l0 and n1 == n0
        for name in g0:
            assert torch.equal(g1[name], g0[name]), name
    for a, b in ((store.master, base_store.master), (store.exp_avg, base_store.exp_avg),
                 (store.exp_avg_sq, base_store.exp_avg_sq)):
        assert torch.equal(a, b)


def test_schedule_streams_each_block_once_more():
    """K = 2 over 5 layers: blocks (0,1) (2,3) (4); a block's layers below its top are rebuilt before its backward,
    its kept input spilled when below spill_layers, and fetched back one block ahead."""
    uses = step_schedule(7, False, Placement(checkpoint_every=2, spill_layers=3))
    kinds = [(u.kind, u.layer) for u in uses]
    assert kinds == [("embed", None)] + [("forward", l) for l in range(5)] + [("head", None)] + [
        ("backward", 4), ("rebuild", 2), ("backward", 3), ("backward", 2), ("rebuild", 0), ("backward", 1),
        ("backward", 0), ("embed_backward", None)]
    assert [u.keep for u in uses if u.kind == "forward"] == ["host", "drop", "host", "drop", "gpu"]
    assert [(u.kind, u.layer, u.fetch) for u in uses if u.fetch is not None] == [("backward", 4, 2),
                                                                               ("rebuild", 2, 0)]


def test_top_layers_keep_their_inputs():
    """keep_top_layers = 2 over 5 layers with K = 2: blocks (0,1) (2) below the top two layers (3) (4), which keep
    their inputs; only layer 0 is rebuilt. With every layer kept it is K = 1's schedule."""
    uses = step_schedule(7, False, Placement(checkpoint_every=2, keep_top_layers=2))
    assert [u.keep for u in uses if u.kind == "forward"] == ["gpu", "drop", "gpu", "gpu", "gpu"]
    assert [(u.kind, u.layer) for u in uses if u.kind in ("rebuild", "backward")] == [
        ("backward", 4), ("backward", 3), ("backward", 2), ("rebuild", 0), ("backward", 1), ("backward", 0)]
    assert step_schedule(7, False, Placement(checkpoint_every=3, keep_top_layers=5)) == step_schedule(7, False)


def test_wave_groups_are_consecutive_and_even():
    assert group_sizes(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert group_sizes(2, 3) == [range(0, 1), range(1, 2)]  # never an empty group
    uses = step_schedule(4, False, Placement(wave_groups=2, grads_to_host=1))
    assert [u.grad for u in uses if u.grad] == ["group-gpu"] * 4 + ["host", "gpu", "gpu", "gpu"]


def test_gradient_norm_in_chunks(model_dir, baseline, monkeypatch):
    """A unit longer than one cuBLAS dot (a 405B layer: 3.2e9 > 2**31 - 1 elements) has its squared norm summed over
    chunks: with chunks of 1,000 elements every unit is split, and the step is the default's up to the order of the
    norm's summation (the float64 norm of the same gradients agrees to fp32 rounding)."""
    from megatrain.runtime import engine

    x = torch.randn(10_007, generator=torch.Generator().manual_seed(3))
    assert torch.equal(engine.squared_norm(x, chunk=20_000), torch.dot(x, x))  # fits one call: the same dot
    assert torch.allclose(engine.squared_norm(x, chunk=1_000).double(), (x.double() ** 2).sum(), rtol=1e-6)
    monkeypatch.setattr(engine, "DOT_CHUNK", 1_000)
    (base, _), (got, _) = baseline, train(model_dir, Placement())
    for (l0, n0, g0), (l1, n1, g1) in zip(base, got):
        exact = sum((g.double() ** 2).sum() for g in g1.values()).sqrt()
        assert abs(n1 - exact) <= 1e-6 * exact and abs(n1 - n0) <= 1e-6 * n0
        assert abs(l1 - l0) <= 1e-6 * abs(l0)
