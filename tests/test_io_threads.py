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
