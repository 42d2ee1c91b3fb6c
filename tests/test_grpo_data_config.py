"""The grpo config section and its checks: each mismatch of train.objective grpo with its data, batch and rewards is
one line naming the key (and the file's line), all of them at once, through `megatrain plan` as through
load_config; user reward paths resolve like other input paths; planning never imports a reward function."""

from __future__ import annotations

import pytest

from megatrain.cli import main
from megatrain.config import load_command_line, load_config
from megatrain.config_checks import batch_problem
from megatrain.errors import ConfigError

BASE = {"data": "data:\n  path: d.jsonl\n  format: prompt\n  max_seq_len: 64\n",
        "train": "train:\n  objective: grpo\n  micro_batch_size: 4\n  grad_accum_steps: 2\n",
        "grpo": "grpo:\n  prompts_per_rollout: 4\n  num_generations: 4\n  max_new_tokens: 16\n"
                "  rewards:\n    - {name: exact_match}\n"}


def _write(tmp_path, **sections) -> str:
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: m\n" + "".join(sections.get(k, v) for k, v in BASE.items()))
    return p


def _lines(capsys, p, *overrides) -> list[str]:
    assert main(["plan", str(p), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.rstrip("\n").split("\n")


def test_a_valid_section_loads(tmp_path):
    cfg = load_config(_write(tmp_path))
    g = cfg.grpo
    assert (cfg.train.objective, cfg.data.format, g.completions_per_rollout, g.loss_type, g.epsilon_high) == \
        ("grpo", "prompt", 16, "dapo", None)
    assert [(r.name, r.weight, r.field, r.pattern) for r in g.rewards] == [("exact_match", 1.0, "answer", None)]
    short = load_command_line(None, ["model.path=m", "train.objective=grpo", "data.format=prompt",
                                     "grpo.rewards=[numeric, {name: regex, pattern: '^a', weight: 0.5}]"])
    assert [(r.name, r.weight) for r in short.grpo.rewards] == [("numeric", 1.0), ("regex", 0.5)]


@pytest.mark.parametrize("sections, line", [
    ({"data": "data:\n  path: d.jsonl\n  max_seq_len: 64\n"},
     "{p}:7: train.objective: grpo samples completions for prompts, but data.format is 'text'; set data.format: "
     "prompt (rows {{\"prompt\": ...}} or {{\"messages\": [...]}})"),
    ({"train": "train:\n  micro_batch_size: 4\n"},
     "{p}:5: data: prompts (data.format prompt: rows without a completion) train with train.objective: grpo, not sft"),
    ({"train": "train:\n  objective: grpo\n  micro_batch_size: 3\n"},
     "{p}:11: grpo.prompts_per_rollout: a rollout batch of 4 x 4 = 16 completions does not split into optimizer "
     "steps of train.micro_batch_size x train.grad_accum_steps = 3 completions; make it a multiple"),
    ({"grpo": "grpo:\n  max_new_tokens: 64\n  prompts_per_rollout: 2\n  rewards: [exact_match]\n"},
     "{p}:12: grpo.max_new_tokens: 64 leaves no room for a prompt in data.max_seq_len=64 (prompt + completion); "
     "raise data.max_seq_len or lower grpo.max_new_tokens"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  max_new_tokens: 16\n"},
     "{p}:11: grpo.rewards: give one or more rewards (exact_match, regex, numeric, or path.py:function), e.g. "
     "[{{name: exact_match, field: answer}}]"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  rewards:\n    - exact_match\n    - {name: length}\n"},
     "{p}:15: grpo.rewards[1]: Value error, unknown reward 'length': a built-in (exact_match, regex, numeric) or a "
     "user function as path.py:function or module:function (got {{'name': 'length'}})"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  rewards: [{name: regex}]\n"},
     "{p}:13: grpo.rewards[0]: Value error, the regex reward needs a pattern (got {{'name': 'regex'}})"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  rewards: [{name: regex, pattern: '(a'}]\n"},
     "{p}:13: grpo.rewards[0]: Value error, pattern '(a' is not a regular expression: missing ), unterminated "
     "subpattern at position 0 (got {{'name': 'regex', 'pattern': '(a'}})"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  rewards: [{name: numeric, pattern: x}]\n"},
     "{p}:13: grpo.rewards[0]: Value error, pattern: only the regex reward reads a pattern, not numeric (got "
     "{{'name': 'numeric', 'pattern': 'x'}})"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  num_generations: 1\n  rewards: [numeric]\n"},
     "{p}:13: grpo.num_generations: Input should be greater than or equal to 2 (got 1)"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  temperature: 0\n  rewards: [numeric]\n"},
     "{p}:13: grpo.temperature: Input should be greater than 0 (got 0)"),
    ({"grpo": "grpo:\n  prompts_per_rollout: 2\n  stop: ['']\n  rewards: [numeric]\n"},
     "{p}:13: grpo.stop: Value error, a stop string must not be empty (got [''])"),
])
def test_each_mismatch_is_one_line_naming_its_key(tmp_path, capsys, sections, line):
    p = _write(tmp_path, **sections)
    assert _lines(capsys, p) == ["megatrain: error: " + line.format(p=p)]


def test_every_mismatch_at_once(tmp_path, capsys):
    p = _write(tmp_path, data="data:\n  path: d.jsonl\n  max_seq_len: 16\n  packing: true\n  train_on_prompt: true\n",
               grpo="grpo:\n  max_new_tokens: 16\n")
    assert _lines(capsys, p, "preference.reference_path=ref") == [
        "megatrain: error: 6 problems in the config:",
        "  command line: preference.reference_path: only dpo and ipo have a reference model of this section; grpo's "
        "KL reference (grpo.beta) is the policy at step 0: remove the key",
        f"  {p}:9: train.objective: grpo samples completions for prompts, but data.format is 'text'; set "
        f"data.format: prompt (rows {{\"prompt\": ...}} or {{\"messages\": [...]}})",
        f"  {p}:12: grpo.rewards: give one or more rewards (exact_match, regex, numeric, or path.py:function), e.g. "
        f"[{{name: exact_match, field: answer}}]",
        f"  {p}:13: grpo.max_new_tokens: 16 leaves no room for a prompt in data.max_seq_len=16 (prompt + "
        f"completion); raise data.max_seq_len or lower grpo.max_new_tokens",
        f"  {p}:6: data.packing: grpo's rows (a prompt and one completion) are right-padded, not packed; set "
        f"data.packing: false",
        f"  {p}:7: data.train_on_prompt: grpo's loss is on the sampled completions only; set data.train_on_prompt: "
        f"false"]


def test_the_rollout_batch_splits_between_ranks(tmp_path):
    cfg = load_config(_write(tmp_path))
    assert batch_problem(cfg) is None and batch_problem(cfg, world=2) is None
    assert batch_problem(cfg, world=3) == ("grpo.prompts_per_rollout: a rollout batch of 4 x 4 = 16 completions does "
                                           "not split into optimizer steps of train.micro_batch_size x "
                                           "train.grad_accum_steps x 3 ranks = 24 completions; make it a multiple")
    cfg.train.grad_accum_steps = 1
    assert batch_problem(cfg, world=4) is None
    cfg.train.micro_batch_size = 1
    assert batch_problem(cfg, world=8) == "grpo.prompts_per_rollout: 4 prompts do not split between 8 ranks; make " \
                                          "it a multiple of 8"


def test_reward_paths_resolve_against_the_config_folder_or_the_working_directory(tmp_path, monkeypatch):
    p = _write(tmp_path, grpo="grpo:\n  max_new_tokens: 8\n  rewards: [{name: r/my.py:f}, my_mod:g, numeric, "
                              "/abs/x.py:h, 'r/my.py:f']\n")
    names = [r.name for r in load_config(p).grpo.rewards]
    assert names == [f"{tmp_path}/r/my.py:f", "my_mod:g", "numeric", "/abs/x.py:h", f"{tmp_path}/r/my.py:f"]
    monkeypatch.chdir(tmp_path / "..")
    cli = load_config(p, ["grpo.rewards=[{name: other.py:f}]"]).grpo.rewards
    assert cli[0].name == f"{tmp_path.parent}/other.py:f"


def test_planning_never_imports_a_reward(tmp_path, capsys):
    """`megatrain plan` reads the config (and any error in it) without importing the reward's file: a file that
    would fail, or write, on import is untouched."""
    (tmp_path / "boom.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w')\nraise SystemExit('boom')\n")
    p = _write(tmp_path, grpo="grpo:\n  prompts_per_rollout: 2\n  num_generations: 3\n  max_new_tokens: 8\n"
                              "  rewards: [boom.py:f]\n")
    lines = _lines(capsys, p)  # an error elsewhere stops it first; the reward is not imported to find it
    assert lines == [f"megatrain: error: {p}:12: grpo.prompts_per_rollout: a rollout batch of 2 x 3 = 6 completions "
                     f"does not split into optimizer steps of train.micro_batch_size x train.grad_accum_steps = 8 "
                     f"completions; make it a multiple"]
    assert load_config(p, ["grpo.num_generations=4"]).grpo.rewards[0].name == f"{tmp_path}/boom.py:f"
    assert not (tmp_path / "IMPORTED").exists() and not (tmp_path / "__pycache__").exists()


def test_unknown_grpo_keys_get_the_nearest_name(tmp_path):
    with pytest.raises(ConfigError, match=r"command line: grpo.num_generation: unknown key; did you mean "
                                          r"'grpo.num_generations'\?"):
        load_config(_write(tmp_path), ["grpo.num_generation=4"])
