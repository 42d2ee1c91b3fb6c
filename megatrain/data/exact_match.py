"""train.exact_match_path: the held-out (prompt, expected answer) pairs the run's exact match is measured on."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import TOO_DEEP, MegatrainError, read_text
from .sources import invalid_text


def load_exact_match(path: str) -> list[tuple[str, str]]:
    """(prompt, expected answer) pairs of an alpaca JSON-lines file; every problem names the file and line."""
    key = "train.exact_match_path"
    p = Path(path).expanduser()
    if not p.exists():
        raise MegatrainError(f"{key}: {p} does not exist")
    if p.is_dir():
        raise MegatrainError(f"{key}: {p} is a directory; expected an alpaca JSON-lines file")
    try:
        text = read_text(p)
    except MegatrainError as e:
        raise MegatrainError(f"{key}: {e}") from None
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MegatrainError(f"{key}: {p}:{n}: malformed JSON: {e.msg} (column {e.colno})") from None
        except RecursionError:
            raise MegatrainError(f"{key}: {p}:{n}: malformed JSON: {TOO_DEEP}") from None
        if not isinstance(row, dict):
            raise MegatrainError(f"{key}: {p}:{n}: expected an alpaca row (an object with instruction, output), "
                                 f"got {type(row).__name__}")
        for col, required in (("instruction", True), ("input", False), ("output", True)):
            v = row.get(col)
            if v is None and required:
                raise MegatrainError(f"{key}: {p}:{n}: missing key '{col}' (an alpaca row has instruction, "
                                     f"output and optionally input)")
            if v is not None and not isinstance(v, str):
                raise MegatrainError(f"{key}: {p}:{n}: '{col}' must be a string, got {type(v).__name__}")
            if v and (bad := invalid_text(v)):
                raise MegatrainError(f"{key}: {p}:{n}: '{col}': {bad}")
        prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        pairs.append((prompt, row["output"]))
    if not pairs:
        raise MegatrainError(f"{key}: {p} holds no rows")
    return pairs
