"""The overlapped optimizer is exact: updating unit by unit on a worker thread while the next step's forward
waits per unit gives bit-for-bit the same weights and Adam states as updating everything after backward. Without
clipping, where updates are queued during backward, the worker holds at most DEVICE_GRADS gradients, its failures
reach the training thread, and a step must end as it began."""

import pytest
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


@pytest.mark.parametrize("chunks_per_call", [2, 3, 7])
def test_several_chunks_per_call_equal_one(tmp_path, monkeypatch, chunks_per_call):
    """Blocks updated several to a kernel call (a list of them) and their streaming copies written together: the
    weights, Adam states and bf16 copy equal one block a call bit for bit, whole tiles and pieces at an offset, with
    the decay/no-decay boundary inside a call's blocks."""
    import megatrain.runtime.adamw

    monkeypatch.setattr(megatrain.runtime.adamw, "CHUNK", 512)
    make_model_dir(tmp_path, "qwen3", seed=32)
    a, b = Megatrain(tmp_path, dtype=torch.bfloat16), Megatrain(tmp_path, dtype=torch.bfloat16)
    one, several = CpuAdamW(weight_decay=0.1), CpuAdamW(weight_decay=0.1, chunks_per_call=chunks_per_call)
    g = torch.Generator().manual_seed(1)
    before = state(a.store)
    for step in range(3):
        for ta, tb in zip(a.store.tiles, b.store.tiles):
            assert ta.numel > 512 * chunks_per_call  # (a call of several blocks happens)
            grad = torch.randn(ta.numel, generator=g)
            if step == 1:  # in pieces, as landing buffers give them
                for off in range(0, ta.numel, 512 * 5):
                    for opt, t in ((one, ta), (several, tb)):
                        opt.update(t, grad[off: off + 512 * 5].clone(), lr=1e-3, clip_coef=0.7, offset=off,
                                   new_step=(off == 0))
            else:
                one.update(ta, grad.clone(), lr=1e-3, clip_coef=0.7)
                several.update(tb, grad.clone(), lr=1e-3, clip_coef=0.7)
    assert not any(torch.equal(x, y) for x, y in zip(state(a.store), before))  # (the steps changed each array)
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


# ---- without clipping: updates queued as the gradients are complete -----------------------------------------------
def test_threaded_updates_during_backward_keep_at_most_device_grads_waiting(tmp_path):
    """A slow optimizer on the worker thread: `put` holds the engine while DEVICE_GRADS gradients wait for it, so at
    most that many are ever handed over and not yet updated (the bound is reached: the engine did wait), the updates
    run in backward order and most of them before the engine's step returns, and the result is the inline one."""
    import threading
    import time

    from megatrain.runtime.optimizer_pipeline import DEVICE_GRADS, update_order
    from megatrain.runtime.schedule import gradient_order
    from test_noclip import step_without_clipping

    make_model_dir(tmp_path, "llama", seed=33, layers=6)
    inline = Megatrain(tmp_path, threaded_optimizer=False)
    piped = Megatrain(tmp_path, threaded_optimizer=True)
    lock, counts, waiting, order, before_return = threading.Lock(), {"put": 0, "done": 0}, [], [], []
    real_update, real_put = piped.opt.update, piped.pipeline.put

    def slow_update(tile, grad, **kw):
        time.sleep(0.02)
        real_update(tile, grad, **kw)
        with lock:
            counts["done"] += 1

    def put(unit, grad, to_host):
        real_put(unit, grad, to_host)
        with lock:
            counts["put"] += 1
            waiting.append(counts["put"] - counts["done"])

    piped.opt.update, piped.pipeline.put = slow_update, put
    piped.pipeline.add_before_update(order.append)
    n = len(piped.store.tiles)
    try:
        for step in range(3):
            batches = random_batches(2, 2, 97, [9, 12], seed=40 + step)
            a = step_without_clipping(inline, batches, 1e-3)
            b = step_without_clipping(piped, batches, 1e-3)
            before_return.append(counts["done"] - step * n)
            assert a == b
        piped.pipeline.drain()
    finally:
        piped.close()
        inline.close()
    assert max(waiting) == DEVICE_GRADS
    assert order == update_order(n, clipping=False) * 3 == gradient_order(n) * 3
    assert min(before_return) >= n - DEVICE_GRADS  # the rest of the step waited for these updates
    for x, y in zip(state(inline.store), state(piped.store)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("threaded", [True, False], ids=["worker-thread", "inline"])
def test_a_failing_update_during_backward_is_raised_not_hung(tmp_path, threaded):
    from megatrain.runtime import OptimizerThreadError
    from test_noclip import step_without_clipping

    make_model_dir(tmp_path, "llama", seed=34)
    mt = Megatrain(tmp_path, threaded_optimizer=threaded)

    def broken(tile, grad, **kw):
        raise RuntimeError("disk on fire")

    mt.opt.update = broken
    with pytest.raises((OptimizerThreadError, RuntimeError), match="disk on fire"):
        step_without_clipping(mt, random_batches(2, 2, 97, [9, 12], seed=1), 1e-3)
        mt.pipeline.drain()
    mt.runtime.close()


def test_a_step_without_clipping_is_finished_as_it_began(tmp_path):
    """finish_step must name the lr the updates ran at and no clip coefficient; a step whose gradients were never
    all handed over is refused before the next one begins."""
    from megatrain.runtime import MicroBatch

    make_model_dir(tmp_path, "llama", seed=35)
    mt = Megatrain(tmp_path)
    mbs = [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"])
           for b in random_batches(2, 2, 97, [9, 12], seed=2)]
    mt.pipeline.begin_step(lr=1e-3)
    mt.engine.train_step(mbs)
    with pytest.raises(ValueError, match="without clipping"):
        mt.pipeline.finish_step(lr=1e-3, clip_coef=0.5)
    mt.pipeline.begin_step(lr=1e-3)
    mt.engine.sink.put(1, torch.zeros(mt.store.tiles[1].numel), False)  # one unit only, then a new step
    with pytest.raises(RuntimeError, match="never finished"):
        mt.pipeline.begin_step(lr=1e-3)
    with pytest.raises(RuntimeError, match="no gradient for units"):
        mt.pipeline.finish_step(lr=1e-3, clip_coef=1.0)
    mt.close()
