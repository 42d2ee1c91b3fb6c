"""The parallel checkpoint I/O (checkpoint/fastio.py): the pool's files are the single writer's bytes, a full disk
leaves the previous checkpoint and says where, a corrupted chunk is named, checkpoints with one sha256 per file
still resume, the exports equal the checkpoint's weights, and the parallel pretrained load equals a plain read."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import make_model_dir
from test_checkpoint_helpers import full_disk_after
from megatrain.checkpoint import CheckpointSaver, fastio, verify_checkpoint
from megatrain.checkpoint.export import export_checkpoint, export_store
from megatrain.checkpoint.layout import unit_file_name
from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.checkpoint.saver import unit_plan
from megatrain.checkpoint.tensorfile import TensorFileWriter, sha256_file
from megatrain.errors import MegatrainError
from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import weights_load
from megatrain.runtime.store import HostStore

SMALL = 64 << 10  # a chunk of a few pages: the tiny model's unit files span many chunks


def state(n: int) -> dict:
    return {"step": n, "loader": {}, "rng": {}, "config": {}}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(fastio, "CHUNK", SMALL)


def random_store(model_dir, seed: int = 0) -> HostStore:
    store = HostStore(get_adapter(load_hf_config(model_dir)), torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    for i, t in enumerate(store.tiles):  # the tiles (a unit's padding is not part of a checkpoint: it stays zero)
        for buf in (t.master, t.exp_avg, t.exp_avg_sq):
            buf.copy_(torch.randn(buf.shape, generator=g))
        t.step.fill_(i + 3)
        store.refresh_stream_copy(t)
    return store


def save(store, root, step=1, threads=None, model_dir=None):
    saver = CheckpointSaver(root, store, threads=threads)
    files = (lambda d: (d / "config.json").write_text((model_dir / "config.json").read_text())) if model_dir else None
    saver.save(step, state(step), files)
    return saver.wait()


def test_parallel_writer_files_are_the_single_writers_bytes(tmp_path, small_chunks):
    make_model_dir(tmp_path / "model", "qwen2", seed=1)
    store = random_store(tmp_path / "model")
    many = save(store, tmp_path / "many", threads=8)
    one = save(store, tmp_path / "one", threads=1)
    m8, m1 = (json.loads((p / "manifest.json").read_text()) for p in (many, one))
    assert m8["files"] == m1["files"]
    for i, t in enumerate(store.tiles):  # and the streaming single writer (SSD-tier saves) writes the same file
        name = unit_file_name(i, t.unit)
        w = TensorFileWriter(tmp_path / name, unit_plan(t), {"format": "pt", "unit": t.unit.name, "step": 1}, SMALL)
        for k in ("master", "exp_avg", "exp_avg_sq"):
            for v in t.views(getattr(t, k)).values():
                w.write(v)
        w.write(t.step)
        assert w.close() == m8["files"][name]
        data = (many / name).read_bytes()
        assert data == (one / name).read_bytes() == (tmp_path / name).read_bytes()
        assert len(m8["files"][name]["sha256_chunks"]) == -(-len(data) // SMALL) > 1
    fresh = HostStore(store.adapter, torch.bfloat16)
    load_store(open_checkpoint(many), fresh, threads=3)
    for a, b in zip((fresh.master, fresh.exp_avg, fresh.exp_avg_sq, fresh.stream),
                    (store.master, store.exp_avg, store.exp_avg_sq, store.stream)):
        assert torch.equal(a, b)
    assert [float(t.step) for t in fresh.tiles] == [float(t.step) for t in store.tiles]


def test_full_disk_keeps_the_previous_checkpoint_and_names_the_folder(tmp_path, monkeypatch, small_chunks):
    make_model_dir(tmp_path / "model", "llama", seed=2)
    store = random_store(tmp_path / "model")
    root = tmp_path / "ckpt"
    first = save(store, root, step=1)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    full_disk_after(monkeypatch, 5)  # ENOSPC after a few chunks
    saver = CheckpointSaver(root, store)
    saver.save(2, state(2))
    with pytest.raises(MegatrainError) as e:
        saver.wait()
    msg = str(e.value)
    assert "\n" not in msg and str(root / "step-2") in msg and "No space left on device" in msg
    assert sorted(p.name for p in root.iterdir()) == ["step-1"]  # no step-2, no .tmp left
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    verify_checkpoint(first)


def test_a_corrupted_or_truncated_chunk_is_named(tmp_path, small_chunks):
    make_model_dir(tmp_path / "model", "llama", seed=3)
    store = random_store(tmp_path / "model")
    ckpt = save(store, tmp_path / "ckpt")
    unit = ckpt / unit_file_name(1, store.tiles[1].unit)
    data = bytearray(unit.read_bytes())
    at = 3 * SMALL + 100  # inside the fourth chunk
    data[at] ^= 0x10
    unit.write_bytes(bytes(data))
    with pytest.raises(MegatrainError, match="checksum mismatch in bytes") as e:
        load_store(open_checkpoint(ckpt), HostStore(store.adapter, torch.bfloat16))
    assert str(unit) in str(e.value) and f"{3 * SMALL}-{4 * SMALL}" in str(e.value)
    with pytest.raises(MegatrainError, match="checksum mismatch"):
        verify_checkpoint(ckpt)
    unit.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(MegatrainError, match="truncated") as e:
        load_store(open_checkpoint(ckpt), HostStore(store.adapter, torch.bfloat16))
    assert str(unit) in str(e.value)


def test_a_checkpoint_with_one_sha256_per_file_still_resumes_and_exports(tmp_path):
    make_model_dir(tmp_path / "model", "qwen2", seed=4)
    store = random_store(tmp_path / "model")
    ckpt = save(store, tmp_path / "ckpt", model_dir=tmp_path / "model")
    m = json.loads((ckpt / "manifest.json").read_text())  # as format_version 1 wrote it
    m["format_version"] = 1
    for u in m["units"]:
        sha, size = sha256_file(ckpt / u["file"])
        m["files"][u["file"]] = {"sha256": sha, "bytes": size}
    (ckpt / "manifest.json").write_text(json.dumps(m))
    fresh = HostStore(store.adapter, torch.bfloat16)
    load_store(open_checkpoint(ckpt), fresh)
    assert torch.equal(fresh.master, store.master) and torch.equal(fresh.exp_avg_sq, store.exp_avg_sq)
    export_checkpoint(ckpt, tmp_path / "hf")
    assert_export_equals(tmp_path / "hf", store)
    unit = ckpt / m["units"][0]["file"]
    data = bytearray(unit.read_bytes())
    data[-3] ^= 1
    unit.write_bytes(bytes(data))
    with pytest.raises(MegatrainError, match="checksum mismatch") as e:
        load_store(open_checkpoint(ckpt), fresh)
    assert str(unit) in str(e.value)


def assert_export_equals(folder, store, dtype=torch.bfloat16):
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    seen = set()
    for t in store.tiles:
        for s, view in zip(t.unit.specs, t.views(t.master).values()):
            for name, part in s.split(view):
                with safe_open(str(folder / index[name]), framework="pt") as f:
                    got = f.get_tensor(name)
                assert got.dtype == dtype and torch.equal(got, part.to(dtype)), name
                seen.add(name)
    assert seen == set(index)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_exports_from_the_checkpoint_and_from_the_store_equal_its_weights(tmp_path, small_chunks, dtype):
    make_model_dir(tmp_path / "model", "llama", seed=5)
    store = random_store(tmp_path / "model", seed=9)
    ckpt = save(store, tmp_path / "ckpt", model_dir=tmp_path / "model")
    a = export_checkpoint(ckpt, tmp_path / "from-ckpt", dtype=dtype, max_shard_mb=0.05)  # several shards
    b = export_store(store, ckpt, tmp_path / "from-store", dtype=dtype, max_shard_mb=0.05)
    assert a["shards"] == b["shards"] > 2 and a["bytes"] == b["bytes"]
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    assert_export_equals(tmp_path / "from-ckpt", store, torch_dtype)
    for p in sorted((tmp_path / "from-ckpt").glob("*.safetensors")):  # the two writers' shards: the same bytes
        assert p.read_bytes() == (tmp_path / "from-store" / p.name).read_bytes()


def test_parallel_pretrained_load_equals_a_plain_read(tmp_path, monkeypatch):
    """Shards of bf16, fp16 and fp32 tensors (a mixed checkpoint), cut into pieces of a few elements, on 1 and 5
    threads: the masters equal the tensors cast to fp32, the streaming copies their bf16 casts."""
    make_model_dir(tmp_path / "model", "qwen2", seed=6)
    src = tmp_path / "model" / "model.safetensors"
    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    dtypes = [torch.bfloat16, torch.float16, torch.float32]
    mixed = {k: v.to(dtypes[i % 3]).contiguous() for i, (k, v) in enumerate(sorted(tensors.items()))}
    names = sorted(mixed)
    half = len(names) // 2
    src.unlink()
    save_file({k: mixed[k] for k in names[:half]}, str(tmp_path / "model" / "model-00001-of-00002.safetensors"))
    save_file({k: mixed[k] for k in names[half:]}, str(tmp_path / "model" / "model-00002-of-00002.safetensors"))
    monkeypatch.setattr(weights_load, "PIECE", 96)  # many pieces per tensor, some ending mid-row
    adapter = get_adapter(load_hf_config(tmp_path / "model"))
    for threads in (1, 5):
        store = HostStore(adapter, torch.bfloat16)
        stats = store.load_safetensors(tmp_path / "model", threads=threads, progress=False)
        assert stats["bytes"] == sum(v.numel() * v.element_size() for k, v in mixed.items()
                                     if k != "lm_head.weight" or not adapter.tied)
        for t in store.tiles:
            for s, view, sv in zip(t.unit.specs, t.views(t.master).values(), t.views(t.stream).values()):
                for (name, part), (_, spart) in zip(s.split(view), s.split(sv)):
                    assert torch.equal(part, mixed[name].to(torch.float32)), name
                    assert torch.equal(spart, part.to(torch.bfloat16))
