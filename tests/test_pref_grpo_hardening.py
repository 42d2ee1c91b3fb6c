"""Input handling of the preference and grpo paths: every mistake is one line naming the culprit, found before
anything is written, and nothing the user set is silently left unread.

- grpo has no held-out evaluation: data.eval_fraction, eval_path, eval_datasets and train.eval_every (without
  train.exact_match_path) are refused, not silently dropped;
- a key the objective does not read (preference.beta with orpo, grpo.* with dpo, a reward's `field` on regex...)
  is refused, naming what the objective reads instead; a key left at (or set to) its default is not;
- a reward that raises SystemExit or KeyboardInterrupt is the usual reward error, while the run's own signal
  handling (a second Ctrl-C) still stops it; a reward function that cannot take (prompts, completions, rows) is
  refused when the rewards are loaded;
- rewards and weights beyond float32's range are named, not turned into NaN;
- a damaged stored reference table is one line naming the file;
- a reference_path whose config.json differs from the policy's where it changes the forward is refused.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from megatrain.cli import main
from megatrain.config import DEFAULT_CONFIG, load_command_line
from megatrain.errors import ConfigError, MegatrainError
from megatrain.rl import load_rewards, score
from preference_helpers import pair_config

DEFAULTS = DEFAULT_CONFIG.parent
TINY = DEFAULTS / "tiny-llama"


def _one_line_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("megatrain: error: ") and "Traceback" not in err, err
    return err.strip()


def _config_error(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_command_line(None, ["model.path=m", *overrides])
    return e.value.problems


GRPO = ["train.objective=grpo", "data.format=prompt", "data.path=d.jsonl", "data.max_seq_len=64",
        "grpo.max_new_tokens=16", "grpo.prompts_per_rollout=4", "grpo.rewards=[exact_match]"]
PAIRS = ["data.format=preference", "data.path=d.jsonl"]


# ---- 1. grpo has no held-out evaluation -----------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("data.eval_fraction=0.5", "data.eval_fraction"),
    ("data.eval_path=e.jsonl", "data.eval_path"),
    ("data.eval_datasets=[e.jsonl]", "data.eval_datasets"),
    ("train.eval_every=5", "train.eval_every"),
])
def test_grpo_refuses_held_out_data_it_never_uses(override, key):
    (line,) = _config_error(*GRPO, override)
    assert line.startswith(f"command line: {key}: ") and "grpo" in line, line


def test_grpo_keeps_eval_every_for_its_exact_match_and_the_defaults():
    load_command_line(None, ["model.path=m", *GRPO])
    load_command_line(None, ["model.path=m", *GRPO, "train.eval_every=5", "train.exact_match_path=x.jsonl"])
    load_command_line(None, ["model.path=m", *GRPO, "data.eval_fraction=0", "train.eval_every=0"])


def test_grpo_held_out_keys_are_refused_by_plan_with_their_file_line(tmp_path, capsys):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: m\ndata:\n  path: d.jsonl\n  format: prompt\n  max_seq_len: 64\n"
                 "  eval_fraction: 0.5\ntrain:\n  objective: grpo\n  eval_every: 2\n"
                 "grpo:\n  prompts_per_rollout: 4\n  max_new_tokens: 16\n  rewards: [exact_match]\n")
    assert main(["plan", str(p)]) == 2
    err = capsys.readouterr().err.rstrip("\n").split("\n")
    assert err[0] == "megatrain: error: 2 problems in the config:", err
    assert err[1].startswith(f"  {p}:7: data.eval_fraction: ") and err[2].startswith(f"  {p}:10: train.eval_every: ")


# ---- 2. keys the objective never reads ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, key, says", [
    (["train.objective=orpo", "preference.beta=0.5"], "preference.beta", "preference.orpo_lambda"),
    (["train.objective=ipo", "preference.label_smoothing=0.1"], "preference.label_smoothing", "preference.beta"),
    (["train.objective=orpo", "preference.label_smoothing=0.1"], "preference.label_smoothing",
     "preference.orpo_lambda"),
    (["train.objective=simpo", "preference.orpo_lambda=0.5"], "preference.orpo_lambda", "preference.beta"),
    (["train.objective=dpo", "preference.simpo_gamma=1.0"], "preference.simpo_gamma", "preference.beta"),
    (["train.objective=dpo", "preference.orpo_lambda=0.5"], "preference.orpo_lambda", "preference.beta"),
    (["train.objective=dpo", "grpo.num_generations=4"], "grpo.num_generations", "train.objective grpo"),
    (["train.objective=dpo", "grpo.beta=0.5"], "grpo.beta", "preference.beta"),
])
def test_a_preference_objective_refuses_a_key_it_does_not_read(overrides, key, says):
    (line,) = _config_error(*PAIRS, *overrides)
    assert line.startswith(f"command line: {key}: ") and says in line, line


@pytest.mark.parametrize("overrides, key, says", [
    (["preference.beta=0.5"], "preference.beta", "grpo.beta"),
    (["preference.simpo_gamma=1.0"], "preference.simpo_gamma", "dpo, ipo, simpo and orpo"),
])
def test_grpo_refuses_the_preference_section(overrides, key, says):
    (line,) = _config_error(*GRPO, *overrides)
    assert line.startswith(f"command line: {key}: ") and says in line, line


def test_sft_refuses_the_preference_and_grpo_sections():
    lines = _config_error("data.path=d.jsonl", "preference.orpo_lambda=0.5", "grpo.temperature=0.7")
    assert [x.split(": ")[1] for x in lines] == ["preference.orpo_lambda", "grpo.temperature"], lines


def test_keys_at_their_defaults_are_not_flagged():
    load_command_line(None, ["model.path=m", *PAIRS, "train.objective=orpo", "preference.beta=0.1",
                             "grpo.beta=0.0", "preference.orpo_lambda=0.3"])
    load_command_line(None, ["model.path=m", *PAIRS, "train.objective=dpo", "preference.beta=0.3",
                             "preference.label_smoothing=0.1", "preference.reference=stream"])
    load_command_line(None, ["model.path=m", *PAIRS, "train.objective=simpo", "preference.simpo_gamma=1.0",
                             "preference.label_smoothing=0.1"])
    load_command_line(None, ["model.path=m", *GRPO, "grpo.beta=0.1", "grpo.temperature=0.7"])


@pytest.mark.parametrize("reward, says", [
    ("{name: regex, pattern: a, field: answer}", "field: only exact_match and numeric read a row's field, not regex"),
    ("{name: 'r.py:f', field: sol}", "r.py:f (a user function gets the whole rows)"),
])
def test_a_reward_field_that_is_never_read_is_refused(reward, says):
    (line,) = _config_error(*GRPO[:-1], f"grpo.rewards=[{reward}]")
    assert line.startswith("command line: grpo.rewards[0]") and says in line, line


# ---- 3. a reward that raises SystemExit or KeyboardInterrupt; a function that cannot be called so ------------
REWARDS = '''
import os, signal
def exits(prompts, completions, rows):
    raise SystemExit(0)
def interrupts(prompts, completions, rows):
    raise KeyboardInterrupt
def signalled(prompts, completions, rows):
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C: the run records it
    os.kill(os.getpid(), signal.SIGINT)  # a second one: stop at once
    return [0.0] * len(completions)
def one_arg(completions):
    return [0.0] * len(completions)
def trl_style(completions, **kwargs):
    return [0.0] * len(completions)
def flexible(*args, **kwargs):
    return [0.0] * len(args[1])
def huge(prompts, completions, rows):
    return [1e300 * (j % 2) for j in range(len(completions))]
def big(prompts, completions, rows):
    return [3e38 if r["d"] == 0 else -3e38 for r in rows]
'''


@pytest.fixture
def rewards_file(tmp_path):
    f = tmp_path / "r.py"
    f.write_text(REWARDS)
    return f


def _rows(n: int) -> tuple[list[dict], list[str]]:
    return [{"d": j} for j in range(n)], [f"/data/p.jsonl:{j + 1}" for j in range(n)]


@pytest.mark.parametrize("fn, raised", [("exits", "SystemExit: 0"), ("interrupts", "KeyboardInterrupt")])
def test_a_reward_that_raises_systemexit_or_keyboardinterrupt_is_a_reward_error(rewards_file, fn, raised):
    from megatrain.checkpoint.signals import StopOnSignal

    rewards = load_rewards([{"name": "exact_match"}, {"name": f"{rewards_file}:{fn}"}])
    rows, wheres = _rows(3)
    with StopOnSignal() as stop, pytest.raises(MegatrainError) as e:  # (the run's handler, as in a run)
        score(rewards, ["p"] * 3, ["c"] * 3, [{**r, "answer": "c"} for r in rows], wheres=wheres)
    assert str(e.value) == f"grpo.rewards[1] ({fn}) raised {raised} on the completion of /data/p.jsonl:1"
    assert stop.requested is None


def test_a_real_second_signal_during_a_reward_still_stops_the_run(rewards_file, capfd):
    from megatrain.checkpoint.signals import StopOnSignal

    rewards = load_rewards([{"name": f"{rewards_file}:signalled"}])
    rows, wheres = _rows(2)
    with StopOnSignal() as stop, pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        score(rewards, ["p"] * 2, ["c"] * 2, rows, wheres=wheres)
    assert stop.forced and stop.requested == "SIGINT"
    capfd.readouterr()


@pytest.mark.parametrize("fn", ["one_arg", "trl_style"])
def test_a_reward_that_cannot_take_prompts_completions_rows_is_refused_when_loaded(rewards_file, fn):
    with pytest.raises(MegatrainError) as e:
        load_rewards([{"name": f"{rewards_file}:{fn}"}])
    msg = str(e.value)
    assert msg.startswith(f"grpo.rewards[0]: {rewards_file}: {fn}(") and "(prompts, completions, rows)" in msg, msg


def test_a_builtin_without_the_signature_is_refused_and_a_flexible_one_is_kept(rewards_file):
    with pytest.raises(MegatrainError, match=r"^grpo\.rewards\[0\]: module 'json': loads\(.*\(prompts, completions, "
                                             r"rows\)"):
        load_rewards([{"name": "json:loads"}])
    (r,) = load_rewards([{"name": f"{rewards_file}:flexible"}])
    assert score([r], ["p"], ["c"], [{}])[0].tolist() == [0.0]


def test_a_reward_file_that_exits_while_imported_is_one_line(tmp_path):
    (tmp_path / "script.py").write_text("import sys\nsys.exit(3)\ndef f(prompts, completions, rows):\n    pass\n")
    with pytest.raises(MegatrainError) as e:
        load_rewards([{"name": "script.py:f"}], base_dir=tmp_path)
    assert str(e.value) == f"grpo.rewards[0]: importing {tmp_path / 'script.py'} raised SystemExit: 3"


# ---- 4. beyond float32 -----------------------------------------------------------------------------------------
def test_a_weight_beyond_float32_is_refused_by_the_config():
    (line,) = _config_error(*GRPO[:-1], "grpo.rewards=[{name: exact_match, weight: 1.0e39}]")
    assert line.startswith("command line: grpo.rewards[0].weight: ") and "float32" in line, line


def test_a_reward_beyond_float32_names_the_reward_and_the_row(rewards_file):
    rows, wheres = _rows(4)
    rewards = load_rewards([{"name": "exact_match"}, {"name": f"{rewards_file}:huge"}])
    with pytest.raises(MegatrainError) as e:
        score(rewards, ["p"] * 4, ["c"] * 4, [{**r, "answer": "c"} for r in rows], wheres=wheres)
    assert str(e.value).startswith("grpo.rewards[1] (huge) returned 1e+300 for the completion of /data/p.jsonl:2; "), \
        str(e.value)
    assert "float32" in str(e.value)


def test_a_weighted_sum_beyond_float32_names_the_weight(rewards_file):
    rows, wheres = _rows(2)
    rewards = load_rewards([{"name": f"{rewards_file}:big", "weight": 2.0}])
    with pytest.raises(MegatrainError) as e:
        score(rewards, ["p"] * 2, ["c"] * 2, rows, wheres=wheres)
    assert str(e.value).startswith("grpo.rewards[0] (big): weight 2 x 3e+38 for the completion of /data/p.jsonl:1 "), \
        str(e.value)


def test_advantages_beyond_float32_name_the_reward(rewards_file):
    from megatrain.run.grpo import checked_advantages

    rows, wheres = _rows(4)
    rows = [{"d": 0}, {"d": 1}, {"d": 1}, {"d": 1}]  # 3e38 and three -3e38: r - mean = 4.5e38
    rewards = load_rewards([{"name": "exact_match", "weight": 0.5}, {"name": f"{rewards_file}:big"}])
    total, per = score(rewards, ["p"] * 4, ["c"] * 4, [{**r, "answer": "x"} for r in rows], wheres=wheres)
    assert torch.isfinite(total).all()
    with pytest.raises(MegatrainError) as e:
        checked_advantages(total, per, rewards, wheres, n=4, scale=False)
    msg = str(e.value)
    assert msg.startswith("grpo.rewards[1] (big): the rewards of /data/p.jsonl:1 ... /data/p.jsonl:4") and \
        "float32" in msg, msg
    adv, std = checked_advantages(total, per, rewards, wheres, n=4, scale=True)  # scaled: within range
    assert torch.isfinite(adv).all() and torch.isfinite(std).all()


# ---- 5. a damaged stored reference table --------------------------------------------------------------------
def _snapshot(folder: Path) -> dict:
    """Every path under `folder`, and each file's size and modification time (a folder's changes with the run's
    probe that checkpoints/ can be written, which leaves nothing)."""
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def test_a_damaged_reference_table_is_one_line_before_anything_is_written(tmp_path, capsys):
    from safetensors.torch import save_file

    cfg = pair_config(tmp_path, "dpo", train={"steps": 1, "grad_accum_steps": 1},
                      preference={"reference": "precompute"})
    assert main(["train", str(cfg)]) == 0
    out = tmp_path / "run"
    (table,) = (out / "reference").glob("*.safetensors")
    capsys.readouterr()

    table.write_bytes(b"\x00garbage" * 10)
    before = _snapshot(out)
    err = _one_line_error(capsys, ["train", str(cfg), "output.overwrite=true"])
    assert f"{table}" in err and "unreadable" in err, err
    assert _snapshot(out) == before

    save_file({"train": torch.zeros(3, 2), "eval": torch.zeros(16, 2)}, str(table))
    before = _snapshot(out)
    err = _one_line_error(capsys, ["train", str(cfg), "output.overwrite=true"])
    assert f"{table}" in err and "3 pairs where 64 are expected" in err, err
    assert _snapshot(out) == before


# ---- 6. a reference whose config changes the forward -----------------------------------------------------
def _reference(tmp_path: Path, name: str, **changes) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    config = json.loads((TINY / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16", transformers_version="4.0.0", **changes)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")  # (the weights are read later, by the store)
    return folder


@pytest.mark.parametrize("changes, says", [
    ({"rms_norm_eps": 0.5}, "rms_norm_eps (reference 0.5, policy 1e-05)"),
    ({"rope_parameters": {"rope_theta": 1.0, "rope_type": "default"}}, "rope_parameters (reference "),
    ({"max_position_embeddings": 16}, "max_position_embeddings (reference 16, policy "),
])
def test_a_reference_config_that_changes_the_forward_is_refused(tmp_path, changes, says):
    from megatrain.run.reference import check_reference_path

    ref = _reference(tmp_path, "ref", **changes)
    cfg = load_command_line(None, [f"model.path={TINY}", *PAIRS, "train.objective=dpo",
                                   f"preference.reference_path={ref}"])
    with pytest.raises(MegatrainError) as e:
        check_reference_path(cfg)
    msg = str(e.value)
    assert msg.startswith(f"preference.reference_path: {ref / 'config.json'} differs from the policy's") and \
        says in msg, msg


def test_a_reference_differing_only_where_it_cannot_matter_is_accepted(tmp_path):
    from megatrain.run.reference import check_reference_path

    ref = _reference(tmp_path, "ref", eos_token_id=5, use_cache=False)
    cfg = load_command_line(None, [f"model.path={TINY}", *PAIRS, "train.objective=dpo",
                                   f"preference.reference_path={ref}"])
    check_reference_path(cfg)


def test_train_refuses_the_reference_config_before_anything_is_written(tmp_path, capsys):
    ref = _reference(tmp_path, "ref", rms_norm_eps=0.5)
    cfg = pair_config(tmp_path, "dpo")
    err = _one_line_error(capsys, ["train", str(cfg), f"preference.reference_path={ref}"])
    assert "rms_norm_eps (reference 0.5, policy 1e-05)" in err and not (tmp_path / "run").exists()


# ---- 7. megatrain plan checks preference.reference_path -------------------------------------------------------
def test_plan_checks_the_reference_path(tmp_path, capsys):
    cfg = pair_config(tmp_path, "dpo")
    err = _one_line_error(capsys, ["plan", str(cfg), f"preference.reference_path={tmp_path / 'nowhere'}"])
    assert "preference.reference_path: " in err
    ref = _reference(tmp_path, "ref", rms_norm_eps=0.5)
    err = _one_line_error(capsys, ["plan", str(cfg), f"preference.reference_path={ref}"])
    assert "rms_norm_eps" in err


def test_the_check_plan_needs_takes_the_config_alone(tmp_path):
    from megatrain.run.reference import check_reference_path

    cfg = load_command_line(None, [f"model.path={TINY}", *PAIRS, "train.objective=dpo",
                                   f"preference.reference_path={tmp_path / 'no'}"])
    with pytest.raises(MegatrainError, match=r"^preference\.reference_path: .*/no is not a folder"):
        check_reference_path(cfg)
    shutil.copytree(TINY, tmp_path / "noweights")
    cfg = load_command_line(None, [f"model.path={TINY}", *PAIRS, "train.objective=dpo",
                                   f"preference.reference_path={tmp_path / 'noweights'}"])
    with pytest.raises(MegatrainError, match=r"has no \*\.safetensors weights"):
        check_reference_path(cfg)


# ---- through `megatrain train`: the rewards' mistakes before and during a run -------------------------------
def _grpo_config(tmp: Path, reward: str) -> Path:
    from test_grpo_run import grpo_config

    return grpo_config(tmp, train={"steps": 1, "grad_accum_steps": 1}, grpo={"prompts_per_rollout": 2,
                                                                             "num_generations": 2, "beta": 0.0,
                                                                             "rewards": [{"name": reward}]})


def test_a_reward_of_the_wrong_signature_is_refused_before_anything_is_written(tmp_path, capsys, rewards_file):
    cfg = _grpo_config(tmp_path, f"{rewards_file}:one_arg")
    err = _one_line_error(capsys, ["train", str(cfg)])
    assert "grpo.rewards[0]: " in err and not (tmp_path / "run").exists()


def test_a_reward_that_exits_stops_the_run_with_one_line(tmp_path, capsys, rewards_file):
    cfg = _grpo_config(tmp_path, f"{rewards_file}:exits")
    capsys.readouterr()
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megatrain: error: grpo.rewards[0] (exits) raised SystemExit: 0 on the completion of ")
    assert "Traceback" not in "\n".join(err)


def test_the_runs_signal_handler_is_one_the_rewards_can_tell_apart():
    """rewards.from_signal tells the run's own KeyboardInterrupt (raised by its signal handler) from a reward's by
    the handler's frame: the run's handler must be a Python function, not signal.default_int_handler."""
    from megatrain.checkpoint.signals import StopOnSignal

    with StopOnSignal():
        h = signal.getsignal(signal.SIGINT)
        assert h is not signal.default_int_handler and hasattr(getattr(h, "__func__", h), "__code__")
