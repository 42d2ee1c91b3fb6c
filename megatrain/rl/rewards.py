"""Rewards of online RL (train.objective grpo): the config's grpo.rewards -> functions -> one float per completion.

Every reward has the user signature `fn(prompts, completions, rows) -> list[float]`, called once per rollout batch
with one entry per completion (a prompt's row repeated for each of its completions); TRL passes the dataset's columns
as keyword arguments, megatrain passes the rows. The built-ins:
    exact_match   1.0 where completion.strip() == str(row[field]).strip()
    regex         1.0 where re.search(pattern, completion) finds a match
    numeric       1.0 where numeric_answer(completion) == numeric_answer(str(row[field])), both not None
A user function is `path.py:function` (a file, relative to the config's folder) or `module:function` (an importable
module): imported from exactly that file or module, and only by load_rewards, which the run calls before it writes
anything (`megatrain plan` never imports it). Importing writes no bytecode next to the file.

Every failure is one MegatrainError line naming grpo.rewards[i] (and the function), and for a failing call the row:
its file:line when the rows are PromptRows (prompts.py) or `wheres` are given. A function that cannot be called as
fn(prompts, completions, rows) is refused when it is loaded, before the run writes anything. A function that raises
on the batch (SystemExit and KeyboardInterrupt too: a reward must not end the run silently) is called again row by
row to find the row; only what the run's own signal handler raises goes through (`from_signal`). One that returns
the wrong number of values, or a value that is not a finite number in float32 (the dtype of the rewards, their
weighted sum and the advantages), stops the run the same way.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch

from ..errors import MegatrainError
from .config import BUILTIN_REWARDS, FIELD_REWARDS, FLOAT32_MAX, RewardSpec, reward_path


@dataclass(frozen=True)
class Reward:
    name: str  # what the logs call it (rewards/<name>/mean): the built-in's or the function's name, made unique
    weight: float
    fn: Callable  # fn(prompts, completions, rows) -> list[float]
    key: str = ""  # grpo.rewards[i], for messages


class RowProblem(ValueError):
    """A built-in reward that cannot score row `index` of the batch (a missing or unusable column)."""

    def __init__(self, index: int, msg: str):
        super().__init__(msg)
        self.index = index


# ---- the final number of a text --------------------------------------------------------------------------------
_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"-?(?:{_NUM})(?:\s*/\s*-?(?:{_NUM}))?")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_LATEX_SPACE = re.compile(r"\\[,!;: ]|\\left|\\right")


def _normal(num: str) -> str:
    """'1,234.50' -> '1234.5', '42.0' -> '42', '-0' -> '0', '.5' -> '0.5'."""
    try:
        d = Decimal(num.replace(",", ""))
    except InvalidOperation:
        return num
    out = format(d.normalize(), "f")
    return "0" if out in ("-0", "0") else out


def _numbers(text: str) -> list[str]:
    """The numbers of a text, normalised, in order; a fraction a/b stays a fraction (its parts normalised); a minus
    sign counts where it does not follow a letter, digit or closing bracket (3-5 is 3 and 5)."""
    out = []
    for m in _NUMBER.finditer(text):
        s, start = m.group(), m.start()
        if s.startswith("-") and start and (text[start - 1].isalnum() or text[start - 1] in ")]}"):
            s, start = s[1:], start + 1
        if start and text[start - 1] == "." and not s.startswith("-"):
            continue  # the tail of 1.2.3
        parts = [p.strip() for p in s.split("/")]
        out.append("/".join(_normal(p) for p in parts))
    return out


def _boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (braces balanced), or None."""
    at = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if at < 0:
        return None
    i = text.find("{", at)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None


def numeric_answer(text: str) -> str | None:
    """The final numeric answer of a text, normalised (commas dropped, 42.0 -> 42, fractions kept as written a/b):
    the number after the last GSM8K `####`, else the last number in the last \\boxed{}, else the last number of the
    text; None where there is none."""
    text = _FRAC.sub(r"\1/\2", _LATEX_SPACE.sub("", text.replace("\u2212", "-")))
    at = text.rfind("####")
    if at >= 0 and (nums := _numbers(text[at + 4:].lstrip().split("\n", 1)[0])):
        return nums[0]
    box = _boxed(text)
    if box is not None:
        nums = _numbers(box)
        return nums[-1] if nums else None
    nums = _numbers(text)
    return nums[-1] if nums else None


# ---- the built-ins ---------------------------------------------------------------------------------------------
def _expected(row: dict, field: str, j: int):
    v = row.get(field) if isinstance(row, dict) else None
    if v is None:
        raise RowProblem(j, f"the row has no column '{field}'")
    if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise RowProblem(j, f"column '{field}' must be a string or a number, got {type(v).__name__}")
    return v


def row_problem(spec: RewardSpec, row: dict) -> str | None:
    """Why a built-in reward cannot score a row (None: it can, or the reward is a user function): checked on every
    prompt when the data is read, so that a bad row stops the run before the first rollout."""
    if spec.name not in FIELD_REWARDS:
        return None
    try:
        v = _expected(row, spec.field, 0)
    except RowProblem as e:
        return str(e)
    if spec.name == "numeric" and numeric_answer(str(v)) is None:
        return f"column '{spec.field}' holds no number ({str(v)[:40]!r})"
    return None


def builtin(spec: RewardSpec) -> Callable:
    """The function of a built-in reward."""
    field, pattern = spec.field, spec.pattern

    def exact_match(prompts, completions, rows):
        return [float(c.strip() == str(_expected(r, field, j)).strip()) for j, (c, r) in
                enumerate(zip(completions, rows))]

    def numeric(prompts, completions, rows):
        out = []
        for j, (c, r) in enumerate(zip(completions, rows)):
            want, got = numeric_answer(str(_expected(r, field, j))), numeric_answer(c)
            out.append(float(want is not None and got == want))
        return out

    rx = re.compile(pattern) if pattern is not None else None

    def regex(prompts, completions, rows):
        return [float(rx.search(c) is not None) for c in completions]

    return {"exact_match": exact_match, "numeric": numeric, "regex": regex}[spec.name]


# ---- user functions --------------------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _without_bytecode(load: Callable):
    old = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # nothing written before the run's checks (no __pycache__ beside the file)
    try:
        return load()
    finally:
        sys.dont_write_bytecode = old


def _import_file(f: Path, key: str):
    name = "megatrain_reward_" + hashlib.sha256(str(f).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, f)
    if spec is None or spec.loader is None:
        raise MegatrainError(f"{key}: {f} cannot be imported as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        _without_bytecode(lambda: spec.loader.exec_module(module))
    except SyntaxError as e:
        del sys.modules[name]
        raise MegatrainError(f"{key}: {f}:{e.lineno}: SyntaxError: {e.msg}") from None
    except BaseException as e:  # whatever the file raises while it is imported (a sys.exit, argparse's too)
        del sys.modules[name]
        if from_signal(e):
            raise
        raise MegatrainError(f"{key}: importing {f} raised {_first_line(e)}") from None
    return module


def _import_module(mod: str, key: str):
    try:
        return _without_bytecode(lambda: importlib.import_module(mod))
    except ModuleNotFoundError as e:
        if e.name and mod.startswith(e.name):
            raise MegatrainError(f"{key}: no module named '{mod}' (a user reward is path.py:function, a file "
                                 f"relative to the config's folder, or module:function of an importable module)") \
                from None
        raise MegatrainError(f"{key}: importing module '{mod}' raised {_first_line(e)}") from None
    except BaseException as e:
        if from_signal(e):
            raise
        raise MegatrainError(f"{key}: importing module '{mod}' raised {_first_line(e)}") from None


def user_function(name: str, key: str, base_dir: str | Path | None = None) -> Callable:
    """The function a reward name path.py:function or module:function names; MegatrainError starting with `key`."""
    mod, _, attr = name.rpartition(":")
    path = reward_path(name)
    if path is not None:
        f = Path(path).expanduser()
        f = f if f.is_absolute() else Path(base_dir or Path.cwd()) / f
        if f.is_dir():
            raise MegatrainError(f"{key}: {f} is a directory; expected a Python file (path.py:function)")
        if not f.is_file():
            raise MegatrainError(f"{key}: reward file {f} does not exist")
        module, where = _import_file(f.resolve(), key), str(f)
    else:
        module, where = _import_module(mod, key), f"module '{mod}'"
    fn = getattr(module, attr, None)
    if fn is None:
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n))]
        close = difflib.get_close_matches(attr, names, n=1)
        raise MegatrainError(f"{key}: {where} has no function '{attr}'"
                             + (f"; did you mean '{close[0]}'?" if close else ""))
    if not callable(fn):
        raise MegatrainError(f"{key}: {where}: '{attr}' is a {type(fn).__name__}, not a function")
    check_signature(fn, f"{key}: {where}: {attr}")
    return fn


def check_signature(fn: Callable, who: str) -> None:
    """A reward is called fn(prompts, completions, rows), positionally: refuse one that cannot be (TRL's
    fn(completions, **kwargs), json.loads), now rather than at the first rollout. One without a signature that
    inspect can read (some built-ins) is called as it is."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(None, None, None)
    except TypeError as e:
        raise MegatrainError(f"{who}{sig} cannot be called as fn(prompts, completions, rows) ({e}); a reward takes "
                             f"the three positionally and returns one float per completion") from None


def load_rewards(specs: Sequence[RewardSpec | dict], base_dir: str | Path | None = None) -> list[Reward]:
    """grpo.rewards -> Rewards: the built-ins, and the user functions imported (relative paths against `base_dir`,
    default the working directory). Names are unique: a repeated one gets its index (numeric, numeric_2)."""
    out, seen = [], set()
    for i, s in enumerate(specs):
        key = f"grpo.rewards[{i}]"
        s = s if isinstance(s, RewardSpec) else RewardSpec.model_validate(s)
        if s.name in BUILTIN_REWARDS:
            fn, name = builtin(s), s.name
        else:
            fn = user_function(s.name, key, base_dir)
            name = s.name.rpartition(":")[2]
        if name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        out.append(Reward(name, float(s.weight), fn, key))
    return out


# ---- scoring ---------------------------------------------------------------------------------------------------
def _rows(rows: Sequence, wheres: Sequence[str] | None) -> tuple[list[dict], list[str]]:
    """PromptRows or dicts -> (the dicts the functions see, where each came from)."""
    dicts = [getattr(r, "row", r) for r in rows]
    if wheres is None:
        wheres = [getattr(r, "where", None) or f"row {j + 1} of the rollout batch" for j, r in enumerate(rows)]
    return dicts, list(wheres)


def from_signal(e: BaseException) -> bool:
    """Whether `e`, raised while a reward function ran, is the run's signal handling rather than the function's: a
    Python signal handler (checkpoint/signals.py's, the command line's) raised it, or it is a KeyboardInterrupt
    under Python's default SIGINT handler, where a real Ctrl-C cannot be told from a `raise KeyboardInterrupt`."""
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    codes = {getattr(getattr(h, "__func__", h), "__code__", None) for h in handlers} - {None}
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code in codes:
            return True
        tb = tb.tb_next
    return isinstance(e, KeyboardInterrupt) and handlers[0] is signal.default_int_handler


def _culprit(fn: Callable, prompts, completions, rows) -> tuple[int, BaseException] | None:
    """The first row on which `fn` raises when called with that row alone."""
    for j in range(len(completions)):
        try:
            fn(prompts[j: j + 1], completions[j: j + 1], rows[j: j + 1])
        except BaseException as e:
            if from_signal(e):
                raise
            return j, e
    return None


def _values(r: Reward, out, wheres: list[str]) -> list[float]:
    n, who = len(wheres), f"{r.key} ({r.name})"
    if isinstance(out, (torch.Tensor,)) or type(out).__module__ == "numpy":
        out = out.tolist() if getattr(out, "ndim", 1) else out
    if not isinstance(out, (list, tuple)):
        try:
            if isinstance(out, (str, bytes, dict)):
                raise TypeError
            out = list(out)
        except TypeError:
            raise MegatrainError(f"{who} returned a {type(out).__name__}, not a list of {n} floats (one per "
                                 f"completion)") from None
    if len(out) != n:
        raise MegatrainError(f"{who} returned {len(out)} values for {n} completions (rows {wheres[0]} ... "
                             f"{wheres[-1]}); return one float per completion")
    vals = []
    for j, v in enumerate(out):
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
            v = v.item()
        if not isinstance(v, numbers.Real):
            raise MegatrainError(f"{who} returned {str(v)[:40]!r} ({type(v).__name__}) for the completion of "
                                 f"{wheres[j]}; a reward is a number")
        if not math.isfinite(float(v)):
            raise MegatrainError(f"{who} returned {float(v)} for the completion of {wheres[j]}; a reward must be "
                                 f"finite")
        if abs(float(v)) > FLOAT32_MAX:
            raise MegatrainError(f"{who} returned {float(v):g} for the completion of {wheres[j]}; beyond float32's "
                                 f"range (+-{FLOAT32_MAX:.4g}), in which rewards are summed: scale it down")
        vals.append(float(v))
    return vals


def _call(r: Reward, prompts: list[str], completions: list[str], rows: list[dict], wheres: list[str]) -> list[float]:
    who = f"{r.key} ({r.name})"
    try:
        out = r.fn(prompts, completions, rows)
    except RowProblem as e:
        raise MegatrainError(f"{who}: {wheres[e.index]}: {e}") from None
    except BaseException as e:  # SystemExit, KeyboardInterrupt too: the function's, not the run's
        if from_signal(e):
            raise
        found = _culprit(r.fn, prompts, completions, rows)
        j, err = found if found else (None, e)
        at = f"on the completion of {wheres[j]}" if j is not None else \
            f"on the rollout batch (rows {wheres[0]} ... {wheres[-1]}; no single row raises)"
        raise MegatrainError(f"{who} raised {_first_line(err)} {at}") from None
    return _values(r, out, wheres)


def score(rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], rows: Sequence,
          wheres: Sequence[str] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Score one rollout batch: rows are one per completion (PromptRows, whose .row the functions see and whose
    .where names them in errors, or dicts with `wheres`). -> (total [N] float32: sum of weight x value,
    {name: [N] float32 values, unweighted}). MegatrainError naming the reward and the row on any failure."""
    n = len(completions)
    if not (len(prompts) == len(rows) == n):
        raise ValueError(f"score: {len(prompts)} prompts, {n} completions and {len(rows)} rows; one each")
    dicts, wh = _rows(rows, wheres)
    prompts, completions = list(prompts), list(completions)
    total = torch.zeros(n, dtype=torch.float64)
    per: dict[str, torch.Tensor] = {}
    terms = []
    for r in rewards:
        v = torch.tensor(_call(r, list(prompts), list(completions), list(dicts), wh), dtype=torch.float64)
        per[r.name] = v.float()
        terms.append(r.weight * v)
        total += terms[-1]
    for r, t in zip(rewards, terms):
        if (big := t.abs() > FLOAT32_MAX).any():
            j = int(big.nonzero()[0])
            raise MegatrainError(f"{r.key} ({r.name}): weight {r.weight:g} x {float(per[r.name][j]):g} for the "
                                 f"completion of {wh[j]} is beyond float32's range (+-{FLOAT32_MAX:.4g}), in which "
                                 f"rewards are summed; scale the weight or the reward down")
    if (big := total.abs() > FLOAT32_MAX).any():
        j = int(big.nonzero()[0])
        r = max(zip(rewards, terms), key=lambda rt: abs(float(rt[1][j])))[0]
        raise MegatrainError(f"{r.key} ({r.name}): the weighted sum of grpo.rewards for the completion of {wh[j]}, "
                             f"{float(total[j]):g}, is beyond float32's range (+-{FLOAT32_MAX:.4g}); scale the "
                             f"weights or the rewards down")
    return total.float(), per
