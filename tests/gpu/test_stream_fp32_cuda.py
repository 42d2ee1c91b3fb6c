"""fp32 streaming on CUDA (memory.stream_dtype=fp32): the fp32 master crosses the bus in pieces through a staging
buffer and is cast into the bf16 slot on the H2D stream. The slot must hold exactly what the bf16 host copy would
(round to nearest even, the copy's rounding), however the tile is cut into pieces, and training must follow.

    python3 -m pytest -q -m gpu tests/gpu/test_stream_fp32_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)
"""

from __future__ import annotations

import math

import pytest
import torch
from gpu_results import write_result
from test_placement_cuda import batches, make_model

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, Placement, RuntimeOptions, build_runtime, engine
from megatrain.runtime.adamw import clip_coefficient
from megatrain.runtime.store import store_dtypes

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)
STEPS = 3


def runtime_for(path: str, stream: str):
    adapter = get_adapter(load_hf_config(path))
    store = HostStore(adapter, *store_dtypes("bf16", stream))
    store.load_safetensors(path)
    return build_runtime(store, "cuda", CpuAdamW(weight_decay=0.1),
                         RuntimeOptions(engine=EngineOptions(placement=Placement(stream_dtype=stream))))


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("stream_fp32"))
    make_model(p)
    return p


def test_slots_hold_the_bf16_copy_exactly(path, monkeypatch):
    monkeypatch.setattr(engine, "STAGE_ELEMS", 1 << 20)  # a layer (7.1M elements) crosses in 7 pieces
    rt = runtime_for(path, "fp32")
    try:
        e = rt.engine
        assert e.cast_on_device and e.staging.numel() == 1 << 20
        for units in ((0,), (1,), (12,), (13,)):
            loaded = e._fetch(units)
            weights = e._acquire(loaded)
            torch.cuda.synchronize()
            for i, w in zip(units, weights):
                expect = e.tiles[i].views(e.tiles[i].master.to(torch.bfloat16))
                for k in w:
                    assert w[k].dtype == torch.bfloat16 and torch.equal(w[k].cpu(), expect[k]), (i, k)
            e._release(loaded)
    finally:
        rt.close()


def test_training_follows_bf16_streaming(path):
    record = {}
    for stream in ("bf16", "fp32"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rt = runtime_for(path, stream)
        losses = []
        try:
            for step in range(STEPS):
                out = rt.engine.train_step(batches(step))
                losses.append(out.loss_sum.item())
                rt.pipeline.finish_step(lr=3e-4, clip_coef=clip_coefficient(math.sqrt(out.grad_sq_norm.item()), 1.0))
            rt.pipeline.drain()
            torch.cuda.synchronize()
            record[stream] = {"losses": losses, "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                              "host_bytes": rt.store.host_bytes()}
        finally:
            rt.close()
    write_result("gpu_stream_fp32", __file__, record)
    a, b = record["bf16"]["losses"], record["fp32"]["losses"]
    # the same bf16 weights in the slots: only the attention backward's atomics differ between two runs
    assert max(abs(x - y) / abs(y) for x, y in zip(b, a)) <= 1e-3, record
    assert record["fp32"]["host_bytes"] < record["bf16"]["host_bytes"]
