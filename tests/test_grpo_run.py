"""GRPO through `megatrain train` and `megatrain plan` on the demo's tiny-llama (random init) and the reversal
prompts: the step records carry what TRL logs, the plan has a rollout phase, a run killed with SIGKILL in the
middle of a rollout batch and continued with resume=auto equals the uninterrupted run (losses, rewards, final
weights and optimizer states), and a reward that raises stops the run with one line naming it and the row."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from megatrain.cli import main
from megatrain.config import DEFAULT_CONFIG, load_config
from test_checkpoint_helpers import losses, records, unit_hashes
from test_preference_run_resume import kill_when, logged_steps, start

DEFAULTS = DEFAULT_CONFIG.parent
TRL = ("reward", "reward_std", "frac_reward_zero_std", "rewards/regex/mean", "rewards/regex/std",
       "completions/mean_length", "completions/min_length", "completions/max_length", "completions/clipped_ratio",
       "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl", "rollout_s", "logps_s",
       "train_s", "rollout_tokens_per_s")


def grpo_config(tmp: Path, **sections) -> Path:
    """grpo on the demo model: 4 prompts x 4 completions a rollout batch = 2 optimizer steps of 2 x 4 rows, a KL
    term to the step-0 copy, the reward "the completion contains an a" (dense enough to move a random model)."""
    cfg = {"model": {"path": str(DEFAULTS / "tiny-llama"), "init": "random"},
           "data": {"path": str(DEFAULTS / "reverse-train.jsonl"), "format": "prompt",
                    "columns": {"prompt": "instruction"}, "max_seq_len": 32, "cache_dir": str(tmp / "cache")},
           "train": {"objective": "grpo", "steps": 6, "micro_batch_size": 4, "grad_accum_steps": 2,
                     "precision": "fp32", "lr": 3e-3, "lr_schedule": "constant", "device": "cpu"},
           "grpo": {"prompts_per_rollout": 4, "num_generations": 4, "max_new_tokens": 8, "beta": 0.05,
                    "rewards": [{"name": "regex", "pattern": "a"}]},
           "output": {"dir": str(tmp / "run")}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(cfg: Path, *overrides: str) -> dict:
    from megatrain.run.trainer import train as run

    return run(load_config(cfg, list(overrides)))


def test_grpo_trains_and_logs_what_trl_logs(tmp_path, capsys):
    cfg = grpo_config(tmp_path)
    train(cfg)
    steps = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        assert all(math.isfinite(r[k]) for k in TRL + ("loss",)), r
        assert 0.0 <= r["reward"] <= 1.0 and 1 <= r["completions/min_length"] <= r["completions/max_length"] <= 8
        assert r["rollout_mode"] == "resident"
        assert 0 < r["rollout_prefill_s"] and 0 < r["rollout_decode_step_median_s"] <= r["rollout_decode_step_max_s"]
    # a rollout batch feeds 2 optimizer steps: the rollout and log-prob times land on its first step only
    assert [r["rollout_batch"] for r in steps] == [1, 1, 2, 2, 3, 3]
    assert all(r["rollout_s"] > 0 and r["logps_s"] > 0 for r in steps[0::2])
    assert all(r["rollout_prefill_s"] + r["rollout_decode_step_max_s"] < r["rollout_s"] for r in steps[0::2])
    assert all(r["rollout_s"] == 0 == r["logps_s"] for r in steps[1::2])
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: the policy is the reference
    assert any(r["grad_norm"] > 0 for r in steps)
    err = capsys.readouterr().err
    assert "(2 micro-batches of 4 rows x 32 tokens)" in err and "reward=" in err


def test_plan_has_the_rollout_phase(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "no-cache"))
    assert main(["plan", str(grpo_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "rollout (grpo): resident" in out and "KV cache" in out and "step with rollout" in out


def test_kill_9_in_a_rollout_batch_then_resume_equals_the_uninterrupted_run(tmp_path):
    """Killed after step 3's checkpoint (the first step of the second rollout batch: the batch travels with the
    checkpoint), resumed to step 6: every step's loss and reward and the final states equal the whole run's."""
    cfg = grpo_config(tmp_path, checkpoint={"every": 1, "keep": 0})
    whole = tmp_path / "whole"
    train(cfg, f"output.dir={whole}")
    out = tmp_path / "run"
    kill_when(start(cfg, f"output.dir={out}"), lambda: 3 in logged_steps(out) and
              (out / "checkpoints" / "step-3" / "manifest.json").is_file())
    assert 6 not in logged_steps(out)
    train(cfg, f"output.dir={out}", "resume=auto")
    assert losses(out) == losses(whole)
    rewards = lambda o: {r["step"]: r["reward"] for r in records(o) if "reward" in r}  # noqa: E731
    assert rewards(out) == rewards(whole)
    assert unit_hashes(out / "checkpoints" / "step-6") == unit_hashes(whole / "checkpoints" / "step-6")


def test_a_reward_that_raises_stops_the_run_with_one_line(tmp_path, capsys):
    (tmp_path / "bad_reward.py").write_text(
        "def reward(prompts, completions, rows):\n    raise ValueError('no answer field')\n")
    cfg = grpo_config(tmp_path, grpo={"rewards": [{"name": f"{tmp_path / 'bad_reward.py'}:reward"}]})
    capsys.readouterr()
    assert main(["train", str(cfg)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err[-1]) and "grpo.rewards[0]" in err[-1] and "no answer field" in err[-1], err
    assert "Traceback" not in "\n".join(err)
    # nothing but the run's own folder's start: no checkpoint, no export
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())

