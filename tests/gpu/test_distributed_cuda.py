"""The distributed path on CUDA (NCCL), issue 13.

    python3 -m pytest -q -m gpu tests/gpu/test_distributed_cuda.py     (two GPUs for the torchrun tests)

1. One process, one GPU: the optimizer pipeline over one rank's shards (distributed/grads.py's ShardStore) with the
   CUDA landing-buffer path, for a rank whose shard of small units is empty: every unit's Adam step advances and is
   marked ready (an empty shard is one empty piece), and the shard's updated weights equal the CPU update of those
   elements; nothing outside the shard changes.
2. torchrun --nproc-per-node=2 on two GPUs (NCCL reduce-scatter, the comm stream, the shared pinned store), fp32:
   losses and parameters equal one GPU running the same global batch within 1e-6 relative, as the CPU/gloo tests.
3. kill -9 of rank 1 while rank 0 waits in NCCL (which, unlike gloo, never fails on a dead peer): every rank exits
   non-zero within 60 s and rank 0 names rank 1 (the watchdog).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import make_model_dir
from dist_helpers import finish, kill_all, run_ok, torchrun, wait_for, workers
from gpu_results import write_result
from megatrain.distributed.grads import ShardStore
from megatrain.distributed.world import shard_range
from megatrain.runtime import CpuAdamW, HostStore, PinnedHost
from megatrain.runtime.optimizer_pipeline import OptimizerPipeline
from megatrain.models import get_adapter, load_hf_config
from reference import rel
from test_checkpoint_helpers import losses, run, setup_run

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices")


def store_of(model_dir) -> HostStore:
    s = HostStore(get_adapter(load_hf_config(model_dir)), torch.float32)
    s.load_safetensors(model_dir)
    return s


@pytest.mark.parametrize("rank", [0, 3])
def test_shard_pipeline_on_cuda_including_empty_shards(tmp_path, rank):
    make_model_dir(tmp_path, "llama", seed=5)
    parts = 4  # the tiny embedding and head (~6k elements) go whole to the last rank: ranks 0-2 hold none of them
    ref, mine = store_of(tmp_path), store_of(tmp_path)
    ranges = [shard_range(t.numel, parts, rank) for t in mine.tiles]
    assert (rank == 0) == any(lo == hi for lo, hi in ranges)
    opt = CpuAdamW(weight_decay=0.1)
    pinned = PinnedHost(True)
    pipe = OptimizerPipeline(ShardStore(mine, ranges), opt, torch.device("cuda"), pinned, threaded=True)
    try:
        g = torch.Generator().manual_seed(1)
        grads = [torch.randn(t.numel, generator=g) for t in ref.tiles]
        for t, grad in zip(ref.tiles, grads):
            opt.update(t, grad.clone(), lr=1e-3, clip_coef=0.5)
        for i, ((lo, hi), grad) in enumerate(zip(ranges, grads)):
            pipe.put(i, grad[lo:hi].cuda(), False)
        pipe.finish_step(lr=1e-3, clip_coef=0.5)
        pipe.drain()
    finally:
        pipe.close()
        pinned.close()
    before = store_of(tmp_path)
    for t, r, b, (lo, hi) in zip(mine.tiles, ref.tiles, before.tiles, ranges):
        assert t.step.item() == 1.0  # empty shards too
        if hi > lo:
            assert rel(t.master[lo:hi], r.master[lo:hi]) <= 1e-6 and rel(t.exp_avg[lo:hi], r.exp_avg[lo:hi]) <= 1e-6
        assert torch.equal(t.master[:lo], b.master[:lo]) and torch.equal(t.master[hi:], b.master[hi:])


@two_gpus
def test_two_gpus_train_what_one_gpu_trains(tmp_path):
    steps = 6
    cfg = setup_run(tmp_path, train={"steps": steps, "grad_accum_steps": 2, "device": "cuda"},
                    engine={"compile": "off"})
    text = run_ok(cfg)
    assert "1 node x 2 ranks" in text
    single = tmp_path / "single"
    run(cfg, f"output.dir={single}", "train.grad_accum_steps=4")
    a, b = losses(tmp_path / "run"), losses(single)
    worst_loss = max(abs(a[s] - b[s]) / abs(b[s]) for s in b)
    from safetensors.torch import load_file

    def masters(d: Path):
        return {k: v for f in sorted((d / "checkpoints" / f"step-{steps}").glob("unit-*.safetensors"))
                for k, v in load_file(f).items() if k.startswith("master/")}

    ma, mb = masters(tmp_path / "run"), masters(single)
    worst_param = max(rel(ma[k], mb[k]) for k in mb)
    write_result("distributed_cuda", "test_two_gpus_train_what_one_gpu_trains",
                 {"max_rel_loss_diff": worst_loss, "worst_param_rel_diff": worst_param, "steps": steps})
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    assert worst_loss <= 1e-6 and worst_param <= 1e-6, (worst_loss, worst_param)


@two_gpus
def test_a_killed_rank_ends_the_nccl_run(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 100000, "grad_accum_steps": 1, "device": "cuda"},
                    engine={"compile": "off"}, checkpoint={"at_end": False})
    out = tmp_path / "run"
    procs = torchrun(cfg)
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(losses(out)) >= 3, procs, timeout=300,
                 what="3 steps")
        victim = workers(procs)[1]
        t0 = time.monotonic()
        victim.kill()
        ((rc, text),) = finish(procs, timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        kill_all(procs)
    write_result("distributed_cuda", "test_a_killed_rank_ends_the_nccl_run", {"seconds_to_exit": elapsed})
    assert rc != 0 and elapsed < 60, elapsed
    assert f"rank 1 (process {victim.pid}" in text, text[-3000:]
