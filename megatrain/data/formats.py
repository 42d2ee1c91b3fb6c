"""Row formats -> one canonical sample. No tokenizer here: only reading columns and checking their shape.

A sample is one of
    {"kind": "text", "text": str}
    {"kind": "chat", "messages": [{"role": system|user|assistant|tool, "content": str, ...}], "tools": list | None,
     "loss_from": int}                  (assistant turns before message index loss_from carry no loss)
    {"kind": "completion", "prompt": str, "completion": str}
Problems with a row raise `RowError` with a message that names the column, message or role at fault; the caller
adds the file and row.
"""

from __future__ import annotations

import json

from ..errors import TOO_DEEP
from .config import CANONICAL_ROLES


class RowError(ValueError):
    """A row that cannot be used; the message names what is wrong with it."""


class Columns:
    """Column lookup that explains itself: errors say which logical column of which format was missing."""

    def __init__(self, row, fmt: str, columns: dict[str, str]):
        if not isinstance(row, dict):
            raise RowError(f"expected an object with the columns of format '{fmt}', got {type(row).__name__}")
        self.row, self.fmt, self.columns = row, fmt, columns

    def name(self, key: str) -> str:
        name = self.columns[key]
        return f"'{name}'" if name == key else f"'{name}' (the {key} column)"

    def get(self, key: str, required: bool = True):
        v = self.row.get(self.columns[key])
        if v is None and required:
            raise RowError(f"missing column {self.name(key)} needed by format '{self.fmt}'")
        return v

    def text(self, key: str, required: bool = True) -> str | None:
        v = self.get(key, required)
        if v is None:
            return None
        if not isinstance(v, str):
            raise RowError(f"column {self.name(key)} must be a string, got {type(v).__name__}")
        return v


def _content(v, where: str) -> str:
    """Message content: a string, or OpenAI-style text parts joined."""
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in v):
        return "".join(str(p.get("text", "")) for p in v)
    raise RowError(f"{where}: content must be a string (or a list of text parts), got {type(v).__name__}")


def parse_tools(v):
    if v is None or v == "" or v == []:
        return None
    if isinstance(v, str):  # LLaMA-Factory keeps tools as a JSON string
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise RowError(f"tools column is not valid JSON: {e.msg}") from None
        except RecursionError:
            raise RowError(f"tools column is not valid JSON: {TOO_DEEP}") from None
    if isinstance(v, dict):
        v = [v]
    if not isinstance(v, list):
        raise RowError(f"tools column must be a list of tool definitions, got {type(v).__name__}")
    return v


def parse_messages(raw, c: Columns, roles: dict[str, str], keep_extra: bool) -> list[dict]:
    if not isinstance(raw, list):
        raise RowError(f"column {c.name('messages')} must be a list of messages, got {type(raw).__name__}")
    role_key, content_key = c.columns["role"], c.columns["content"]
    out = []
    for i, m in enumerate(raw, 1):
        if not isinstance(m, dict):
            raise RowError(f"message {i} must be an object with '{role_key}' and '{content_key}'")
        if role_key not in m:
            raise RowError(f"message {i} has no '{role_key}' key")
        name = m[role_key]
        role = roles.get(name) if isinstance(name, str) else None
        if role is None:
            known = ", ".join(sorted(roles))
            raise RowError(f"unknown role {name!r} in message {i} (known: {known}; map it with data.roles)")
        msg = {k: v for k, v in m.items() if k not in (role_key, content_key)} if keep_extra else {}
        msg["role"] = role
        msg["content"] = _content(m.get(content_key), f"message {i}")
        out.append(msg)
    return out


def _check_conversation(msgs: list[dict], loss_from: int = 0) -> None:
    if not any(m["role"] == "assistant" for m in msgs[loss_from:]):
        raise RowError("the conversation has no assistant turn to learn from")
    for i, m in enumerate(msgs, 1):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
            raise RowError(f"empty assistant turn (message {i})")


def with_system(msgs: list[dict], system: str | None) -> list[dict]:
    if system and system.strip() and not (msgs and msgs[0]["role"] == "system"):
        return [{"role": "system", "content": system}] + msgs
    return msgs


def alpaca_turns(c: Columns, key: str) -> list[dict]:
    """The alpaca layout's history turns and the user turn (column `key` and the input joined by a line break)."""
    user = "\n".join(s for s in (c.text(key), c.text("input", False)) if s)
    if not user.strip():
        raise RowError(f"empty {key} (column {c.name(key)})")
    msgs = []
    history = c.get("history", False) or []
    if not isinstance(history, list):
        raise RowError(f"column {c.name('history')} must be a list of [instruction, response] pairs")
    for i, pair in enumerate(history, 1):
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
            raise RowError(f"history entry {i} must be a pair [instruction, response] of strings")
        if not pair[1].strip():
            raise RowError(f"empty assistant turn (history entry {i})")
        msgs += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return msgs + [{"role": "user", "content": user}]


def to_sample(row, fmt: str, columns: dict[str, str], roles: dict[str, str], blank_ok: bool = False):
    """One row -> a sample (see the module docstring), or None for a blank line of a text file."""
    c = Columns(row, fmt, columns)
    if fmt == "text":
        text = c.text("text")
        if blank_ok:  # a .txt file's sample: the line breaks around a paragraph or document are layout, not text
            text = text.strip("\r\n")
        if not text.strip():
            if blank_ok:
                return None
            raise RowError(f"empty text in column {c.name('text')}")
        return {"kind": "text", "text": text}

    if fmt == "alpaca":
        output = c.text("output")
        msgs = alpaca_turns(c, "instruction")
        if not output.strip():
            raise RowError(f"empty assistant turn (column {c.name('output')})")
        msgs.append({"role": "assistant", "content": output})
        return {"kind": "chat", "messages": with_system(msgs, c.text("system", False)), "tools": None,
                "loss_from": 0}

    if fmt in ("sharegpt", "messages"):
        msgs = parse_messages(c.get("messages"), c, roles, keep_extra=fmt == "messages")
        msgs = with_system(msgs, c.text("system", False))
        _check_conversation(msgs)
        return {"kind": "chat", "messages": msgs, "tools": parse_tools(c.get("tools", False)), "loss_from": 0}

    if fmt == "prompt_completion":
        prompt, completion = c.get("prompt"), c.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise RowError(f"empty completion (column {c.name('completion')})")
            return {"kind": "completion", "prompt": prompt, "completion": completion}
        if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt and completion
            conv = dict(columns, role="role", content="content")
            role_map = {**OPENAI_ROLES, **roles}
            p = parse_messages(prompt, Columns(row, fmt, conv), role_map, keep_extra=True)
            q = parse_messages(completion, Columns(row, fmt, conv), role_map, keep_extra=True)
            msgs = with_system(p + q, c.text("system", False))
            loss_from = len(msgs) - len(q)
            _check_conversation(msgs, loss_from)
            return {"kind": "chat", "messages": msgs, "tools": None, "loss_from": loss_from}
        raise RowError(f"columns {c.name('prompt')} and {c.name('completion')} must both be strings or both "
                       f"lists of messages")
    raise RowError(f"unknown format '{fmt}'")


OPENAI_ROLES = {r: r for r in CANONICAL_ROLES}
