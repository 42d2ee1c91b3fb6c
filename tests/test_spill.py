"""Memory bounding changes where tensors live, never the result: spilled checkpoints and gradients offloaded to
host during backward give bit-for-bit the same training as keeping everything on the device."""

import pytest
import torch

from conftest import make_model_dir
from megatrain.runtime import Placement
from megatrain.runtime.optimizer_pipeline import OptimizerPipeline
from megatrain.runtime.pinned import PinnedHost
from megatrain.runtime.schedule import grads_to_host
from reference import Megatrain, random_batches


def run(model_dir, spill_layers, offload_units, steps=4):
    mt = Megatrain(model_dir, dtype=torch.bfloat16,
                   placement=Placement(spill_layers=spill_layers, grads_to_host=offload_units))
    losses = []
    for step in range(steps):
        loss, _, _ = mt.train_step(random_batches(3, 2, 97, [7, 12, 9], seed=400 + step), lr=1e-3, max_norm=0.5)
        losses.append(loss)
    mt.close()
    return losses, mt.store


@pytest.mark.parametrize("spill,offload", [(1, 0), (3, 0), (0, 2), (2, 5), (3, 99)])
def test_spill_and_offload_are_exact(tmp_path, spill, offload):
    make_model_dir(tmp_path, "qwen2", tied=True, seed=51)
    base_losses, base = run(tmp_path, 0, 0)
    losses, store = run(tmp_path, spill, offload)
    assert losses == base_losses
    for a, b in ((store.master, base.master), (store.exp_avg, base.exp_avg), (store.stream, base.stream)):
        assert torch.equal(a, b)


def test_offload_set_follows_backward_order(tmp_path):
    make_model_dir(tmp_path, "llama", seed=52)
    mt = Megatrain(tmp_path)
    n = len(mt.store.tiles)
    p = OptimizerPipeline(mt.store, mt.opt, torch.device("cpu"), PinnedHost(cuda=False),
                          to_host=tuple(grads_to_host(n, Placement(grads_to_host=3))))
    assert p.offload == {n - 1, n - 2, n - 3}  # head, last layer, the one below
    p.close()


def test_torch_pinned_cache_is_released_once_it_has_grown(monkeypatch):
    """runtime.pinned.release_torch_pinned_cache: empties torch's caching host allocator once it holds the threshold
    more than after its last release (free blocks are returned; blocks in use stay and are not asked for again),
    and reports what was returned. A stand-in for torch.cuda's allocator: CPU has none."""
    import torch

    from megatrain.runtime import pinned

    in_use, held = 2**30, {"allocated_bytes.current": 5 * 2**30}
    calls = []

    def empty():  # returns the free blocks, keeps those in use
        calls.append(1)
        held["allocated_bytes.current"] = in_use

    monkeypatch.setattr(pinned, "_after_release", [0])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: dict(held))
    monkeypatch.setattr(torch.accelerator, "empty_host_cache", empty)
    assert pinned.release_torch_pinned_cache() == 4 * 2**30 and calls == [1]
    assert pinned.release_torch_pinned_cache() == 0 and calls == [1]  # the blocks in use: not asked again
    held["allocated_bytes.current"] += pinned.TORCH_PINNED_IDLE - 1  # grown by less than the threshold: kept
    assert pinned.release_torch_pinned_cache() == 0 and calls == [1]
    held["allocated_bytes.current"] += 1
    assert pinned.release_torch_pinned_cache() == pinned.TORCH_PINNED_IDLE and calls == [1, 1]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA context: nothing to ask
    held["allocated_bytes.current"] += 2**30
    assert pinned.release_torch_pinned_cache() == 0 and calls == [1, 1]
