"""The I/O pools' threads (checkpoint/fastio.Pool, the pretrained load's) run torch's CPU ops on themselves, not on
an OpenMP team each; the process's other threads keep theirs."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatrain.checkpoint import fastio
from megatrain.runtime.weights_load import _gomp, serial_torch


@pytest.mark.skipif(not _gomp(), reason="torch without libgomp: nothing to set")
def test_pool_threads_run_torch_on_themselves_and_others_keep_their_threads():
    before = torch.get_num_threads()
    seen = []
    lock = threading.Lock()

    def task():
        x = torch.randn(1 << 20)
        y = x.to(torch.bfloat16)  # a parallel op: on this thread alone
        with lock:
            seen.append((torch.get_num_threads(), torch.equal(y, x.to(torch.bfloat16))))
    with fastio.Pool(3) as pool:
        fastio.wait_all(pool, [pool.submit(task) for _ in range(6)])
    assert seen == [(1, True)] * 6
    assert torch.get_num_threads() == before  # this thread, and a new one, unchanged
    with ThreadPoolExecutor(1) as ex:
        assert ex.submit(torch.get_num_threads).result() == before
    with ThreadPoolExecutor(1, initializer=serial_torch) as ex:  # the pretrained load's pool
        assert ex.submit(torch.get_num_threads).result() == 1


def test_resume_casts_the_streaming_copy_in_pieces_on_the_pool(tmp_path, monkeypatch):
    """A resume's bf16 streaming copies, cast piece by piece on the pool as each unit is read, equal the whole
    units' casts."""
    from conftest import make_model_dir
    from megatrain.checkpoint import resume
    from megatrain.checkpoint.resume import load_store, open_checkpoint
    from megatrain.runtime.store import HostStore
    from test_checkpoint_io import random_store, save

    make_model_dir(tmp_path / "model", "llama", seed=31)
    store = random_store(tmp_path / "model", seed=32)
    ckpt = save(store, tmp_path / "ckpt")
    monkeypatch.setattr(resume, "CHUNK", 4 * 1000)  # pieces of 1000 values: many per unit, one ending mid-unit
    assert max(t.numel for t in store.tiles) > 3000
    fresh = HostStore(store.adapter, torch.bfloat16)
    load_store(open_checkpoint(ckpt), fresh, threads=4)
    assert torch.equal(fresh.master, store.master)
    for t in fresh.tiles:
        assert torch.equal(t.stream, t.master.to(torch.bfloat16))
