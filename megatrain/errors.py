"""User-facing errors: one line that names the key, file, tensor or layer at fault.

Every subcommand reports a user error the same way: `megatrain: error: <message>` on stderr, exit status 2
(argparse's own status for usage errors; `ArgumentParser` below gives its messages the same prefix, after
argparse's usage line).

One line per problem: a problem is one line naming its culprit (the key, file, line, tensor or layer). Several
problems of one config (ConfigError.problems) are a first line counting them, `megatrain: error: N problems in the
config:`, then one indented line each, each naming its key. A newline or carriage return inside a message (a key
or a value the user wrote, a library's multi-line text) is shown escaped, so that no problem spans two lines.
"""

import argparse
import errno
import json
import os
import sys
from pathlib import Path

ERROR_PREFIX = "megatrain: error: "
USER_ERROR_EXIT = 2


class MegatrainError(Exception):
    """A mistake in the user's input or environment. The CLI prints it without a traceback."""


def one_line(text: str) -> str:
    """`text` with its line breaks escaped (\\n, \\r): one line, whatever a user's key or value held."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


class ConfigError(MegatrainError):
    """One or more invalid configuration keys; the message lists every problem at once (see the module's doc)."""

    def __init__(self, *problems: str):
        self.problems = [one_line(p) for p in problems]
        super().__init__(self.problems[0] if len(self.problems) == 1 else
                         f"{len(self.problems)} problems in the config:\n  " + "\n  ".join(self.problems))


def report(e: BaseException) -> int:
    """Print a user error the one way every subcommand does; the exit status to return."""
    print(f"{ERROR_PREFIX}{e if isinstance(e, ConfigError) else one_line(str(e))}", file=sys.stderr)
    return USER_ERROR_EXIT


class ArgumentParser(argparse.ArgumentParser):
    """argparse with the usage line kept and the message line in megatrain's form (exit status 2, as argparse)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(USER_ERROR_EXIT, f"{ERROR_PREFIX}{one_line(message)}\n")


def _whole(text: str, least: int) -> int:
    try:
        n = int(text)
    except ValueError:
        n = least - 1
    if n < least:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least {least}, got '{text}'")
    return n


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _whole(text, 1)


def count(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _whole(text, 0)


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0 (nan, inf, 0 and negatives refused)."""
    import math

    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got '{text}'")
    return x


# ---- reading files -----------------------------------------------------------------------------------------------
def utf8_problem(data: bytes, pos: int, offset: int = 0) -> tuple[int, str]:
    """(line within `data`, description) of the byte at `pos` that is not valid UTF-8; `data` starts at byte
    `offset` of its file."""
    line = data.count(b"\n", 0, pos) + 1
    column = pos - data.rfind(b"\n", 0, pos)
    return line, f"not valid UTF-8 (byte 0x{data[pos]:02x} at column {column}, byte offset {offset + pos})"


def decode_utf8(data: bytes, name) -> str:
    """The text of a file's bytes; bytes that are not UTF-8 are an error naming the file, line, column and offset
    (never replaced silently)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, problem = utf8_problem(data, e.start)
        raise MegatrainError(f"{name}:{line}: {problem}; save the file as UTF-8") from None


def read_text(path) -> str:
    """A text file, strictly UTF-8 (see decode_utf8)."""
    return decode_utf8(Path(path).read_bytes(), path)


# what a document nested deeper than Python's parsers recurse is (RecursionError): refused, naming the file or row
TOO_DEEP = "nested too deeply for Python's parser"


def load_json(path: Path):
    """Parse a JSON file; a syntax error (or a byte that is not UTF-8, or nesting deeper than the parser recurses)
    becomes a MegatrainError naming the file (and the line)."""
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise MegatrainError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
    except RecursionError:
        raise MegatrainError(f"{path}: malformed JSON: {TOO_DEEP}") from None


# ---- paths -------------------------------------------------------------------------------------------------------
NAME_MAX = 255  # bytes in one name of a path (Linux's file systems)
SIBLING_SPARE = len(".partial") + 1  # a folder is first written as `.NAME.partial` beside it (export)


def user_path(value, key: str, spare: int = 0) -> Path:
    """A path the user gave, a leading `~` expanded; refused with one line naming `key` where the system would
    raise later: `~name` of no known user, a loop of symbolic links, a name longer than NAME_MAX bytes (its last
    name less `spare`: what megatrain adds to it for a temporary sibling), a path longer than the system takes."""
    try:
        p = Path(value).expanduser()
    except RuntimeError:
        raise MegatrainError(f"{key}: {value}: there is no home folder for '{str(value).split('/')[0]}'") from None
    for k, part in enumerate(p.parts):
        room = NAME_MAX - (spare if k == len(p.parts) - 1 else 0)
        if len(os.fsencode(part)) > room:
            raise MegatrainError(f"{key}: {p}: the name '{part[:24]}...' is {len(os.fsencode(part))} bytes long; "
                                 f"the file system takes at most {room} here")
    try:
        os.stat(p)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise MegatrainError(f"{key}: {p}: its symbolic links form a loop") from None
        if e.errno == errno.ENAMETOOLONG:
            raise MegatrainError(f"{key}: {p}: the path is longer than the system takes") from None
    return p


def check_dir_target(path, key: str) -> None:
    """A folder the run creates or writes into: not a file, not under a file, and writable where it will be
    created. `key` names it in the message (output.dir, export.dir, ...)."""
    _check_target(user_path(path, key, SIBLING_SPARE), key, folder=True)


def check_file_target(path, key: str) -> None:
    """A file that will be written: not a folder, not under a file, its folder writable or creatable."""
    _check_target(user_path(path, key), key, folder=False)


def _check_target(p: Path, key: str, folder: bool) -> None:
    if p.exists():
        if folder and not p.is_dir():
            raise MegatrainError(f"{key}: {p} is a file, not a directory")
        if not folder and p.is_dir():
            raise MegatrainError(f"{key}: {p} is a directory, not a file")
        if not os.access(p, os.W_OK | (os.X_OK if folder else 0)):
            raise MegatrainError(f"{key}: {p} is not writable")
        return
    for parent in p.parents:  # the nearest one that exists decides
        if parent.exists():
            if not parent.is_dir():
                raise MegatrainError(f"{key}: {p} lies under {parent}, which is a file")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise MegatrainError(f"{key}: cannot create {p}: {parent} is not writable")
            return


def escape_problem(name) -> str | None:
    """Why a file name read from a user's file (a manifest entry, a dataset_info file_name) would leave the folder
    it is relative to: absolute, a `..` part, a backslash, or empty. None when it stays inside."""
    if not isinstance(name, str) or not name:
        return "is not a relative path (empty or not a string)"
    if "\\" in name or "\0" in name:
        return f"'{name}' is not a relative path (backslash or NUL in it)"
    p = Path(name)
    if p.is_absolute() or name.startswith("~"):
        return f"'{name}' is not a relative path"
    if ".." in p.parts:
        return f"'{name}' points outside its folder (a '..' part)"
    return None


def inside(base, name: str, what: str) -> Path:
    """`base / name`, refused with a MegatrainError starting with `what` where `name` leaves `base` (see
    escape_problem), or where a symbolic link along it does."""
    problem = escape_problem(name)
    if problem is None:
        root = Path(base).resolve()
        target = (root / name).resolve()
        if target != root and root not in target.parents:
            problem = f"'{name}' points outside its folder (through a symbolic link to {target})"
    if problem is not None:
        raise MegatrainError(f"{what}: {problem}")
    return Path(base) / name
