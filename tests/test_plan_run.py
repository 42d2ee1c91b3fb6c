"""The plan in the run: the start summary carries its figures, each step's record the measured ones, and running
out of GPU or host memory ends with one message naming the component, not a traceback."""

import contextlib
import io
import json
import sys
from types import SimpleNamespace

import pytest
import torch

from megatrain.config import load_config
from megatrain.errors import MegatrainError
from megatrain.run.metrics import MetricsLogger


def default_cfg(tmp_path, *overrides):
    return load_config(None, [f"output.dir={tmp_path / 'run'}", "train.steps=3", "train.eval_every=0",
                              "train.exact_match_path=", *overrides])


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """One 3-step run of the demo (its folder and what it wrote to stderr), read by the two tests below."""
    from megatrain.run.trainer import train

    tmp = tmp_path_factory.mktemp("demo")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        train(default_cfg(tmp))
    return tmp, err.getvalue()


def test_start_summary_and_step_records(demo_run):
    tmp_path, err = demo_run
    assert "tokens per step: up to 2,048 (2 micro-batches of 32 rows x 32 tokens)" in err
    assert "plan: host RAM" in err and "s/step" in err and "bound by" in err
    assert "eta=" in err and "tok/s=" in err and "host=" in err  # plain lines (not a terminal)
    steps = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "loss" in r]
    assert len(steps) == 3
    for r in steps:
        assert {"loss", "grad_norm", "lr", "tokens_per_s", "tflops_6n", "host_rss_gib", "eta_s"} <= set(r)
        assert r["host_rss_gib"] > 0.05
    assert steps[-1]["eta_s"] == 0
    # the CPU AdamW's work since the record before (the updates of the step before, at least): its in-run rate
    for r in steps[1:]:
        assert r["optimizer_update_s"] > 0 and r["optimizer_copy_wait_s"] >= 0
        assert r["optimizer_gparams_per_s"] > 0
    assert "mfu" not in steps[0] and "busy_compute" not in steps[0]  # CPU: no GPU peak, no streams
    # where the start-up went, phase by phase: in the summary and with this process's first step only
    startup = steps[0]["startup_s"]
    assert list(startup)[:3] == ["inputs checked and planned", "store allocated", "store filled (random init)"]
    assert all(v >= 0 for v in startup.values()) and "startup_s" not in steps[1]
    assert "start-up: inputs checked and planned " in err and "store filled (random init) " in err


def test_the_run_saves_its_plan_and_the_benchmark_holds_it_against_the_measurement(demo_run, tmp_path):
    """`megatrain train` writes the plan it made at its start to output.dir/plan.json (`megatrain plan --json`'s
    object: placement, predicted step time and memory); bench/bench_cli.py records it with the run, and
    bench/plan_vs_measured.py compares that plan with what the run measured."""
    from pathlib import Path

    plan = json.loads((demo_run[0] / "run" / "plan.json").read_text())
    assert plan["fits"] and plan["step_time_s"] > 0 and plan["host_peak_gib"] > 0
    assert {"checkpoint_every", "seq_tile", "attn_block", "wave_groups"} <= set(plan["placement"])
    bench = Path(__file__).resolve().parents[1] / "bench"
    sys.path.insert(0, str(bench))
    from bench_cli import planned
    from plan_vs_measured import compare, load_results

    got = planned(demo_run[0] / "run" / "plan.json")
    assert got["placement"] == plan["placement"] and got["plan"]["step_time_s"] == plan["step_time_s"]
    assert planned(tmp_path / "nothing.json") == {}
    result = {"label": "tiny-cli", "step_s": 2 * plan["step_time_s"], "gpu_peak_gib": 1.0, "gpu_idle": 0.1,
              "host_peak_rss_gib": plan["host_peak_gib"] / 2, "device": "cuda", **got}
    (tmp_path / "r.json").write_text(json.dumps({"command": "bench/bench_cli.py --model m", "result": result}))
    rows = [compare(r) for r in load_results(tmp_path)]
    assert len(rows) == 1 and rows[0]["time_err"] == pytest.approx(-0.5) and rows[0]["host_err"] == pytest.approx(1.0)
    assert "the run's own plan" in rows[0]["bound"]


def test_progress_line_shows_throughput_memory_and_streams(tmp_path):
    out = io.StringIO()
    log = MetricsLogger(tmp_path, total_steps=10, stream=out)
    log.stats = lambda rec: {"mfu": 0.41, "gpu_peak_gib": 48.2, "host_rss_gib": 102.5, "busy_compute": 0.98,
                             "busy_h2d": 0.03, "busy_d2h": 0.031}
    log.log({"step": 1, "loss": 2.5, "grad_norm": 1.0, "lr": 1e-5, "tokens": 161792, "tokens_per_s": 9104.7,
             "step_time_s": 17.77, "tflops_6n": 416.0})
    log.close()
    line = out.getvalue()
    for part in ("TFLOP/s=416", "MFU=41.0%", "gpu=48.2G", "host=102.5G", "busy c/h2d/d2h=0.98/0.03/0.03", "eta="):
        assert part in line, line
    rec = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert rec["mfu"] == 0.41 and rec["busy_d2h"] == 0.031 and "eta_s" in rec


def test_wandb_when_enabled(tmp_path, monkeypatch):
    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(tmp_path, total_steps=2, stream=io.StringIO())
    log.enable_wandb({"train": {"lr": 1e-5}})
    log.log({"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 1e-5, "tokens_per_s": 10.0, "note": "text"})
    log.close()
    assert calls[0][0] == "init" and calls[0][1]["config"] == {"train": {"lr": 1e-5}}
    assert calls[1][:2] == ("log", 1) and calls[1][2]["loss"] == 2.0 and "note" not in calls[1][2]
    assert calls[-1] == ("finish",)
    # not installed: a warning, and the run goes on
    monkeypatch.setitem(sys.modules, "wandb", None)
    out = io.StringIO()
    (tmp_path / "b").mkdir()
    log = MetricsLogger(tmp_path / "b", total_steps=2, stream=out)
    log.enable_wandb()
    assert "wandb package is not installed" in out.getvalue() and log.wandb is None
    log.close()


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of "
                                 "139.81 GiB of which 3.2 GiB is free.")


@pytest.mark.parametrize("phase,component", [
    ("backward", "layer activations (recompute + backward of one micro-batch)"),
    ("forward", "layer activations of the forward wave"),
    ("head", "the LM head chunk + loss"),
])
def test_gpu_out_of_memory_names_the_component(tmp_path, monkeypatch, phase, component):
    import megatrain.runtime.engine
    from megatrain.run.prefetch import PreparedStep, prepare_step
    from megatrain.run.trainer import prepare, train_step

    run = prepare(default_cfg(tmp_path))
    try:
        if phase == "head":
            monkeypatch.setattr(megatrain.runtime.engine, "head_loss", _oom)
        else:
            eager = run.engine.layer

            def layer(w, h, c):
                if torch.is_grad_enabled() == (phase == "backward"):
                    _oom()
                return eager(w, h, c)

            run.engine.layer = layer
        with pytest.raises(MegatrainError) as e:
            batches = run.loader.next_step()
            train_step(run, 0, PreparedStep(batches, prepare_step(batches, pin=False), {}))
    finally:
        run.runtime.close()
    msg = str(e.value)
    assert msg.startswith(f"GPU out of memory at step 1, allocating {component}"), msg
    assert "Tried to allocate 20.00 GiB" in msg and "Traceback" not in msg
    assert e.value.__suppress_context__  # the CLI prints this one message


def test_host_allocation_failure_names_the_component(tmp_path, monkeypatch):
    import megatrain.runtime.store
    from megatrain.run.trainer import prepare

    def no_memory(numel, dtype, zero):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 30461468672 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(megatrain.runtime.store, "aligned_empty", no_memory)
    with pytest.raises(MegatrainError) as e:
        prepare(default_cfg(tmp_path))
    msg = str(e.value)
    assert msg.startswith("host RAM ran out, allocating the host store (fp32 master, Adam m and v, streaming copy)")
    assert "the plan expected" in msg and "GiB available" in msg
    # other errors are not dressed up as memory errors
    monkeypatch.setattr(megatrain.runtime.store, "aligned_empty", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="^other$"):
        prepare(default_cfg(tmp_path))
