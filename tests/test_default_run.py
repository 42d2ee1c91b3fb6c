"""The README's main command: `megatrain train` with the embedded default learns its task."""

import json
import os
import subprocess
import sys
import time


def test_default_run_learns(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.time()
    # no arguments at all: the embedded demo, writing to runs/default under the working directory
    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "train"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    elapsed = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(l) for l in (tmp_path / "runs" / "default" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in records if "loss" in x]
    evals = [x for x in records if "eval_exact_match" in x]
    assert len(steps) == 300
    assert {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"} <= set(steps[0])
    # the command line times its start-up from the process's start: the config read, then the imports
    startup = steps[0]["startup_s"]
    assert list(startup)[:3] == ["process start to config read", "imports (torch, transformers)",
                                 "inputs checked and planned"]
    assert all(v >= 0 for v in startup.values())
    assert "start-up: process start to config read " in r.stderr and ", imports (torch, transformers) " in r.stderr
    assert steps[-1]["loss"] <= 0.5 * steps[0]["loss"]
    assert evals[-1]["eval_exact_match"] > evals[0]["eval_exact_match"]
    assert evals[-1]["eval_loss"] <= 0.5 * evals[0]["eval_loss"]
    print(f"default run: {elapsed:.0f}s, loss {steps[0]['loss']:.3f} -> {steps[-1]['loss']:.4f}, "
          f"held-out exact match {evals[0]['eval_exact_match']:.2f} -> {evals[-1]['eval_exact_match']:.2f}")
