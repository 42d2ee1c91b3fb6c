"""train.precision: auto resolves to bf16 where the device computes it natively, fp32 elsewhere; the start summary
and `megatrain plan` say which and why; an explicit bf16 on a CPU without bf16 instructions runs, with its cost."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import megatrain.planner.precision as precision
from megatrain.planner.precision import Bf16Support, precision_line, resolve_precision
from megatrain.planner.report import render
from test_inputs import setup  # noqa: F401  (a fixture)

NATIVE = Bf16Support(True, "this CPU has avx512_bf16")
EMULATED = Bf16Support(False, "this CPU has no bf16 instructions (amx_bf16, avx512_bf16)")


@pytest.fixture
def cpu(monkeypatch):
    """Set what this CPU is taken to compute: cpu(NATIVE) or cpu(EMULATED)."""
    return lambda support: monkeypatch.setattr(precision, "cpu_bf16", lambda: support)


def test_auto_is_bf16_on_a_cpu_with_bf16_instructions_and_fp32_without(cpu):
    cpu(NATIVE)
    assert resolve_precision("auto", "cpu") == "bf16"
    assert precision_line("bf16", "cpu") == "precision: bf16: this CPU has avx512_bf16, bf16 runs natively"
    cpu(EMULATED)
    assert resolve_precision("auto", "cpu") == "fp32"
    assert precision_line("fp32", "cpu") == ("precision: fp32: this CPU has no bf16 instructions (amx_bf16, "
                                             "avx512_bf16), bf16 would be emulated")
    for given in ("bf16", "fp32"):  # an explicit precision is kept, whatever the CPU
        assert resolve_precision(given, "cpu") == given


def test_explicit_bf16_without_bf16_instructions_says_the_cost(cpu):
    cpu(EMULATED)
    line = precision_line("bf16", "cpu", bf16_slowdown=7.25)
    assert line.startswith("precision: bf16, as set, but this CPU has no bf16 instructions")
    assert "torch emulates bf16, 7.2x the time of fp32 per layer, measured here (auto or fp32 runs fp32)" in line
    assert "~10x slower than fp32" in precision_line("bf16", "cpu")  # not measured: the typical cost
    cpu(NATIVE)
    assert precision_line("fp32", "cpu") == ("precision: fp32, as set (this CPU has avx512_bf16: train.precision "
                                             "auto would choose bf16)")


def test_aten_cpu_capability_avx2_turns_bf16_off():
    """ATEN_CPU_CAPABILITY=avx2 (torch's kernels) with ONEDNN_MAX_CPU_ISA=AVX2 (its matmuls) is a CPU without bf16
    instructions, on any x86 machine: auto is fp32 there."""
    code = ("from megatrain.planner.precision import *; import json; "
            "print(json.dumps([resolve_precision('auto', 'cpu'), precision_line('fp32', 'cpu')]))")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    resolved, line = json.loads(r.stdout)
    assert resolved == "fp32"
    assert line.startswith("precision: fp32: this CPU") and line.endswith("bf16 would be emulated")


def test_the_config_default_is_auto_and_the_demo_uses_it():
    import yaml

    from megatrain.config import DEFAULT_CONFIG, TrainConfig

    assert TrainConfig().precision == "auto"
    assert yaml.safe_load(Path(DEFAULT_CONFIG).read_text())["train"]["precision"] == "auto"


@pytest.mark.parametrize("support", [NATIVE, EMULATED], ids=["bf16-cpu", "avx2-cpu"])
def test_the_plan_and_the_run_resolve_auto_once(setup, monkeypatch, cpu, support):
    """The plan's workload, its line, the run's config (config.json, what a checkpoint records) and the start
    summary all hold the resolved precision."""
    from megatrain.config import load_config
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.planner import plan_for_config
    from megatrain.run.trainer import train
    from test_inputs import write_config

    cpu(support)
    expected = "bf16" if support.native else "fp32"
    tmp_path, model_dir, data = setup
    cfg_path = write_config(tmp_path, model_dir, data, precision="auto", device="cpu")
    cfg = load_config(cfg_path)
    plan = plan_for_config(cfg, get_adapter(load_hf_config(str(model_dir))), "cpu")
    assert cfg.train.precision == "auto" and plan.workload.precision == expected  # the plan does not change cfg
    assert plan.precision_why == precision_line(expected, "cpu") and plan.precision_why in render(plan)
    lines = []
    monkeypatch.setattr("megatrain.run.metrics.MetricsLogger.info", lambda self, msg: lines.append(msg))
    train(cfg)
    assert cfg.train.precision == expected
    assert json.loads((tmp_path / "out" / "config.json").read_text())["train"]["precision"] == expected
    assert any(precision_line(expected, "cpu") in m for m in lines), lines

