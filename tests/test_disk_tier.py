"""The SSD tier (memory.disk_path, runtime/disk_tier.py): states placed on disk leave host RAM, and training with them
there is bit for bit the all-RAM run, with and without clipping, whichever subset of (v, m, master) is on disk; the
tier's cache, read-ahead and write-behind keep the files consistent; O_DIRECT where the filesystem allows it."""

import pytest
import torch

from conftest import make_model_dir
from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, MicroBatch, RuntimeOptions, build_runtime
from megatrain.runtime.adamw import CHUNK, clip_coefficient
from megatrain.runtime.disk_tier import DEPTH, DiskTier, probe_direct
from megatrain.runtime.pinned import aligned_empty
from reference import random_batches

KINDS = ("master", "exp_avg", "exp_avg_sq")


class Run:
    """The runtime as the trainer builds it, on CPU, with the given states on the SSD tier."""

    def __init__(self, model_dir, dtype, disk_path=None, disk_states=(), threaded=None):
        adapter = get_adapter(load_hf_config(model_dir))
        self.store = HostStore(adapter, dtype, dtype, disk_path=disk_path, disk_states=tuple(disk_states))
        self.store.load_safetensors(model_dir)
        self.runtime = build_runtime(self.store, "cpu", CpuAdamW(eps=1e-8, weight_decay=0.1),
                                     RuntimeOptions(engine=EngineOptions(), threaded_optimizer=threaded))
        self.engine, self.pipeline = self.runtime.engine, self.runtime.pipeline

    def step(self, batches, clip: bool, lr: float = 2e-3) -> tuple[float, float]:
        mbs = [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b.get("attention_mask")) for b in batches]
        if not clip:
            self.pipeline.begin_step(lr=lr)
        out = self.engine.train_step(mbs)
        norm = out.grad_sq_norm.sqrt().item()
        self.pipeline.finish_step(lr=lr, clip_coef=clip_coefficient(norm, 0.5) if clip else 1.0)
        return out.loss_sum.item(), norm

    def states(self) -> list[torch.Tensor]:
        """Every unit's master, m, v (wherever they live), its streaming copy and its step count."""
        self.pipeline.drain()
        out = []
        for i, t in enumerate(self.store.tiles):
            with self.store.unit_state(i) as st:
                out += [st[k].clone() for k in KINDS]
            out += [t.stream.clone(), t.step.clone()]
        return out

    def close(self):
        self.runtime.close()
        self.store.close()


def train(run: Run, clip: bool, steps: int = 3, vocab: int = 97):
    return [run.step(random_batches(2, 2, vocab, [9, 14], seed=500 + s), clip) for s in range(steps)]


CASES = [(torch.float32, ("v",)), (torch.float32, ("v", "m")), (torch.bfloat16, ("v",)),
         (torch.bfloat16, ("v", "m")), (torch.bfloat16, ("v", "m", "master"))]


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "noclip"])
@pytest.mark.parametrize("dtype,disk_states", CASES, ids=lambda c: str(c).replace("torch.", ""))
def test_disk_tier_is_bit_identical_to_ram(tmp_path, clip, dtype, disk_states):
    """Three steps with the states on disk equal the all-RAM run bit for bit: losses, norms, every master, Adam m
    and v, streaming copy and step count; the store's RAM shrinks by 4 B/param per kind moved."""
    make_model_dir(tmp_path / "model", "llama", seed=5)
    ram = Run(tmp_path / "model", dtype)
    base = train(ram, clip)
    want = ram.states()
    ram.close()
    (tmp_path / "ssd").mkdir()
    disk = Run(tmp_path / "model", dtype, tmp_path / "ssd", disk_states)
    assert train(disk, clip) == base
    got = disk.states()
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    tier = disk.store.disk
    assert set(tier.kinds) == {{"v": "exp_avg_sq", "m": "exp_avg", "master": "master"}[k] for k in disk_states}
    for k in tier.kinds:
        assert getattr(disk.store, k).numel() == 0 and all(getattr(t, k) is None for t in disk.store.tiles)
    moved = 4 * disk.store.total_elems * len(disk_states)
    assert disk.store.host_bytes() == ram.store.host_bytes() - moved + tier.cache_bytes
    stats = tier.take_stats()
    n = sum(u.numel for u in disk.store.units)
    assert stats["write_bytes"] >= 3 * 4 * n * len(disk_states)  # every state written back every step
    assert stats["read_bytes"] > 0
    folder = tier.dir
    assert folder.is_dir() and len(list(folder.glob("*.bin"))) == len(disk.store.tiles) * len(disk_states)
    disk.close()
    assert not folder.exists()  # scratch files removed


def test_multi_piece_units_threaded_worker_buffered(tmp_path, monkeypatch, capfd):
    """Units larger than one piece (a 20,000-token vocabulary: the embedding and head span two pieces of CHUNK
    elements), updates on the worker thread, a filesystem refusing O_DIRECT (as tmpfs on older kernels: buffered
    I/O, with a one-line notice): still bit-identical, through a fixed ring of cache slots."""
    import megatrain.runtime.disk_tier as dt

    make_model_dir(tmp_path / "model", "qwen3", seed=9, vocab=20000, layers=2)
    ram = Run(tmp_path / "model", torch.bfloat16, threaded=True)
    base = train(ram, True, steps=2, vocab=20000)
    want = ram.states()
    ram.close()
    monkeypatch.setattr(dt, "probe_direct", lambda folder: "Invalid argument")
    (tmp_path / "ssd").mkdir()
    disk = Run(tmp_path / "model", torch.bfloat16, tmp_path / "ssd", ("v", "m", "master"), threaded=True)
    tier = disk.store.disk
    assert tier.refused == "Invalid argument"
    notice = [line for line in capfd.readouterr().err.splitlines() if "O_DIRECT" in line]
    assert len(notice) == 1 and "buffered I/O" in notice[0] and str(tmp_path / "ssd") in notice[0]
    assert tier.piece == CHUNK and len(tier.pieces(0)) == 2
    assert tier.cache_bytes == (DEPTH + 2) * 3 * 4 * CHUNK  # a fixed ring of slots, whatever the model
    assert train(disk, True, steps=2, vocab=20000) == base
    got = disk.states()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    disk.close()


def filesystem(path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it in /proc/mounts)."""
    best, kind = "", ""
    for line in open("/proc/mounts"):
        _, mount, fstype = line.split()[:3]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fstype
    return kind


def test_o_direct_on_this_disk_and_round_trip(tmp_path):
    """On a disk filesystem (ext4/xfs) O_DIRECT is used; pieces written behind are read back exactly, from the cache
    or the file, and write_unit then read_unit round-trips whole units of uneven size."""
    numels = [3 * 2**20 + 5, 1000, 2**20]
    tier = DiskTier(tmp_path, ("exp_avg_sq", "exp_avg"), numels, piece=2**20, depth=1)
    if filesystem(tmp_path) in ("ext4", "xfs", "btrfs"):
        assert tier.refused is None and probe_direct(tmp_path) is None  # a disk: O_DIRECT
    g = torch.Generator().manual_seed(0)
    want = {}
    for i, n in enumerate(numels):
        for k in tier.kinds:
            src = aligned_empty(tier.file_bytes(i) // 4, torch.float32, zero=True)
            src[:n].normal_(generator=g)
            tier.write_unit(i, k, src)
            want[(i, k)] = src[:n].clone()
    # a pass of updates in some order: each piece doubled in place, written behind
    tier.set_order([2, 0, 1])
    for u in (2, 0, 1):
        for a, n in tier.pieces(u):
            st = tier.acquire(u, a)
            for k in tier.kinds:
                assert torch.equal(st[k], want[(u, k)][a:a + n])
                st[k].mul_(2)
            tier.release(u, a)
    for i, n in enumerate(numels):
        for k in tier.kinds:
            out = aligned_empty(tier.file_bytes(i) // 4, torch.float32, zero=True)
            tier.read_unit(i, k, out)
            assert torch.equal(out[:n], 2 * want[(i, k)])
    tier.flush()
    st = tier.take_stats()
    assert st["write_bytes"] >= 2 * 4 * sum(numels) * 2 and st["read_busy_s"] > 0
    assert max(st["read_busy_s"], st["write_busy_s"]) <= st["any_busy_s"] <= st["read_busy_s"] + st["write_busy_s"]
    tier.close()


def test_cache_waits_for_a_slot_when_every_one_is_in_use(tmp_path):
    """A ring of depth + 2 = 3 slots with all three pieces acquired: the fourth acquire waits (no error) until one is
    released, then reads its piece exactly."""
    import threading

    tier = DiskTier(tmp_path, ("exp_avg_sq",), [2**20] * 4, piece=2**20, depth=1)
    for i in range(4):
        src = aligned_empty(2**20, torch.float32, zero=False)
        src.fill_(float(i))
        tier.write_unit(i, "exp_avg_sq", src)
    held = [tier.acquire(i, 0)["exp_avg_sq"] for i in (0, 2, 1)]
    assert [float(h[0]) for h in held] == [0.0, 2.0, 1.0]
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("v", tier.acquire(3, 0)["exp_avg_sq"].clone()))
    t.start()
    t.join(timeout=0.5)
    assert t.is_alive()  # every slot is in use: it waits
    tier.release(2, 0)
    t.join(timeout=10)
    assert not t.is_alive() and torch.equal(got["v"], torch.full((2**20,), 3.0))
    for i in (0, 1, 3):
        tier.release(i, 0)
    tier.close()


def test_never_written_pieces_are_zeros_without_a_read(tmp_path):
    """Adam m and v start as holes in the tier's files: the first pass reads none of them from the disk (zeros
    filled in RAM, counted as no read, even into a slot or buffer that held other values; at most its end reads
    ahead the next pass's first piece, which it wrote), while the pass after it,
    whose pieces were written behind, reads every piece the cache no longer holds; read_unit likewise."""
    numels = [3 * 2**20 + 5, 2**20]
    tier = DiskTier(tmp_path, ("exp_avg_sq", "exp_avg"), numels, piece=2**20, depth=1)
    for s in tier.slots:  # stale values in every cache slot: a hole must not show them
        for b in s.bufs.values():
            b.fill_(7.0)
    order = [1, 0]
    tier.set_order(order)

    def one_pass(add: float) -> list[float]:
        seen = []
        for u in order:
            for a, _ in tier.pieces(u):
                st = tier.acquire(u, a)
                seen += [float(st[k].abs().max()) for k in tier.kinds]
                for k in tier.kinds:
                    st[k].add_(add)
                tier.release(u, a)
        tier.flush()
        return seen

    reads = []  # (unit, offset) of every read request issued
    unit_of = {fd: u for (u, _), fd in tier.fds.items()}
    io = tier._io

    def spy(fd, mv, offset, write):
        if not write:
            reads.append((unit_of[fd], offset // 4))
        return io(fd, mv, offset, write)

    tier._io = spy
    assert one_pass(1.0) == [0.0] * 2 * (4 + 1)  # every piece of both kinds: zeros
    first = tier.take_stats()
    # No hole is read. The read-ahead is cyclic: the pass's last releases may read ahead the next pass's first
    # piece (depth 1: unit 1's only piece), which this pass wrote; whether they do depends on whether a slot's
    # write has completed by then (so the bytes are 0 or that piece of both kinds: 8 MiB).
    assert set(reads) <= {(1, 0)}, reads
    assert first["read_bytes"] == (2 * 4 * numels[1] if reads else 0), (first, reads)
    assert first["write_bytes"] >= 2 * 4 * sum(numels)
    assert one_pass(1.0) == [1.0] * 2 * (4 + 1)  # what the first pass wrote
    second = tier.take_stats()
    assert second["read_bytes"] >= 2 * 4 * (sum(numels) - 3 * 2**20)  # at most the 3 slots' pieces were cached
    out = aligned_empty(tier.file_bytes(0) // 4, torch.float32, zero=False).fill_(5.0)
    tier.read_unit(0, "exp_avg", out)
    assert torch.equal(out[:numels[0]], torch.full((numels[0],), 2.0))
    tier.close()
    fresh = DiskTier(tmp_path, ("exp_avg",), numels, piece=2**20, depth=1)
    out.fill_(5.0)
    fresh.read_unit(0, "exp_avg", out)
    assert torch.equal(out[:numels[0]], torch.zeros(numels[0])) and fresh.take_stats()["read_bytes"] == 0
    src = aligned_empty(fresh.file_bytes(1) // 4, torch.float32, zero=False).fill_(3.0)
    fresh.write_unit(1, "exp_avg", src)  # written: from now on read from the file
    out1 = aligned_empty(fresh.file_bytes(1) // 4, torch.float32, zero=True)
    fresh.read_unit(1, "exp_avg", out1)
    assert torch.equal(out1[:numels[1]], src[:numels[1]]) and fresh.take_stats()["read_bytes"] >= 4 * numels[1]
    fresh.close()
