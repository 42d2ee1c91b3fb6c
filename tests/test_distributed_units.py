"""The pieces of a distributed run, in one process: shard ranges, each rank's share of the data, shard updates,
the node's shared memory and flags, torchrun's environment, and the plan of several ranks (per node)."""

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import make_model_dir
from megatrain.distributed.grads import ShardStore
from megatrain.distributed.shared import NodeFlags, NodeMemory
from megatrain.distributed.world import World, from_env, shard_part, shard_range
from megatrain.errors import MegatrainError
from megatrain.planner.memory import AUTOTUNE
from megatrain.runtime.adamw import CHUNK, CpuAdamW
from megatrain.runtime.store import ALIGN_ELEMS
from reference import Megatrain
from test_checkpoint_helpers import make_data, make_model_with_tokenizer, write_config


@pytest.mark.parametrize("numel", [1, 100, ALIGN_ELEMS * 3 + 5, 6208, 2 * CHUNK, 5 * CHUNK + 12345, 545_000_000])
@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_shards_cover_each_unit_once_on_aligned_boundaries(numel, parts):
    ranges = [shard_range(numel, parts, r) for r in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, disjoint
    s = shard_part(numel, parts)
    assert all(hi - lo == s for lo, hi in ranges[:-1])  # equal: what a reduce-scatter needs
    align = CHUNK if numel >= parts * CHUNK else ALIGN_ELEMS
    assert all(lo % align == 0 for lo, _ in ranges)
    assert numel - (parts - 1) * s < parts * align + s or parts == 1  # the remainder stays small


def test_torchrun_environment():
    assert from_env({}) is None
    assert from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None  # a world of one is a plain run
    w = from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1"})
    assert (w.rank, w.size, w.local_rank, w.local_size, w.node, w.nodes) == (5, 8, 1, 4, 1, 2)
    assert not w.writer and not w.fills_store
    with pytest.raises(MegatrainError, match="every node must run the same --nproc-per-node"):
        from_env({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"})


def loader(tmp_path, grad_accum: int, rank: int = 0, world: int = 1):
    from megatrain.config import load_config
    from megatrain.data import build_train_loader, load_tokenizer

    model = tmp_path / "model"
    if not model.is_dir():
        make_model_with_tokenizer(model)
        make_data(tmp_path / "train.jsonl", n=30)
    cfg = load_config(write_config(tmp_path / "cfg.yaml", model, tmp_path / "train.jsonl", tmp_path / "run",
                                   tmp_path / "cache"))
    return build_train_loader(cfg.data, load_tokenizer(str(model)), seed=0, micro_batch_size=2,
                              grad_accum_steps=grad_accum, rank=rank, world=world)


@pytest.mark.parametrize("group_by_length", [True, False])
def test_ranks_read_disjoint_parts_that_make_up_one_process_step(tmp_path, group_by_length):
    one = loader(tmp_path, 4)
    ranks = [loader(tmp_path, 2, rank=r, world=2) for r in range(2)]
    one.cfg.group_by_length = group_by_length
    for step in range(9):  # several epochs of 8 micro-batches: steps straddle their boundaries
        whole = one.next_step()
        parts = [b for ld in ranks for b in ld.next_step()]
        assert len(parts) == len(whole) == 4
        for a, b in zip(parts, whole):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
        states = [ld.state_dict() for ld in ranks]
        assert states[0] == states[1] and states[0]["world_size"] == 2
        assert {k: v for k, v in states[0].items() if k != "world_size"} == \
            {k: v for k, v in one.state_dict().items() if k != "world_size"}
    # a different world size continues at the same next micro-batch (resharded exactly)
    other = loader(tmp_path, 1, rank=3, world=4)
    other.load_state_dict(ranks[0].state_dict())
    assert torch.equal(other.next_step()[0]["input_ids"], one.next_step()[3]["input_ids"])


def test_shard_updates_make_the_whole_tile_update(tmp_path, monkeypatch):
    """Each rank's CpuAdamW on its shard (ShardStore: decay split and chunks shifted) = one update of the tile."""
    import megatrain.runtime.adamw

    monkeypatch.setattr(megatrain.runtime.adamw, "CHUNK", 512)
    make_model_dir(tmp_path, "qwen3", seed=3)
    whole, sharded = Megatrain(tmp_path, dtype=torch.bfloat16), Megatrain(tmp_path, dtype=torch.bfloat16)
    opt = CpuAdamW(weight_decay=0.1)
    parts = 3
    shard_stores = [ShardStore(sharded.store, [shard_range(t.numel, parts, r) for t in sharded.store.tiles])
                    for r in range(parts)]
    assert any(0 < s.tiles[1].unit.decay_numel < s.tiles[1].numel for s in shard_stores[1:])  # a shifted split
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        for i, t in enumerate(whole.store.tiles):
            grad = torch.randn(t.numel, generator=g)
            opt.update(t, grad.clone(), lr=1e-3, clip_coef=0.7)
            for r, ss in enumerate(shard_stores):
                lo, hi = shard_range(t.numel, parts, r)
                st = ss.tiles[i]
                opt.update(st, grad[lo:hi].clone(), lr=1e-3, clip_coef=0.7, new_step=(r == 0))
    for a, b in zip((whole.store.master, whole.store.exp_avg, whole.store.exp_avg_sq, whole.store.stream),
                    (sharded.store.master, sharded.store.exp_avg, sharded.store.exp_avg_sq, sharded.store.stream)):
        assert torch.equal(a, b)
    assert [t.step.item() for t in sharded.store.tiles] == [3.0] * len(sharded.store.tiles)


class DictStore:
    """The rendezvous store's get/set/check, in memory."""

    def __init__(self):
        self.d = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def check(self, keys):
        return all(k in self.d for k in keys)

    def get(self, k):
        return self.d[k]


def test_node_memory_is_shared_and_flags_wait(tmp_path):
    store = DictStore()
    first, second = World(0, 2, 0, 2, 0), World(1, 2, 1, 2, 0)
    a, b = NodeMemory(store, first), NodeMemory(store, second)
    x = a.allocate(10_000, torch.bfloat16)
    y = b.allocate(10_000, torch.bfloat16)  # local rank 1 maps local rank 0's memfd
    assert x.data_ptr() % 4096 == 0 and torch.count_nonzero(y) == 0  # fresh memory reads as zero
    x[1234] = 3.5
    assert y[1234].item() == 3.5 and x.data_ptr() != y.data_ptr()
    fa, fb = NodeFlags(a, 4, first), NodeFlags(b, 4, second)
    a.release_files(), b.release_files()
    fa.publish(2, 1)
    with pytest.raises(MegatrainError, match=r"local rank\(s\) \[1\] of node 0 have not updated unit 2 for step 1"):
        fa.wait_updated(2, 1, timeout=0.05)
    fb.publish(2, 1)
    fa.wait_updated(2, 1, timeout=0.05)  # both written: no wait
    fa.begin_save(7)
    t0 = time.monotonic()
    threading.Timer(0.1, lambda: fa.unit_written(7, 3)).start()
    fb.wait_written(3)  # the other rank waits for rank 0's writer, through shared memory
    assert time.monotonic() - t0 >= 0.09
    fb.wait_written(3)



def mapping_rss(name: str) -> list[int]:
    """Resident bytes of each of this process's mappings of the memfd `name`, in address order."""
    rss, current = [], False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:  # a mapping's header line
            current = line.rstrip().endswith(f"/memfd:{name} (deleted)")
        elif current and line.startswith("Rss:"):
            rss.append(int(line.split()[1]) * 1024)
    return rss


def test_node_memory_faults_in_each_ranks_share_at_allocation():
    """Each local rank faults in its own share of the pages when it maps them, leaving what they hold unchanged:
    Adam m and v, which nothing writes before the first update, are resident before the first step."""
    store = DictStore()
    first, second = World(0, 2, 0, 2, 0), World(1, 2, 1, 2, 0)
    a, b = NodeMemory(store, first), NodeMemory(store, second)
    numel = 8 * 2**20  # 32 MiB of fp32
    x = a.allocate(numel, torch.float32, what="populate test")
    x[-5:] = torch.arange(5.0)  # written before rank 1 maps and populates its half: kept
    y = b.allocate(numel, torch.float32, what="populate test")
    rss = mapping_rss("megatrain-populate-test")
    assert len(rss) == 2 and all(r >= numel * 4 // 2 - 4096 for r in rss), rss  # each rank's half, at least
    assert torch.equal(y[-5:], torch.arange(5.0)) and torch.count_nonzero(y[:-5]) == 0
    a.release_files(), b.release_files()
    del x, y
    one = NodeMemory(store, World(0, 1, 0, 1, 0))
    one.allocate(numel, torch.float32, what="populate whole")
    assert mapping_rss("megatrain-populate-whole") == [numel * 4]  # a node of one rank: every page


# ---- the plan of several ranks ------------------------------------------------------------------------------------
def plan_config(tmp_path) -> Path:
    """A tiny model, its data and a CUDA bf16 config (planned from config.json: no GPU needed)."""
    model = tmp_path / "model"
    if not model.is_dir():
        make_model_with_tokenizer(model)
        make_data(tmp_path / "train.jsonl")
    return write_config(tmp_path / "cfg.yaml", model, tmp_path / "train.jsonl", tmp_path / "run", tmp_path / "cache",
                        train={"device": "cuda", "precision": "bf16"})


def plan_out(tmp_path, capsys, *args) -> tuple[int, str, str]:
    """`megatrain plan CONFIG ARGS` in this process (the command line's own code): exit status, stdout, stderr."""
    from megatrain.cli import main

    cfg = plan_config(tmp_path)
    capsys.readouterr()
    rc = main(["plan", str(cfg), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def plan_json(tmp_path, capsys, *args):
    rc, out, err = plan_out(tmp_path, capsys, *args)
    assert rc in (0, 1), err
    return json.loads(out) if "--json" in args else out


def test_plan_of_several_ranks_is_per_node(tmp_path, capsys):
    one = plan_json(tmp_path, capsys, "--json")
    two = plan_json(tmp_path, capsys, "--json", "--nproc-per-node", "2")
    four = plan_json(tmp_path, capsys, "--json", "--nproc-per-node", "2", "--nnodes", "2")
    params = one["params"]
    assert one["world"] == {"nodes": 1, "ranks_per_node": 1, "world_size": 1,
                            "global_tokens_per_step": one["tokens_per_step"]}
    # the store once per node, what each rank allocates for itself twice
    store = [k for k in two["host"] if k.endswith(", one per node")]
    assert len(store) == 4 and sum(two["host"][k] for k in store) == pytest.approx(
        sum(one["host"][k[: -len(", one per node")]] for k in store))
    per_rank = [k for k in two["host"] if k.endswith(" x 2 ranks")]
    # one process tunes the kernels on a copy before its store exists (engine.tune_first: auto); the ranks of a
    # torchrun do not, and each holds the autotuner's block in its first step
    tuned = AUTOTUNE + " x 2 ranks"
    assert AUTOTUNE not in one["host"] and two["host"][tuned] > 0
    assert per_rank and all(two["host"][k] == pytest.approx(2 * one["host"][k[: -len(" x 2 ranks")]])
                            for k in per_rank if k != tuned)
    assert two["gpu_peak_gib"] == one["gpu_peak_gib"]  # per GPU: as one GPU
    w = four["world"]
    assert w["world_size"] == 4 and w["global_tokens_per_step"] == 4 * one["tokens_per_step"]
    assert w["intra_node_gib_per_rank"] * 2**30 == pytest.approx(4 * params * 1 / 2)  # 4 B/param (L-1)/L
    assert w["inter_node_gib_per_node"] * 2**30 == pytest.approx(8 * params * 1 / 2)  # 8 B/param (N-1)/N
    assert two["world"]["inter_node_gib_per_node"] == 0
    assert four["step_time_s"] >= one["step_time_s"]
    assert four["tokens_per_s"] == pytest.approx(4 * one["tokens_per_s"] * one["step_time_s"] / four["step_time_s"])
    text = plan_json(tmp_path, capsys, "--nnodes", "2", "--nproc-per-node", "2")
    assert "world: 2 nodes x 2 ranks = 4 ranks" in text and "host RAM above is per node" in text


def test_plan_refuses_a_bad_world_flag(tmp_path, capsys):
    rc, _, err = plan_out(tmp_path, capsys, "--nproc-per-node", "0")
    last = err.strip().splitlines()[-1]  # after argparse's usage line
    assert rc == 2 and last.startswith("megatrain: error: argument --nproc-per-node:"), err
    assert "Traceback" not in err


def test_the_workers_keep_the_callers_python_path(monkeypatch):
    """The launched workers find the repository first and still whatever the caller's PYTHONPATH held (the GPU
    machines' carried wheels: pydantic, datasets); replacing it failed every torchrun test there."""
    from dist_helpers import ROOT, env
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    assert env()["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert env()["PYTHONPATH"] == str(ROOT)
