"""Rows of documents -> a Batch; and the two ways of packing documents into rows of max_seq_len tokens.

In a Batch, position ids restart at 0 at each document, which is how the engine finds document boundaries
(attention never crosses them), and the label of each document's first token is -100, so the last token of one
document is never trained to predict the first of the next. Padding goes on the right: pad id, label -100, and
in packed rows positions that restart every PAD_PIECE tokens, so the padding is segments of its own (in unpacked
rows positions that continue the row's; pads come after every real token, so no real token attends to them either
way); it is never counted in `num_real_tokens`.

Why pieces: attention runs within each segment, so its work over a segment of n tokens grows with n². Padding that
continued the last document made one segment of the two, and a long row half full attended over its padding longer
than over its documents (docs/data.md has the figures). In pieces of PAD_PIECE tokens the padding costs at most
PAD_PIECE / 2 per pad token, and adds one segment per piece to the kernel's grid.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .template import IGNORE

PAD_PIECE = 2048  # the longest segment of padding (see the module docstring)


def pack_greedy(order: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Fill rows in the given order, starting a new row when the next document does not fit (next-fit)."""
    rows: list[list[int]] = []
    room = 0
    for k in order.tolist():
        n = int(lengths[k])
        if n > room:
            rows.append([])
            room = capacity
        rows[-1].append(k)
        room -= n
    return rows


def pack_best_fit(order: np.ndarray, lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Best-fit decreasing: longest documents first, each into the open row it fills most tightly.

    Rows are bucketed by their free space; `spaces` is the sorted list of free-space values that have a row, so
    finding the tightest fit is one bisect. Ties keep the given (shuffled) order, so the result depends on it.
    """
    by_len = order[np.argsort(-lengths[order], kind="stable")]
    rows: list[list[int]] = []
    buckets: dict[int, list[int]] = {}
    spaces: list[int] = []
    for k in by_len.tolist():
        n = int(lengths[k])
        i = bisect.bisect_left(spaces, n)
        if i < len(spaces):
            space = spaces[i]
            r = buckets[space].pop()
            if not buckets[space]:
                del buckets[space], spaces[i]
        else:
            r, space = len(rows), capacity
            rows.append([])
        rows[r].append(k)
        left = space - n
        if left > 0:
            if left not in buckets:
                buckets[left] = []
                bisect.insort(spaces, left)
            buckets[left].append(r)
    return rows


def collate(rows: list[list[tuple[np.ndarray, np.ndarray]]], pad_id: int, length: int | None = None,
            packed: bool = False) -> dict:
    """Rows (each a list of (input_ids, labels) documents) -> a Batch of int64 tensors [B, T], T the longest row, or
    `length` when given (packed rows: always max_seq_len, so every micro-batch has one shape - a row a token short
    would make a compiled layer compile and tune again mid-run, and the caching allocator see new sizes). packed:
    the rows' padding in segments of PAD_PIECE tokens (positions restarting); else its positions continue the row's
    (an unpacked row attends over all of it causally, the padding last)."""
    T = max(max(sum(len(ids) for ids, _ in docs) for docs in rows), length or 0)
    B = len(rows)
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), IGNORE, dtype=np.int64)
    position_ids = np.zeros((B, T), dtype=np.int64)
    attention_mask = np.zeros((B, T), dtype=np.int64)
    real = 0
    for b, docs in enumerate(rows):
        t = 0
        for ids, lab in docs:
            n = len(ids)
            input_ids[b, t: t + n] = ids
            labels[b, t: t + n] = lab
            labels[b, t] = IGNORE  # nothing before a document's first token belongs to it
            position_ids[b, t: t + n] = np.arange(n)
            t += n
        real += t
        attention_mask[b, :t] = 1
        if t < T and packed:  # padding: segments of PAD_PIECE tokens at most
            position_ids[b, t:] = np.arange(T - t) % PAD_PIECE
        elif t < T:
            start = position_ids[b, t - 1] + 1 if t else 0
            position_ids[b, t:] = np.arange(start, start + T - t)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "position_ids": torch.from_numpy(position_ids), "attention_mask": torch.from_numpy(attention_mask),
            "num_real_tokens": torch.tensor(real, dtype=torch.int64)}


def pad_work(pad: np.ndarray) -> np.ndarray:
    """Attention's work over padding of `pad` tokens (per row), as the sum of its pieces' squared lengths."""
    full, last = np.divmod(np.asarray(pad, dtype=np.int64), PAD_PIECE)
    return full * float(PAD_PIECE) ** 2 + last.astype(np.float64) ** 2
