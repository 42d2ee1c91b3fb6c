"""bench/bench_cli.py's host bytes per parameter of a distributed run: the node's, not one rank's."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_cli import node_host_per_param  # noqa: E402


def test_a_distributed_runs_bytes_per_param_are_the_nodes():
    res = {"params": 7_615_616_512, "host_node_pss_gib": 118.8, "host_bytes_per_param": 9.83}
    got = node_host_per_param(res, nproc=4)
    assert got["host_bytes_per_param"] == pytest.approx(118.8 * 2**30 / 7_615_616_512)  # 16.7, not rank 0's 9.8
    assert got["host_bytes_per_param_of"] == "node PSS"
    assert node_host_per_param(res, nproc=1) == {}  # one process: its own peak RSS stays the figure
    assert node_host_per_param({"params": 10, "host_node_pss_gib": 0.0}, nproc=2) == {}  # nothing sampled
