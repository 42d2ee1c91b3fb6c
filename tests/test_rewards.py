"""The rewards of train.objective grpo (megatrain/rl/rewards.py): each built-in on its edge cases, numeric_answer's
normalisation, user functions from a .py path or a module, and every failure (an import that fails, a function that
raises, returns the wrong number of values or a value that is not a finite number) as one line naming
grpo.rewards[i] and, for a call, the row's file:line."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from megatrain.data.prompts import PromptRow
from megatrain.errors import MegatrainError
from megatrain.rl import RewardSpec, load_rewards, numeric_answer, row_problem, score


@pytest.mark.parametrize("text, want", [
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("#### 1,234", "1234"),
    ("so the total is -5 dollars\n#### -5", "-5"),
    ("#### 42.0", "42"),
    ("#### 0.50", "0.5"),
    ("12 then 13 #### 7 and 9 after", "7"),  # the number right after the marker
    ("we get \\boxed{42} in the end, checking 43", "42"),
    ("\\boxed{1,234.00}", "1234"),
    ("\\boxed{\\frac{3}{4}}", "3/4"),  # a fraction stays as written
    ("-\\frac{1}{2}", "-1/2"),
    ("\\boxed{\\dfrac{6}{8}}", "6/8"),  # not reduced
    ("\\boxed{x^{2}+1 = 10}", "10"),  # the last number of the box, nested braces balanced
    ("\\boxed{x}", None),  # a box without a number: no numeric answer
    ("The answer is 42.", "42"),
    ("cost $1,000,000.", "1000000"),
    ("x = -5", "-5"),
    ("from 3-5", "5"),  # a minus after a digit is subtraction
    ("about .5 of it", "0.5"),
    ("1,2,3", "3"),  # commas that are not thousands separators split numbers
    ("3/4 cup", "3/4"),
    ("\u22127 degrees", "-7"),  # the unicode minus
    ("-0", "0"),
    ("no numbers here", None),
    ("", None),
])
def test_numeric_answer(text, want):
    assert numeric_answer(text) == want


def _score(specs, completions, rows, **kw):
    rewards = load_rewards([RewardSpec.model_validate(s) for s in specs], **kw)
    return score(rewards, ["p"] * len(completions), completions, rows)


def test_exact_match_strips_whitespace_and_reads_numbers_as_text():
    total, per = _score([{"name": "exact_match"}], ["  cba\n", "cba.", "CBA", "42"],
                        [{"answer": "cba"}, {"answer": "cba"}, {"answer": "cba "}, {"answer": 42}])
    assert per["exact_match"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert total.dtype == torch.float32 and total.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_regex_searches_anywhere_and_dot_stops_at_line_breaks_unless_told():
    spec = {"name": "regex", "pattern": "^<think>.*</think>"}
    comps = ["<think>a</think> 4", "x <think>a</think>", "<think>a\nb</think>", ""]
    assert _score([spec], comps, [{}] * 4)[1]["regex"].tolist() == [1.0, 0.0, 0.0, 0.0]
    spec["pattern"] = "(?s)^<think>.*</think>"
    assert _score([spec], comps, [{}] * 4)[1]["regex"].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_numeric_compares_normalised_final_numbers():
    comps = ["so 1,234", "\\boxed{1234.0}", "1233", "no answer", "#### 3/4", "0.75"]
    rows = [{"solution": "#### 1234"}] * 4 + [{"solution": "3/4"}] * 2
    _, per = _score([{"name": "numeric", "field": "solution"}], comps, rows)
    assert per["numeric"].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]


def test_weights_sum_and_repeated_names_get_their_index():
    specs = [{"name": "exact_match", "weight": 2.0}, {"name": "numeric", "weight": -0.5},
             {"name": "numeric", "field": "other", "weight": 0.25}]
    total, per = _score(specs, ["7", "8"], [{"answer": "7", "other": "8"}] * 2)
    assert list(per) == ["exact_match", "numeric", "numeric_2"]
    want = [2.0 * e - 0.5 * n + 0.25 * o for e, n, o in zip(*(per[k].tolist() for k in per))]
    assert total.tolist() == pytest.approx(want) and want == [1.5, 0.25]


def test_row_problem_names_the_column():
    assert row_problem(RewardSpec(name="numeric"), {"question": "q"}) == "the row has no column 'answer'"
    assert "holds no number" in row_problem(RewardSpec(name="numeric"), {"answer": "blue"})
    assert row_problem(RewardSpec(name="exact_match"), {"answer": ["a"]}) == \
        "column 'answer' must be a string or a number, got list"
    assert row_problem(RewardSpec(name="regex", pattern="a"), {}) is None


# ---- user functions ---------------------------------------------------------------------------------------------
USER = '''
calls = []

def length_penalty(prompts, completions, rows):
    calls.append(len(completions))
    return [-len(c) / 10 for c in completions]

def by_row(prompts, completions, rows):
    return [1.0 / rows[j]["d"] for j in range(len(rows))]

def wrong_length(prompts, completions, rows):
    return [0.0] * (len(completions) + 1)

def not_a_number(prompts, completions, rows):
    return [None if r.get("bad") else 1.0 for r in rows]

def nan(prompts, completions, rows):
    return [float("nan") if r.get("bad") else 1.0 for r in rows]

def batch_only(prompts, completions, rows):
    if len(completions) > 1:
        raise RuntimeError("cannot do batches\\nsecond line")
    return [0.0]

def as_dict(prompts, completions, rows):
    return {"a": 1.0}

def scalar(prompts, completions, rows):
    import torch
    return torch.tensor(1.0)

def tensors(prompts, completions, rows):
    import torch
    return torch.arange(len(completions), dtype=torch.float64)

not_callable = 3
'''


def _rows(path, n, **extra):
    return [PromptRow(j, [1], "p", {"d": j, **extra}, f"{path}:{j + 1}") for j in range(n)]


@pytest.fixture
def user_file(tmp_path):
    f = tmp_path / "sub" / "my_rewards.py"
    f.parent.mkdir()
    f.write_text(USER)
    return f


def test_a_user_function_from_a_relative_py_path(tmp_path, user_file):
    rewards = load_rewards([RewardSpec(name="sub/my_rewards.py:length_penalty", weight=2.0)], base_dir=tmp_path)
    assert [r.name for r in rewards] == ["length_penalty"] and rewards[0].key == "grpo.rewards[0]"
    total, per = score(rewards, ["p", "p"], ["abcd", "ab"], _rows("d.jsonl", 2))
    assert per["length_penalty"].tolist() == pytest.approx([-0.4, -0.2])
    assert total.tolist() == pytest.approx([-0.8, -0.4])
    assert sys.modules[rewards[0].fn.__module__].calls == [2]  # one call per rollout batch
    assert not (user_file.parent / "__pycache__").exists()  # importing wrote nothing


def test_a_user_function_from_a_module(tmp_path, user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    (r,) = load_rewards([{"name": "my_rewards:tensors"}])
    assert score([r], ["p"] * 3, ["a", "b", "c"], _rows("d.jsonl", 3))[0].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("name, message", [
    ("nope.py:f", "grpo.rewards[0]: reward file {tmp}/nope.py does not exist"),
    ("sub:f", "grpo.rewards[0]: {tmp}/sub is a directory; expected a Python file (path.py:function)"),
    ("sub/my_rewards.py:length_penalti", "grpo.rewards[0]: {tmp}/sub/my_rewards.py has no function 'length_penalti'; "
                                         "did you mean 'length_penalty'?"),
    ("sub/my_rewards.py:not_callable", "grpo.rewards[0]: {tmp}/sub/my_rewards.py: 'not_callable' is a int, not a "
                                       "function"),
    ("no_such_module_xyz:f", "grpo.rewards[0]: no module named 'no_such_module_xyz' (a user reward is "
                             "path.py:function, a file relative to the config's folder, or module:function of an "
                             "importable module)"),
])
def test_loading_failures_are_one_line(tmp_path, user_file, name, message):
    name = name.replace("sub:f", f"{tmp_path}/sub:f")
    with pytest.raises(MegatrainError) as e:
        load_rewards([RewardSpec(name=name)], base_dir=tmp_path)
    assert str(e.value) == message.format(tmp=tmp_path)


def test_a_file_that_fails_to_import_is_named_with_its_line(tmp_path):
    (tmp_path / "broken.py").write_text("x = 1\ndef f(:\n")
    (tmp_path / "raising.py").write_text("raise ImportError('needs numpy 9\\nmore')\n")
    with pytest.raises(MegatrainError) as e:
        load_rewards([{"name": "exact_match"}, {"name": "broken.py:f"}], base_dir=tmp_path)
    assert str(e.value).startswith(f"grpo.rewards[1]: {tmp_path}/broken.py:2: SyntaxError: ")
    with pytest.raises(MegatrainError) as e:
        load_rewards([{"name": "raising.py:f"}], base_dir=tmp_path)
    assert str(e.value) == f"grpo.rewards[0]: importing {tmp_path}/raising.py raised ImportError: needs numpy 9"


def _failure(user_file, fn, rows) -> str:
    rewards = load_rewards([{"name": "exact_match"}, {"name": f"{user_file}:{fn}"}])
    with pytest.raises(MegatrainError) as e:
        score(rewards, ["p"] * len(rows), ["c"] * len(rows), rows)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_a_function_that_raises_names_the_row(user_file):
    rows = _rows("/data/d.jsonl", 4, answer="c")
    assert _failure(user_file, "by_row", rows) == \
        "grpo.rewards[1] (by_row) raised ZeroDivisionError: float division by zero on the completion of /data/d.jsonl:1"
    assert _failure(user_file, "batch_only", rows) == \
        ("grpo.rewards[1] (batch_only) raised RuntimeError: cannot do batches on the rollout batch (rows "
         "/data/d.jsonl:1 ... /data/d.jsonl:4; no single row raises)")


def test_wrong_length_and_values_that_are_not_finite_numbers(user_file):
    rows = _rows("/data/d.jsonl", 3, answer="c")
    assert _failure(user_file, "wrong_length", rows) == \
        ("grpo.rewards[1] (wrong_length) returned 4 values for 3 completions (rows /data/d.jsonl:1 ... "
         "/data/d.jsonl:3); return one float per completion")
    rows[2].row["bad"] = True
    assert _failure(user_file, "not_a_number", rows) == \
        ("grpo.rewards[1] (not_a_number) returned 'None' (NoneType) for the completion of /data/d.jsonl:3; a reward "
         "is a number")
    assert _failure(user_file, "nan", rows) == \
        "grpo.rewards[1] (nan) returned nan for the completion of /data/d.jsonl:3; a reward must be finite"
    for fn, kind in (("as_dict", "dict"), ("scalar", "Tensor")):
        assert _failure(user_file, fn, rows) == \
            f"grpo.rewards[1] ({fn}) returned a {kind}, not a list of 3 floats (one per completion)"


def test_a_builtin_on_a_row_without_its_field_names_the_row():
    rewards = load_rewards([{"name": "numeric", "field": "sol"}])
    with pytest.raises(MegatrainError) as e:
        score(rewards, ["p", "p"], ["1", "2"], [{"sol": "1"}, {"x": 1}], wheres=["a.jsonl:3", "a.jsonl:9"])
    assert str(e.value) == "grpo.rewards[0] (numeric): a.jsonl:9: the row has no column 'sol'"
    _, per = score(rewards, ["p"], ["1"], [{"sol": "1"}])  # plain dicts without wheres
    assert per["numeric"].tolist() == [1.0] and not math.isnan(per["numeric"][0])
