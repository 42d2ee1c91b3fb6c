"""Several ranks on CPU with gloo, launched by torchrun for real: `torchrun --nproc-per-node=2` (and 4), and two
"nodes" of two on this machine (two torchruns, a static rendezvous on localhost). The same global batch gives the same
losses and parameters as one process (fp32, 1e-6 relative: only the order of the sums differs), dense and MoE; the
checkpoint is written once and exports; a rank killed with -9 ends every rank within 60 s, naming it; resume on the
same world is bit-exact; SIGTERM to one rank saves and exits 0 everywhere; a hung rank is named; a rank that raises is
named.

Tiny models, few steps: four processes share the CI machine's two cores."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dist_helpers import failure_text, finish, kill_all, run_ok, torchrun, wait_for, workers
from reference import rel
from test_checkpoint_helpers import losses, run, setup_run, unit_hashes

STEPS = 6
TOL = 1e-6


def masters(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("unit-*.safetensors")):
        out.update({k: v for k, v in load_file(f).items() if k.startswith("master/")})
    return out


def assert_same_run(dist_out: Path, single_out: Path) -> None:
    """Losses and every parameter within TOL relative: the distributed run trained what one process trains."""
    a, b = losses(dist_out), losses(single_out)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for s in a:
        assert abs(a[s] - b[s]) <= TOL * abs(b[s]), (s, a[s], b[s])
    ma, mb = masters(dist_out / "checkpoints" / f"step-{STEPS}"), masters(single_out / "checkpoints" / f"step-{STEPS}")
    assert ma.keys() == mb.keys()
    worst = max(ma, key=lambda k: rel(ma[k], mb[k]))
    assert rel(ma[worst], mb[worst]) <= TOL, (worst, rel(ma[worst], mb[worst]))


def exported_tensors(export: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(export.glob("*.safetensors")) for k, v in load_file(f).items()}


def single_process(tmp_path: Path, cfg: Path, grad_accum: int) -> Path:
    out = tmp_path / "single"
    run(cfg, f"output.dir={out}", f"train.grad_accum_steps={grad_accum}")
    return out


PLACED = {"grads_to_host": 2, "wave_groups": 2, "group_grads": "host"}  # shards sent to host, accumulators parked


@pytest.mark.parametrize("family,tied,memory,clip", [("qwen3_moe", False, {}, 1.0), ("qwen3", True, PLACED, 1.0),
                                                     ("llama", False, {}, None)],
                         ids=["qwen3_moe", "qwen3-tied-placed", "llama-noclip"])
def test_two_ranks_train_what_one_process_trains(tmp_path, family, tied, memory, clip):
    """A dense and a MoE family, tied and untied, the default placement and one that sends shards to the host,
    with clipping and without (clip None: train.max_grad_norm null, each shard's update queued as soon as its
    reduction is). Each case is a torchrun and a process of its own (~13 s of CI): one per combination that
    reaches other code, not the full product."""
    cfg = setup_run(tmp_path, family, tied, train={"steps": STEPS, "grad_accum_steps": 2, "max_grad_norm": clip},
                    memory=memory,
                    checkpoint={"every": 3, "keep": 0}, export={"at_end": True, "dtype": "fp32"})
    text = run_ok(cfg)
    out = tmp_path / "run"
    assert "global batch: up to 256 tokens per step over 1 node x 2 ranks = 2 ranks" in text
    single = single_process(tmp_path, cfg, grad_accum=4)  # the same global batch in one process
    assert_same_run(out, single)
    # one checkpoint per save, written by rank 0, naming the world; its export equals one process's export
    ckpts = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert ckpts == ["step-3", f"step-{STEPS}"]
    manifest = json.loads((out / "checkpoints" / f"step-{STEPS}" / "manifest.json").read_text())
    assert manifest["world"] == {"world_size": 2, "nodes": 1, "ranks_per_node": 2}
    assert json.loads((out / "checkpoints" / "step-3" / "run_state.json").read_text())["loader"]["world_size"] == 2
    exported, ref = exported_tensors(out / "export"), exported_tensors(single / "export")
    assert exported.keys() == ref.keys() and all(rel(exported[k], ref[k]) <= TOL for k in ref)
    if family == "qwen3_moe":  # the router loss and expert counts are the world's
        rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]
        ref_rec = [json.loads(line) for line in (single / "metrics.jsonl").read_text().splitlines() if "loss" in line]
        for r, q in zip(rec, ref_rec):
            assert abs(r["router_loss"] - q["router_loss"]) <= TOL * abs(q["router_loss"])
            assert r["tokens"] == q["tokens"]


@pytest.fixture(scope="module")
def two_by_two(tmp_path_factory):
    """An uninterrupted run of two nodes of two ranks (one micro-batch each), and its config."""
    tmp = tmp_path_factory.mktemp("2x2")
    cfg = setup_run(tmp, train={"steps": STEPS, "grad_accum_steps": 1}, checkpoint={"every": 2, "keep": 0})
    run_ok(cfg, nproc=2, nnodes=2)
    return tmp, cfg


@pytest.fixture(scope="module")
def one_process_of_four(two_by_two):
    """One process with the 4 ranks' global batch (4 micro-batches per step): the reference of every 4-rank layout."""
    tmp, cfg = two_by_two
    return single_process(tmp, cfg, grad_accum=4)


def test_two_nodes_of_two_ranks_train_what_one_process_trains(two_by_two, one_process_of_four):
    tmp, cfg = two_by_two
    assert_same_run(tmp / "run", one_process_of_four)
    manifest = json.loads((tmp / "run" / "checkpoints" / f"step-{STEPS}" / "manifest.json").read_text())
    assert manifest["world"] == {"world_size": 4, "nodes": 2, "ranks_per_node": 2}


def test_four_ranks_of_one_node_train_what_one_process_trains(two_by_two, one_process_of_four, tmp_path):
    """`torchrun --nproc-per-node=4` (the 4-GPU machine's layout, bench/calls/next-x4-scaling.sh): one shared store,
    every unit's gradient reduce-scattered in four shards (the layers' four non-empty; the embedding's and head's,
    under 4 x 2048 elements, all on the last rank, so ranks with an empty shard of a unit are exercised too), each
    rank's AdamW on its own part; the same losses and parameters as one process with the same global batch."""
    from megatrain.distributed.world import shard_range
    from megatrain.models import get_adapter
    from transformers import AutoConfig

    tmp, cfg = two_by_two  # its model and config (the one-process reference is shared), output elsewhere
    units = get_adapter(AutoConfig.from_pretrained(tmp / "model")).units()
    sizes = [[hi - lo for lo, hi in (shard_range(u.numel, 4, r) for r in range(4))] for u in units]
    assert all(min(s) > 0 for s in sizes[1:-1]) and sizes[0][:3] == sizes[-1][:3] == [0, 0, 0], sizes
    out = tmp_path / "run"
    text = run_ok(cfg, f"output.dir={out}", "checkpoint.every=0", nproc=4)
    assert "over 1 node x 4 ranks = 4 ranks" in text
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step-{STEPS}"]
    manifest = json.loads((out / "checkpoints" / f"step-{STEPS}" / "manifest.json").read_text())
    assert manifest["world"] == {"world_size": 4, "nodes": 1, "ranks_per_node": 4}
    assert_same_run(out, one_process_of_four)


def test_resume_on_another_world_size_continues_the_same_data(two_by_two, tmp_path, capsys):
    """A 4-rank checkpoint resumed by one process with the same global batch: the same next micro-batches, so the
    same losses and parameters as the 4 ranks' own continuation, within the order of the sums."""
    ref_tmp, cfg = two_by_two
    out = tmp_path / "one"
    run(cfg, f"output.dir={out}", f"resume={ref_tmp / 'run' / 'checkpoints' / 'step-2'}", "train.grad_accum_steps=4")
    assert "world size 4 -> 1: the data continues at the next micro-batch" in capsys.readouterr().err
    a, b = losses(out), losses(ref_tmp / "run")
    assert sorted(a) == list(range(3, STEPS + 1))
    assert all(abs(a[s] - b[s]) <= TOL * abs(b[s]) for s in a), (a, b)
    ma, mb = masters(out / "checkpoints" / f"step-{STEPS}"), masters(ref_tmp / "run" / "checkpoints" / f"step-{STEPS}")
    assert max(rel(ma[k], mb[k]) for k in mb) <= TOL


def test_a_killed_rank_ends_every_rank_and_resume_is_exact(two_by_two, tmp_path):
    ref_tmp, cfg = two_by_two  # its model and config, output elsewhere
    out = tmp_path / "run"
    procs = torchrun(cfg, f"output.dir={out}", nproc=2, nnodes=2, extra_env={"MEGATRAIN_TEST_SAVE_DELAY_S": 0.3})
    try:
        wait_for(lambda: (out / "checkpoints" / "step-2" / "manifest.json").is_file(), procs, what="step-2 saved")
        victim = workers(procs)[3]  # on the second node: the first node's torchrun never hears of it
        killed_at = time.monotonic()
        victim.kill()
        results = finish(procs, timeout=90)
        elapsed = time.monotonic() - killed_at
    finally:
        kill_all(procs)
    assert elapsed < 60, elapsed
    for rc, text in results:
        assert rc != 0
        assert f"rank 3 (process {victim.pid}" in text and "died" in text, text[-3000:]
    assert losses(out).keys() <= set(range(1, STEPS))  # it did not finish
    run_ok(cfg, f"output.dir={out}", "resume=auto", nproc=2, nnodes=2)
    assert losses(out) == losses(ref_tmp / "run")  # bit for bit: the same world, the same order of sums
    assert unit_hashes(out / "checkpoints" / f"step-{STEPS}") == unit_hashes(ref_tmp / "run" / "checkpoints" /
                                                                             f"step-{STEPS}")


def test_sigterm_to_one_rank_saves_and_every_rank_exits_0(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 40, "grad_accum_steps": 1, "lr_schedule": "constant"},
                    checkpoint={"every": 0, "at_end": False})
    out = tmp_path / "run"
    procs = torchrun(cfg, extra_env={"MEGATRAIN_TEST_SAVE_DELAY_S": 0.05})
    try:
        wait_for(lambda: len(losses(out)) >= 3 if (out / "metrics.jsonl").is_file() else False, procs,
                 what="3 steps")
        workers(procs)[1].terminate()
        ((rc, text),) = finish(procs, timeout=60)
    finally:
        kill_all(procs)
    assert rc == 0, text[-3000:]
    stopped = max(losses(out))
    assert stopped < 40 and f"stopped by SIGTERM after step {stopped}" in text
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{stopped}"]
    # resumed on the same world, it continues exactly where an uninterrupted run of the same world would be
    run_ok(cfg, "resume=auto", f"train.steps={stopped + 2}", "checkpoint.at_end=true")
    ref = tmp_path / "ref"
    run_ok(cfg, f"output.dir={ref}", f"train.steps={stopped + 2}", "checkpoint.at_end=true")
    assert losses(out) == losses(ref)
    assert unit_hashes(out / "checkpoints" / f"step-{stopped + 2}") == \
        unit_hashes(ref / "checkpoints" / f"step-{stopped + 2}")


def test_a_hung_rank_is_named_and_ends_the_others(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 100000, "grad_accum_steps": 1}, checkpoint={"at_end": False})
    out = tmp_path / "run"
    procs = torchrun(cfg, extra_env={"MEGATRAIN_HEARTBEAT_TIMEOUT_S": 5})
    try:
        wait_for(lambda: (out / "metrics.jsonl").is_file() and len(losses(out)) >= 2, procs, what="2 steps")
        w = workers(procs)
        w[1].suspend()  # SIGSTOP: alive, silent; the collectives it owes never come
        t0 = time.monotonic()
        w[0].wait(timeout=40)  # (a non-child: no exit status here; torchrun's report below has it)
        elapsed = time.monotonic() - t0
        w[1].kill()  # (torchrun would wait 30 s for the stopped rank to obey its SIGTERM)
        procs[0].wait(timeout=60)
    finally:
        kill_all(procs)
    text = procs[0].communicate()[0]
    assert elapsed < 20, elapsed  # the 5 s heartbeat timeout, and a few ticks
    assert "megatrain: error: stopping: rank 1 has not responded for" in text, text[-3000:]
    assert f"exitcode  : 1 (pid: {w[0].pid})" in text and procs[0].returncode != 0


def test_a_rank_that_raises_is_named_on_every_rank(tmp_path):
    # a sitecustomize that makes rank 1's optimizer raise at its third update (test-only: nothing in megatrain)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    from megatrain.runtime import adamw\n"
        "    real, calls = adamw.CpuAdamW.update, []\n"
        "    def update(self, *a, **k):\n"
        "        calls.append(1)\n"
        "        if len(calls) == 3 * 5:\n"
        "            raise RuntimeError('injected optimizer failure')\n"
        "        return real(self, *a, **k)\n"
        "    adamw.CpuAdamW.update = update\n")
    cfg = setup_run(tmp_path, train={"steps": 20, "grad_accum_steps": 1}, checkpoint={"at_end": False})
    root = Path(__file__).resolve().parents[1]
    procs = torchrun(cfg, extra_env={"PYTHONPATH": f"{hook}{os.pathsep}{root}"})
    ((rc, text),) = finish(procs, timeout=120)
    assert rc != 0
    assert "[rank1]: RuntimeError: injected optimizer failure" in text, failure_text(text)  # rank 1's own report
    assert "megatrain: error: stopping: rank 1 (node 0, local rank 1): OptimizerThreadError: the optimizer thread " \
           "failed: RuntimeError: injected optimizer failure" in text, text[-3000:]  # rank 0's


def test_bad_input_is_one_line_from_one_rank(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 2})
    (tmp_path / "bad.jsonl").write_text('{"text": "abc"}\n{"text": 5\n')
    ((rc, text),) = finish(torchrun(cfg, f"data.path={tmp_path / 'bad.jsonl'}"), timeout=120)
    errors = [line for line in text.splitlines() if "megatrain: error:" in line]
    assert rc != 0 and len(errors) == 1, text[-3000:]
    assert "bad.jsonl:2" in errors[0] and "]: Traceback" not in text  # (torchrun's own report follows)
    assert not (tmp_path / "run").exists()  # nothing written
