"""User-facing errors: one line that names the key, file, tensor or layer at fault."""

import json
from pathlib import Path


class MegatrainError(Exception):
    """A mistake in the user's input or environment. The CLI prints it without a traceback."""


class ConfigError(MegatrainError):
    """One or more invalid configuration keys; the message lists every problem at once."""


def load_json(path: Path):
    """Parse a JSON file; a syntax error becomes a MegatrainError naming the file and line."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise MegatrainError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
