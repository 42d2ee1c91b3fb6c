"""The overlapped optimizer is exact: updating unit by unit on a worker thread while the next step's forward
waits per unit gives bit-for-bit the same weights and Adam states as updating everything after backward."""

import torch

from conftest import make_model_dir
from megatrain.runtime.adamw import CpuAdamW
from reference import Megatrain, random_batches


def state(store):
    return [t.clone() for t in (store.master, store.exp_avg, store.exp_avg_sq, store.stream)]


def test_piecewise_update_equals_whole_tile(tmp_path, monkeypatch):
    import megatrain.runtime.adamw

    monkeypatch.setattr(megatrain.runtime.adamw, "CHUNK", 512)  # so tiny tiles span many chunks
    make_model_dir(tmp_path, "qwen3", seed=31)
    a, b = Megatrain(tmp_path, dtype=torch.bfloat16), Megatrain(tmp_path, dtype=torch.bfloat16)
    opt = CpuAdamW(weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for ta, tb in zip(a.store.tiles, b.store.tiles):
            grad = torch.randn(ta.numel, generator=g)
            opt.update(ta, grad.clone(), lr=1e-3, clip_coef=0.7)
            piece = 512 * 3  # pieces on chunk boundaries, crossing the decay/no-decay boundary, last one short
            for off in range(0, tb.numel, piece):
                opt.update(tb, grad[off: off + piece].clone(), lr=1e-3, clip_coef=0.7, offset=off,
                           new_step=(off == 0))
    for x, y in zip(state(a.store), state(b.store)):
        assert torch.equal(x, y)


def test_threaded_pipeline_is_bit_exact(tmp_path):
    make_model_dir(tmp_path, "llama", tied=True, seed=32)
    sequential = Megatrain(tmp_path, dtype=torch.bfloat16, threaded_optimizer=False)
    piped = Megatrain(tmp_path, dtype=torch.bfloat16, threaded_optimizer=True)
    try:
        for step in range(6):
            batches = random_batches(3, 2, 97, [7, 12, 9], seed=200 + step)
            lr = 1e-3 * (step + 1)
            loss_a, _, _ = sequential.train_step(batches, lr=lr, max_norm=0.5)
            loss_b, _, _ = piped.train_step(batches, lr=lr, max_norm=0.5)  # its forward waits, unit by unit,
            assert loss_b == loss_a                                        # for the last step's update
        piped.pipeline.drain()
    finally:
        piped.close()
    for x, y in zip(state(sequential.store), state(piped.store)):
        assert torch.equal(x, y)
