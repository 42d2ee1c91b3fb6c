"""Start-up phases that run at once (run/startup.py): the host store's allocation and fill beside the kernels'
tuning on a copy of the model, only where the plan says host RAM holds both; their timing said honestly."""

import threading

import pytest

GiB = 2**30


def test_beside_returns_the_work_and_its_laps_and_raises_its_error_on_the_caller():
    from megatrain.run.startup import Beside

    seen = {}

    def work(lap):
        seen["thread"] = threading.current_thread().name
        lap("one")
        lap("two")
        return 42

    b = Beside(work)
    assert b.result() == 42 and [k for k, _ in b.laps] == ["one", "two"] and all(v >= 0 for _, v in b.laps)
    assert seen["thread"] != threading.current_thread().name

    def fails(lap):
        raise MemoryError("no room")

    with pytest.raises(MemoryError, match="no room"):
        Beside(fails).result()


def test_overlapped_phases_keep_their_names_and_add_the_wall_time():
    from megatrain.run.startup import overlapped_phases

    out = overlapped_phases(("tuned", 5.0), [("store allocated", 1.0), ("store filled", 3.0)], 5.5)
    assert list(out) == ["tuned", "store allocated", "store filled",
                         "wall time of the 3 phases above, which ran at once"]
    assert out["wall time of the 3 phases above, which ran at once"] == 5.5


def test_the_store_is_filled_beside_the_tuning_only_where_host_ram_holds_both():
    """Qwen2.5-7B, 158 x 1024 on CUDA, tuned first: the copy's phase (23.5 GiB: its store, the autotuner's block,
    the process's runtime) beside the store's 99.3 GiB fits 123.3 GiB (the H100 host's available memory) but not
    110; no known available memory, or no plan: one after the other. The plan counts the start's peak: the store
    and the copy's phase at once where they run at once (above the run's own peak), the run's own peak where not."""
    from dataclasses import replace
    from pathlib import Path

    from megatrain.models import get_adapter, load_hf_config
    from megatrain.planner.memory import TUNE_COPY
    from megatrain.planner.plan import make_plan
    from megatrain.planner.profile import load_profile
    from megatrain.planner.tune_copy import copy_host
    from megatrain.planner.workload import Workload
    from megatrain.run.startup import overlap_fits
    from megatrain.runtime.store import padded_numel

    qwen = get_adapter(load_hf_config(str(Path(__file__).resolve().parents[1] / "bench" / "model-configs" /
                                          "qwen2.5-7b")))
    w = Workload((79, 79), 1024, compile=True, tune_first=True)
    store = 14 * sum(padded_numel(u.numel) for u in qwen.units())  # fp32 master, m, v; bf16 streaming copy
    assert store / GiB == pytest.approx(99.3, abs=0.01)
    both = store + sum(copy_host(qwen, w)[1].values())
    plan = make_plan(qwen, w, load_profile(None), host_available=123.3 * GiB, suggest=False)
    assert plan.host_total == pytest.approx(both) and plan.host[TUNE_COPY] > 0  # the start's peak: both at once
    assert any("while the store is allocated and filled beside it" in n for n in plan.notes)
    apart = make_plan(qwen, w, load_profile(None), host_available=110 * GiB, suggest=False)
    assert TUNE_COPY not in apart.host and apart.host_total < both  # one after the other: the run's own peak
    assert any("before the store is allocated" in n for n in apart.notes)
    for avail, fits in ((123.3 * GiB, True), (110 * GiB, False), (both, True), (both - 1, False), (None, False)):
        assert overlap_fits(replace(plan, host_available=avail), qwen) is fits, avail
    assert overlap_fits(None, qwen) is False


def test_the_copys_store_has_no_adam_states_and_its_optimizer_changes_nothing():
    """run/tune_first.py's copy: a store without Adam m and v (HostStore adam_states=False: None in the tiles, not
    counted in its bytes) whose optimizer (NoUpdate) leaves it as it was after a step; the bf16 streaming copy and
    the fp32 master are there as in a run's store."""
    import torch
    from conftest import tiny_hf_config

    from megatrain.models import get_adapter
    from megatrain.run.tune_first import NoUpdate
    from megatrain.runtime import HostStore, MicroBatch, RuntimeOptions, build_runtime
    from megatrain.runtime.store import padded_numel

    adapter = get_adapter(tiny_hf_config("llama", layers=2))
    full = HostStore(adapter, torch.bfloat16)
    store = HostStore(adapter, torch.bfloat16, adam_states=False)
    elems = sum(padded_numel(u.numel) for u in adapter.units())
    assert store.host_bytes() == 6 * elems and full.host_bytes() == 14 * elems
    assert all(t.exp_avg is None and t.exp_avg_sq is None and t.master is not None for t in store.tiles)
    assert store.exp_avg.numel() == 0 and store.exp_avg_sq.numel() == 0
    store.init_random(3, 0.02)
    master, stream = store.master.clone(), store.stream.clone()
    runtime = build_runtime(store, torch.device("cpu"), NoUpdate(), RuntimeOptions())
    try:
        ids = torch.randint(0, adapter.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        runtime.pipeline.begin_step(lr=None)
        loss = runtime.engine.train_step([MicroBatch.from_labels(ids, ids.clone())]).loss_sum.item()
        runtime.pipeline.finish_step(lr=1e-2, clip_coef=1.0)
        runtime.pipeline.drain()
    finally:
        runtime.close()
    assert loss > 0 and torch.equal(store.master, master) and torch.equal(store.stream, stream)
