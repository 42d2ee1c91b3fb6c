"""Tokenised parts -> the examples of a run: bad rows, over-long rows and the evaluation hold-out applied.

An example is a span [start, end) of one tokenised row, kept as numpy index arrays (the tokens stay in the
memory-mapped Arrow files). Counts of everything removed or changed are kept for the run summary and preview.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from typing import TYPE_CHECKING

import numpy as np
import pyarrow.compute as pc

from ..errors import MegatrainError
from .cache_raw import read_part
from .config import DataConfig
from .encode import cache_root, tokenise
from .sources import RawPart, Source, resolve_sources, source_files
from .template import IGNORE, EncodeOptions, check_chat_template
from .tokenizer import row_tokens

if TYPE_CHECKING:
    from datasets import Dataset

HOLDOUT_SEED = 20240917  # the eval hold-out does not depend on the training seed: it stays put across runs


@dataclass
class Counts:
    rows: int = 0  # rows read (blank lines of text files excluded)
    bad: int = 0  # malformed rows skipped (data.skip_bad_rows)
    held_out: int = 0  # rows moved to the evaluation set (data.eval_fraction)
    truncated: int = 0
    cut: int = 0  # rows tokenised only to cut_to tokens (tokenizer.row_tokens); truncated or dropped too
    cut_to: int = 0
    dropped: int = 0  # over-long, data.overlong: drop
    split: int = 0  # over-long documents cut into pieces, data.overlong: split
    no_loss: int = 0  # examples without any token to learn (e.g. all replies cut off by truncation)
    examples: int = 0
    tokens: int = 0
    targets: int = 0  # tokens with a label
    bad_examples: list[str] = field(default_factory=list)  # the first few skipped rows, with their reason
    warnings: list[str] = field(default_factory=list)  # said once in the summary (the chat template's)


@dataclass
class Part:
    raw: RawPart
    tokens: Dataset  # with input_ids, labels, row, error, length, num_targets


class Examples:
    """The examples of one side (train or eval) of a run. Example k is parts[part[k]].tokens[row[k]][start:end]."""

    def __init__(self, sources: list[Source], parts: list[Part], part, row, start, end, source, counts: Counts):
        self.sources, self.parts, self.counts = sources, parts, counts
        self.part, self.row, self.start, self.end, self.source = part, row, start, end, source
        self._views = [p.tokens.with_format("numpy", columns=["input_ids", "labels"]) for p in parts]

    def __len__(self) -> int:
        return len(self.start)

    @property
    def lengths(self) -> np.ndarray:
        return self.end - self.start

    def get(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        r = self._views[self.part[k]][int(self.row[k])]
        s, e = int(self.start[k]), int(self.end[k])
        ids = r["input_ids"][s:e].astype(np.int64)
        labels = r["labels"][s:e].astype(np.int64)
        labels[0] = IGNORE  # also for the later pieces of a split document
        return ids, labels

    def where(self, k: int) -> str:
        p = self.parts[self.part[k]]
        row_no = p.tokens[int(self.row[k])]["row"]
        piece = f" (tokens {self.start[k]}-{self.end[k]})" if self.start[k] else ""
        return p.raw.where(row_no) + piece

    def quotas(self) -> list[int]:
        """Examples drawn per epoch from each source: num_samples, or weight x its example count."""
        out = []
        for i, s in enumerate(self.sources):
            n = int((self.source == i).sum())
            q = s.num_samples if s.num_samples else int(round(s.weight * n))
            out.append(max(q, 1) if n else 0)
        return out


def _holdout(n: int, fraction: float) -> np.ndarray:
    """Boolean mask of the rows held out for evaluation: a fixed random share of them (at least one)."""
    mask = np.zeros(n, dtype=bool)
    if fraction <= 0 or n < 2:
        return mask
    k = min(n - 1, max(1, int(round(n * fraction))))
    mask[np.random.default_rng(HOLDOUT_SEED).permutation(n)[:k]] = True
    return mask


def _targets(labels: np.ndarray, s: int, e: int) -> int:
    return int((labels[s + 1: e] != IGNORE).sum())


def load_parts(cfg: DataConfig, tok, side: str, counts: Counts, **tokenise_kw):
    """Load and tokenise (cached) the files of `side`: "train", or "eval" (eval files, or the hold-out of the
    training rows); bad rows raise (or are skipped and counted), blank ones left out. -> (sources, [(source index,
    Part, its rows in use)]). tokenise_kw: tokenise()'s encoder, features, version (preference.py's pairs)."""
    eval_files = side == "eval" and (cfg.eval_path or cfg.eval_datasets)
    sources = resolve_sources(cfg, eval=bool(eval_files))
    if not sources:
        raise MegatrainError("data.path: no training data given" if side == "train" else
                             "data: no evaluation data given")
    pairs = [s for s in sources if s.format == "preference"]
    if pairs and "encoder" not in tokenise_kw:
        raise MegatrainError(f"{pairs[0].key}: preference pairs (format 'preference') train with a preference "
                             f"objective (train.objective: dpo, ipo, simpo or orpo), not next-token loss")
    check_tokenizer(cfg, tok, sources, counts)
    opts = EncodeOptions(cfg.train_on_prompt, cfg.mask_history, cfg.add_eos, counts.cut_to, cfg.overlong == "split")
    root = cache_root(cfg)
    out = []
    for si, src in enumerate(sources):
        for f in source_files(src):
            raw = read_part(src, f, root)
            if not len(raw.dataset):  # (the readers refuse most such files, naming why: an empty array, ...)
                raise MegatrainError(f"{src.key}: file {f} holds no rows")
            tokens = tokenise(raw, tok, opts, root, cfg.num_proc, fail_fast=not cfg.skip_bad_rows, **tokenise_kw)
            table = tokens.data
            length = table.column("length").to_numpy().astype(np.int64)
            counts.cut += int(pc.sum(pc.greater(table.column("cut_chars"), 0)).as_py() or 0)
            bad = pc.not_equal(table.column("error"), "").to_numpy(zero_copy_only=False)
            if bad.any():
                first = np.flatnonzero(bad)
                if not cfg.skip_bad_rows:
                    r = tokens[int(first[0])]
                    raise MegatrainError(f"{raw.where(r['row'])}: {r['error']} "
                                         f"(set data.skip_bad_rows: true to skip and count such rows)")
                counts.bad += len(first)
                for i in first[: 3 - len(counts.bad_examples)]:
                    r = tokens[int(i)]
                    counts.bad_examples.append(f"{raw.where(r['row'])}: {r['error']}")
            good = np.flatnonzero(~bad & (length > 0))
            if not len(good) and not bad.any():  # only blank rows (white space that bytes.strip keeps)
                raise MegatrainError(f"{src.key}: file {f} holds no rows (only blank ones)")
            counts.rows += len(good) + int(bad.sum())
            if side == "train" or not eval_files:
                held = _holdout(len(good), cfg.eval_fraction)
                counts.held_out += int(held.sum())
                good = good[held] if side == "eval" else good[~held]
            out.append((si, Part(raw, tokens), good))
    return sources, out


TEMPLATED = ("alpaca", "sharegpt", "messages", "prompt_completion", "preference")  # replies through chat_pieces


def check_tokenizer(cfg: DataConfig, tok, sources: list[Source], counts: Counts) -> None:
    """What the sources need of the tokenizer, checked before a row is tokenised: an EOS token where data.add_eos
    appends one (format text, prompt_completion's strings, preference pairs without a chat template: examples would
    end without it, silently); a chat template that is valid Jinja and writes a generation prompt
    (template.check_chat_template; a template without one is a warning in counts)."""
    fmts, folder = {s.format for s in sources}, tok.name_or_path or "(unnamed)"
    plain = fmts & {"text", "prompt_completion"} | (fmts & {"preference"} if not tok.chat_template else set())
    if cfg.add_eos and tok.eos_token_id is None and plain:
        raise MegatrainError(f"data.add_eos: the tokenizer in {folder} has no eos_token, so the examples "
                             f"of format '{sorted(plain)[0]}' cannot end with one; set data.add_eos: false (or give "
                             f"the tokenizer an eos_token)")
    if tok.chat_template and fmts - {"text"}:
        t = cfg.chat_template
        origin = f"tokenizer: the chat template in {folder}" if not t else \
            "data.chat_template" if "{" in t else f"data.chat_template: {t}"
        warning = check_chat_template(tok, origin)
        if warning and fmts & set(TEMPLATED) and warning not in counts.warnings:
            counts.warnings.append(warning)


def no_examples(counts: Counts, side: str, max_seq_len: int) -> MegatrainError:
    what = "training" if side == "train" else "evaluation"
    c = counts
    return MegatrainError(f"data: no usable {what} example: {c.rows} rows read, {c.bad} bad, {c.dropped} dropped "
                          f"as longer than max_seq_len={max_seq_len}, {c.no_loss} without any token to learn"
                          + (f", {c.held_out} held out for evaluation" if side == "train" and c.held_out else ""))


def build_examples(cfg: DataConfig, tok, side: str = "train") -> Examples:
    """Load, tokenise (cached) and select the examples of `side`: "train", or "eval" (eval files, or the
    hold-out of the training rows). Raises MegatrainError for bad rows (unless skipped) or nothing usable."""
    counts = Counts(cut_to=row_tokens(cfg.max_seq_len))
    sources, loaded = load_parts(cfg, tok, side, counts)
    parts: list[Part] = []
    cols: dict[str, list] = {k: [] for k in ("part", "row", "start", "end", "source")}
    for pi, (si, part, good) in enumerate(loaded):
        parts.append(part)
        table = part.tokens.data
        length = table.column("length").to_numpy().astype(np.int64)
        n_targets = table.column("num_targets").to_numpy().astype(np.int64)
        _select(cfg, part.tokens, good, length, n_targets, cfg.max_seq_len, counts, cols, pi, si)
    arrays = [np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=np.int64)
              for k in ("part", "row", "start", "end", "source")]
    ex = Examples(sources, parts, *arrays, counts)
    counts.examples = len(ex)
    if not len(ex):
        raise no_examples(counts, side, cfg.max_seq_len)
    return ex


def _select(cfg, tokens, rows, length, n_targets, S, counts, cols, pi, si) -> None:
    """Apply data.overlong to the rows of one part and append the resulting example spans."""
    L = length[rows]
    fits = rows[L <= S]
    spans = [(fits, np.zeros(len(fits), dtype=np.int64), length[fits], n_targets[fits])]  # targets exclude pos 0
    over = rows[L > S]
    if cfg.overlong == "drop":
        counts.dropped += len(over)
    elif len(over):
        r_, s_, e_, t_ = [], [], [], []
        for r in over.tolist():  # only over-long rows need their labels read
            labels = np.asarray(tokens[r]["labels"])
            if cfg.overlong == "truncate":
                counts.truncated += 1
                pieces = [(0, S)]
            else:  # split: consecutive pieces of max_seq_len; a last piece of one token has nothing to predict
                counts.split += 1
                pieces = [(s, min(s + S, len(labels))) for s in range(0, len(labels), S) if len(labels) - s >= 2]
            for s, e in pieces:
                r_.append(r), s_.append(s), e_.append(e), t_.append(_targets(labels, s, e))
        spans.append(tuple(np.asarray(x, dtype=np.int64) for x in (r_, s_, e_, t_)))
    for r, s, e, t in spans:
        keep = t > 0
        counts.no_loss += int((~keep).sum())
        r, s, e = r[keep], s[keep], e[keep]
        counts.tokens += int((e - s).sum())
        counts.targets += int(t[keep].sum())
        for k, v in (("part", np.full(len(r), pi)), ("row", r), ("start", s), ("end", e),
                     ("source", np.full(len(r), si))):
            cols[k].append(v.astype(np.int64))
