"""`megatrain export CHECKPOINT` pipelined (checkpoint/export_stream.py): chunks read in pieces smaller than a chunk,
on several threads, give the checkpoint's weights and the bytes of the export from the store; a corrupted chunk of
masters fails the export, names the file and its bytes, and leaves no folder; the read size stays within a unit."""

import pytest
import torch

from conftest import make_model_dir
from megatrain.checkpoint import export_stream, fastio
from megatrain.checkpoint.export import export_checkpoint, export_store
from megatrain.checkpoint.layout import unit_file_name
from megatrain.errors import MegatrainError
from megatrain.runtime.pinned import PAGE
from test_checkpoint_io import SMALL, assert_export_equals, random_store, save


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(fastio, "CHUNK", SMALL)  # unit files of many chunks ...
    monkeypatch.setattr(export_stream, "PIECE", 2 * PAGE)  # ... each read in several pieces
    monkeypatch.setattr(export_stream, "MIN_PIECE", PAGE)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_pipelined_export_equals_the_weights_and_the_store_export(tmp_path, small_pieces, threads, dtype):
    make_model_dir(tmp_path / "model", "qwen2", seed=11)
    store = random_store(tmp_path / "model", seed=12)
    ckpt = save(store, tmp_path / "ckpt", model_dir=tmp_path / "model")
    a = export_checkpoint(ckpt, tmp_path / "a", dtype=dtype, max_shard_mb=0.03, threads=threads)
    b = export_store(store, ckpt, tmp_path / "b", dtype=dtype, max_shard_mb=0.03)
    assert a["shards"] == b["shards"] > 2 and a["bytes"] == b["bytes"]
    assert_export_equals(tmp_path / "a", store, torch.bfloat16 if dtype == "bf16" else torch.float32)
    for p in sorted((tmp_path / "a").glob("*.safetensors")):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()
    assert not list(tmp_path.glob(".a*"))  # no partial folder left


def test_a_corrupted_master_chunk_fails_the_export_and_is_named(tmp_path, small_pieces):
    make_model_dir(tmp_path / "model", "llama", seed=13)
    store = random_store(tmp_path / "model")
    ckpt = save(store, tmp_path / "ckpt", model_dir=tmp_path / "model")
    unit = ckpt / unit_file_name(1, store.tiles[1].unit)
    data = bytearray(unit.read_bytes())
    at = SMALL + 3 * PAGE + 7  # the second chunk, its second piece: masters (the file's first third)
    assert at < len(data) // 3
    data[at] ^= 0x08
    unit.write_bytes(bytes(data))
    with pytest.raises(MegatrainError) as e:
        export_checkpoint(ckpt, tmp_path / "out", threads=3)
    msg = str(e.value)
    assert "\n" not in msg and str(unit) in msg and f"checksum mismatch in bytes {SMALL}-{2 * SMALL}" in msg
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    unit.write_bytes(bytes(data[: len(data) // 4]))  # truncated: named before anything is read
    with pytest.raises(MegatrainError, match="truncated") as e:
        export_checkpoint(ckpt, tmp_path / "out")
    assert str(unit) in str(e.value) and not (tmp_path / "out").exists()


def test_read_size_stays_within_half_a_unit_over_the_threads():
    assert export_stream.piece_bytes(10 << 30, 16) == export_stream.PIECE  # a real model's unit: full requests
    for largest, threads in ((15 << 20, 2), (15 << 20, 8), (200 << 20, 16)):
        n = export_stream.piece_bytes(largest, threads)
        assert n % PAGE == 0 and export_stream.MIN_PIECE <= n <= export_stream.PIECE
        assert n * threads <= max(largest // 2, export_stream.MIN_PIECE * threads)
