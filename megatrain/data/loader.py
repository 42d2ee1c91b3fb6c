"""Minimal pipeline: JSON/JSONL rows in text or alpaca format, right padding, seeded epoch shuffling."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import MegatrainError
from .config import DataConfig

IGNORE = -100
Batch = dict  # {"input_ids", "labels", "position_ids"}: int64 [B, T]


def validate_inputs(cfg: DataConfig) -> None:
    for key, p in (("data.path", cfg.path), ("data.eval_path", cfg.eval_path)):
        if p is None:
            if key == "data.path":
                raise MegatrainError("data.path: no training data given")
            continue
        f = Path(p)
        if not f.is_file():
            raise MegatrainError(f"{key}: file {f} does not exist")
        if f.stat().st_size == 0:
            raise MegatrainError(f"{key}: file {f} is empty")


def _read_rows(path: str) -> list[tuple[int, dict]]:
    f = Path(path)
    text = f.read_text()
    if f.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise MegatrainError(f"{f}:{e.lineno}: malformed JSON: {e.msg}") from None
        if not isinstance(rows, list):
            raise MegatrainError(f"{f}: expected a JSON list of objects")
        return [(i + 1, r) for i, r in enumerate(rows)]
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise MegatrainError(f"{f}:{n}: malformed JSON line: {e.msg}") from None
    if not out:
        raise MegatrainError(f"{f}: no rows")
    return out


def _encode(cfg: DataConfig, tok, path: str, lineno: int, row: dict) -> tuple[list[int], list[int]]:
    def field_(name):
        if not isinstance(row, dict) or name not in row:
            raise MegatrainError(f"{path}:{lineno}: format '{cfg.format}' needs field '{name}'")
        return row[name]

    if cfg.format == "text":
        ids = tok(field_(cfg.text_field), add_special_tokens=True)["input_ids"]
        if tok.eos_token_id is not None:
            ids = ids + [tok.eos_token_id]
        return ids, list(ids)
    instruction, output = field_("instruction"), field_("output")
    inp = row.get("input") or ""
    user = f"{instruction}\n{inp}" if inp else instruction
    msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + \
        [{"role": "user", "content": user}]
    prompt = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": output}], tokenize=True)
    if hasattr(prompt, "keys"):
        prompt, full = prompt["input_ids"], full["input_ids"]
    if full[: len(prompt)] != prompt:
        raise MegatrainError(f"{path}:{lineno}: the chat template does not render the prompt as a prefix")
    return full, [IGNORE] * len(prompt) + full[len(prompt):]


@dataclass
class Examples:
    items: list[tuple[list[int], list[int]]]
    truncated: int = 0
    dropped: int = 0


def _load(cfg: DataConfig, tok, path: str) -> Examples:
    ex = Examples([])
    for lineno, row in _read_rows(path):
        ids, labels = _encode(cfg, tok, path, lineno, row)
        if len(ids) > cfg.max_seq_len:
            if cfg.overlong == "drop":
                ex.dropped += 1
                continue
            ids, labels = ids[: cfg.max_seq_len], labels[: cfg.max_seq_len]
            ex.truncated += 1
        if any(l != IGNORE for l in labels[1:]):
            ex.items.append((ids, labels))
    if not ex.items:
        raise MegatrainError(f"{path}: no usable example (all dropped or without labels)")
    return ex


def _collate(items, pad_id: int) -> Batch:
    T = max(len(i) for i, _ in items)
    ids = torch.full((len(items), T), pad_id, dtype=torch.long)
    labels = torch.full((len(items), T), IGNORE, dtype=torch.long)
    for r, (i, l) in enumerate(items):
        ids[r, : len(i)] = torch.tensor(i)
        labels[r, : len(l)] = torch.tensor(l)
    return {"input_ids": ids, "labels": labels, "position_ids": torch.arange(T).expand(len(items), T).clone()}


@dataclass
class StepLoader:
    examples: Examples
    seed: int
    micro_batch_size: int
    grad_accum_steps: int
    pad_id: int
    epoch: int = 0
    cursor: int = 0
    _order: list[int] = field(default_factory=list)

    def __post_init__(self):
        self._order = self._permutation(self.epoch)

    def _permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.examples.items), generator=g).tolist()

    def _next_example(self):
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        i = self._order[self.cursor]
        self.cursor += 1
        return self.examples.items[i]

    def next_step(self) -> list[Batch]:
        return [_collate([self._next_example() for _ in range(self.micro_batch_size)], self.pad_id)
                for _ in range(self.grad_accum_steps)]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = state["epoch"], state["cursor"]
        self._order = self._permutation(self.epoch)

    def summary(self) -> str:
        e = self.examples
        return f"{len(e.items)} examples, {e.truncated} truncated, {e.dropped} dropped"


def _pad_id(tok) -> int:
    return tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)


def build_train_loader(cfg: DataConfig, tokenizer, *, seed: int, micro_batch_size: int,
                       grad_accum_steps: int) -> StepLoader:
    ex = _load(cfg, tokenizer, cfg.path)
    if cfg.eval_fraction > 0 and not cfg.eval_path:
        n_eval = max(1, int(len(ex.items) * cfg.eval_fraction))
        ex.items = ex.items[n_eval:]
    return StepLoader(ex, seed, micro_batch_size, grad_accum_steps, _pad_id(tokenizer))


def build_eval_batches(cfg: DataConfig, tokenizer, *, micro_batch_size: int) -> list[Batch] | None:
    if cfg.eval_path:
        items = _load(cfg, tokenizer, cfg.eval_path).items
    elif cfg.eval_fraction > 0:
        items = _load(cfg, tokenizer, cfg.path).items
        items = items[: max(1, int(len(items) * cfg.eval_fraction))]
    else:
        return None
    return [_collate(items[i: i + micro_batch_size], _pad_id(tokenizer))
            for i in range(0, len(items), micro_batch_size)]


def preview(cfg: DataConfig, tokenizer, n: int) -> str:
    ex = _load(cfg, tokenizer, cfg.path)
    lines = []
    for ids, labels in ex.items[:n]:
        lines.append(" ".join(f"{tokenizer.decode([i])!r}{'' if l != IGNORE else '*'}" for i, l in zip(ids, labels)))
    return "\n".join(lines)
