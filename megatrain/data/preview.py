"""See what the model sees: processed examples with tokens and labels side by side, and dataset statistics."""

from __future__ import annotations

import numpy as np

from .examples import Examples
from .sampler import BatchShape, EpochPlanner, plan_efficiency
from .template import IGNORE


def _n(x: int) -> str:
    return f"{x:,}"


def count_lines(ex: Examples, max_seq_len: int, overlong: str | None = None) -> list[str]:
    """The counts printed at the start of a run and by `megatrain data --preview`; overlong: the line on over-long
    examples, when another kind of example (preference pairs) counts them its own way."""
    c = ex.counts
    quotas = ex.quotas()
    per_src = ", ".join(f"{s.name} ({s.format}): {_n(int((ex.source == i).sum()))}"
                        + (f" -> {_n(quotas[i])}/epoch" if quotas[i] != int((ex.source == i).sum()) else "")
                        for i, s in enumerate(ex.sources))
    lines = [f"examples: {_n(c.examples)} from {len(ex.sources)} source{'s' * (len(ex.sources) > 1)} [{per_src}]",
             f"rows: {_n(c.rows)} read, {_n(c.bad)} bad rows skipped, {_n(c.held_out)} held out for evaluation"]
    lines += [f"  skipped: {b}" for b in c.bad_examples] + c.warnings
    lines.append(overlong or f"over-long (> max_seq_len={max_seq_len}): {_n(c.truncated)} truncated, "
                             f"{_n(c.dropped)} dropped, {_n(c.split)} split into pieces; {_n(c.no_loss)} examples "
                             f"without any token to learn removed"
                 + (f"; {_n(c.cut)} rows tokenised only to their first {_n(c.cut_to)} tokens" if c.cut else ""))
    lens = ex.lengths
    pct = 100.0 * c.targets / max(c.tokens, 1)
    lines.append(f"tokens: {_n(c.tokens)} ({_n(c.targets)} with loss, {pct:.1f}%); length min {lens.min()}, "
                 f"median {int(np.median(lens))}, mean {lens.mean():.1f}, p95 {int(np.percentile(lens, 95))}, "
                 f"max {lens.max()}")
    return lines


def efficiency_line(plan, lengths: np.ndarray, packing: bool, row_length: int | None = None) -> str:
    """row_length: the length packed rows are padded to (data.max_seq_len)."""
    real, padded = plan_efficiency(plan, lengths, row_length if packing else None)
    rows = sum(len(mb) for mb in plan)
    what = "packing" if packing else "padding"
    return (f"{what} efficiency: {100.0 * real / max(padded, 1):.1f}% real tokens "
            f"({_n(rows)} rows in {_n(len(plan))} micro-batches per epoch)")


def _token(tok, i: int) -> str:
    return repr(tok.decode([i]))


# An example longer than SHOWN_TOKENS shows its first tokens and its last SHOWN_TAIL (text and table): a 512k-token
# document is previewed in a screen, not in half a million lines
SHOWN_TOKENS = 512
SHOWN_TAIL = 64


def _text(tok, ids: np.ndarray, trained: np.ndarray) -> str:
    """The decoded tokens, the runs without loss inside ⟦ ⟧."""
    text, run = [], []
    for i, t in zip(ids.tolist(), trained.tolist()):
        if run and run[-1][1] != t:
            text.append(run)
            run = []
        run.append((i, t))
    if run:
        text.append(run)
    return "".join(tok.decode([i for i, _ in r]) if r[0][1] else "⟦" + tok.decode([i for i, _ in r]) + "⟧"
                   for r in text).replace("\n", "\n  ")


def show_example(tok, ex: Examples, k: int, n_total: int) -> list[str]:
    ids, labels = ex.get(k)
    trained = labels != IGNORE
    n = len(ids)
    spans = [(0, n)] if n <= SHOWN_TOKENS else [(0, SHOWN_TOKENS - SHOWN_TAIL), (n - SHOWN_TAIL, n)]
    gap = [] if len(spans) == 1 else [f"  ... tokens {spans[0][1]}-{spans[1][0] - 1} not shown "
                                      f"({_n(spans[1][0] - spans[0][1])} tokens, "
                                      f"{_n(int(trained[spans[0][1]: spans[1][0]].sum()))} with loss) ..."]
    lines = [f"--- example {k + 1} of {_n(n_total)}: {ex.where(k)} ({ex.sources[ex.source[k]].format}) -- "
             f"{n} tokens, {int(trained.sum())} with loss", "text (no loss inside ⟦ ⟧):"]
    for j, (a, b) in enumerate(spans):
        lines += (gap if j else []) + ["  " + _text(tok, ids[a:b], trained[a:b])]
    lines.append(f"  {'pos':>5} {'id':>7}  {'token':<28} label")
    for j, (a, b) in enumerate(spans):
        lines += gap if j else []
        for p in range(a, b):
            lab = int(labels[p])
            shown = f"{lab:>5}  loss" if lab != IGNORE else " ---  masked"
            lines.append(f"  {p:>5} {int(ids[p]):>7}  {_token(tok, int(ids[p])):<28} {shown}")
    return lines


def render_preview(cfg, tok, ex: Examples, n: int) -> str:
    lines = []
    for k in range(min(n, len(ex))):
        lines += show_example(tok, ex, k, len(ex)) + [""]
    lines.append("--- statistics")
    lines += count_lines(ex, cfg.max_seq_len)
    planner = EpochPlanner(ex.lengths, ex.source, ex.quotas(), 0,
                           BatchShape(1, cfg.max_seq_len, True, cfg.packing_strategy))
    plan = planner.plan(0)
    real, padded = plan_efficiency(plan, ex.lengths)
    rows = sum(len(mb) for mb in plan)
    lines.append(f"packing ({cfg.packing_strategy}{'' if cfg.packing else ', if data.packing were true'}): "
                 f"{_n(rows)} rows of {cfg.max_seq_len}, {100.0 * real / (rows * cfg.max_seq_len):.1f}% filled")
    return "\n".join(lines)
