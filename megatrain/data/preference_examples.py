"""Tokenised pairs -> the pairs of a run: bad rows, the evaluation hold-out, over-long pairs cut (counted); their
batches (rows interleaved chosen, rejected); the summary lines and the preview.

A side longer than data.max_seq_len is cut from the prompt's left first, by the same number of prompt tokens on both
sides of the pair (both keep the same end of the prompt), down to one prompt token; then a completion still too long
is cut at its end. data.overlong: drop leaves such pairs out instead. A pair the cut leaves with identical sides
(they differed only past max_seq_len) holds no preference: it is left out. Every cut and drop is counted and shown
in the summary.
Pair k of a run (its pair id) is its index here: rows in file order, bad, held-out and dropped rows left out, so the
same data and settings give the same ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import MegatrainError
from .config import DataConfig
from .examples import Counts, Examples, load_parts, no_examples
from .packing import collate
from .preference import PAIR_ENCODER_VERSION, SIDES, encode_pair_row, pair_features
from .preview import count_lines, efficiency_line, show_example
from .sampler import BatchShape, EpochPlanner, Plan
from .sources import resolve_sources
from .template import IGNORE
from .tokenizer import row_tokens


def check_preference(cfg: DataConfig) -> None:
    """Preference data is all pairs (training and evaluation), unpacked, with loss on completions only."""
    sources = resolve_sources(cfg) + resolve_sources(cfg, eval=True)
    pairs = [s for s in sources if s.format == "preference"]
    for s in sources:
        if s.format != "preference":
            other = f" ({pairs[0].key} is)" if pairs else ""
            raise MegatrainError(f"{s.key}: format '{s.format}' is not preference data{other}; a preference "
                                 f"objective trains on (prompt, chosen, rejected) pairs only")
    if cfg.packing:
        raise MegatrainError("data.packing: preference pairs are not packed (a pair's chosen and rejected sequences "
                             "are rows of one micro-batch); set data.packing: false")
    if cfg.train_on_prompt:
        raise MegatrainError("data.train_on_prompt: preference pairs carry loss on their completions only; set "
                             "data.train_on_prompt: false")


@dataclass
class PairCounts(Counts):
    prompt_cut: int = 0  # pairs whose prompt was cut from its left
    completion_cut: int = 0  # pairs with a completion cut at its end
    identical_cut: int = 0  # pairs dropped: chosen and rejected identical after the cut


class Pairs:
    """The pairs of one side (train or eval). Pair k is parts[part[k]].tokens[row[k]]: its chosen side the tokens
    [cs[k], ce[k]) of chosen_ids, its rejected side [rs[k], re[k]) of rejected_ids."""

    quotas = Examples.quotas  # pairs drawn per epoch from each source

    def __init__(self, sources, parts, part, row, cs, ce, rs, re, source, counts: PairCounts):
        self.sources, self.parts, self.counts = sources, parts, counts
        self.part, self.row, self.cs, self.ce, self.rs, self.re, self.source = part, row, cs, ce, rs, re, source
        cols = [f"{s}_{k}" for s in SIDES for k in ("ids", "labels")]
        self._views = [p.tokens.with_format("numpy", columns=cols) for p in parts]

    def __len__(self) -> int:
        return len(self.row)

    @property
    def lengths(self) -> np.ndarray:
        """The longer side of each pair: what decides a micro-batch's padding."""
        return np.maximum(self.ce - self.cs, self.re - self.rs)

    @property
    def side_lengths(self) -> np.ndarray:
        """[2N] the sides' lengths, chosen and rejected interleaved."""
        return np.stack([self.ce - self.cs, self.re - self.rs], 1).reshape(-1)

    def get(self, k: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """((chosen ids, labels), (rejected ids, labels)) of pair k, int64."""
        r = self._views[self.part[k]][int(self.row[k])]
        out = []
        for side, s, e in (("chosen", self.cs[k], self.ce[k]), ("rejected", self.rs[k], self.re[k])):
            ids = r[f"{side}_ids"][int(s): int(e)].astype(np.int64)
            labels = r[f"{side}_labels"][int(s): int(e)].astype(np.int64)
            labels[0] = IGNORE
            out.append((ids, labels))
        return out[0], out[1]

    def where(self, k: int) -> str:
        p = self.parts[self.part[k]]
        return p.raw.where(p.tokens[int(self.row[k])]["row"])

    def fingerprint(self) -> str:
        """Changes whenever any pair's tokens may: every side's ids and labels as tokenised (each row's length and
        its values, however the files are cut into record batches) and which spans of which rows are the pairs.
        Not the files' names: a data file copied, moved or touched that tokenises alike keeps it, and so do the
        reference log-probs it keys (run/reference.py)."""
        import pyarrow.compute as pc

        h = hashlib.sha256()
        for p in self.parts:
            for name in (f"{s}_{k}" for s in SIDES for k in ("ids", "labels")):
                for chunk in p.tokens.data.column(name).chunks:
                    h.update(np.ascontiguousarray(pc.list_value_length(chunk).to_numpy(), dtype=np.int64))
                    h.update(np.ascontiguousarray(pc.list_flatten(chunk).to_numpy(), dtype=np.int32))
        for a in (self.part, self.row, self.cs, self.ce, self.rs, self.re):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def build_pairs(cfg: DataConfig, tok, side: str = "train") -> Pairs:
    """Load, tokenise (cached) and select the pairs of `side` ("train" or "eval"); raises MegatrainError for bad
    rows (unless data.skip_bad_rows) or when no pair is left."""
    check_preference(cfg)
    S = cfg.max_seq_len
    counts = PairCounts(cut_to=row_tokens(S))
    sources, loaded = load_parts(cfg, tok, side, counts, encoder=encode_pair_row, features=pair_features,
                                 version=PAIR_ENCODER_VERSION)
    cols: dict[str, list] = {k: [] for k in ("part", "row", "cs", "ce", "rs", "re", "source")}
    for pi, (si, part, good) in enumerate(loaded):
        t = part.tokens.data
        Lc, Lr, Pc, Pr, T = (t.column(c).to_numpy().astype(np.int64)[good] for c in
                             ("chosen_length", "rejected_length", "chosen_prompt", "rejected_prompt", "num_targets"))
        over = np.maximum(Lc, Lr) > S
        if cfg.overlong == "drop":
            counts.dropped += int(over.sum())
            good, Lc, Lr, Pc, Pr, T = (a[~over] for a in (good, Lc, Lr, Pc, Pr, T))
            over = over[~over]
        # prompt tokens kept by an over-long pair: as many as the longer completion leaves, at least one; both
        # sides keep the same end of their (shared) prompt, and each completion is cut at its end only as far as
        # its own side needs
        k = np.minimum(np.minimum(Pc, Pr), np.maximum(S - np.maximum(Lc - Pc, Lr - Pr), 1))
        cs, rs = np.where(over, Pc - k, 0), np.where(over, Pr - k, 0)
        ce, re = np.minimum(Lc, cs + S), np.minimum(Lr, rs + S)
        same = np.zeros(len(good), dtype=bool)
        for j in np.flatnonzero(over).tolist():  # only over-long pairs need their tokens read
            sides = _cut_sides(part.tokens[int(good[j])], cs[j], ce[j], rs[j], re[j])
            T[j] = sum(int((lab != IGNORE).sum()) for _, lab in sides)
            same[j] = all(np.array_equal(a, b) for a, b in zip(*sides))
        # a pair whose sides the cut left identical holds no preference (its loss is constant): dropped, counted
        counts.identical_cut += int(same.sum())
        good, Lc, Lr, T, over, cs, ce, rs, re = (a[~same] for a in (good, Lc, Lr, T, over, cs, ce, rs, re))
        counts.truncated += int(over.sum())
        counts.prompt_cut += int(((cs > 0) | (rs > 0)).sum())
        counts.completion_cut += int(((ce < Lc) | (re < Lr)).sum())
        counts.tokens += int((ce - cs + re - rs).sum())
        counts.targets += int(T.sum())
        for key, v in (("part", np.full(len(good), pi)), ("row", good), ("cs", cs), ("ce", ce), ("rs", rs),
                       ("re", re), ("source", np.full(len(good), si))):
            cols[key].append(np.asarray(v, dtype=np.int64))
    arrays = [np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=np.int64) for k in cols]
    pairs = Pairs(sources, [p for _, p, _ in loaded], *arrays, counts)
    counts.examples = len(pairs)
    if not len(pairs):
        err = no_examples(counts, side, S)
        if counts.identical_cut:
            err = MegatrainError(f"{err}, {counts.identical_cut:,} pairs identical after truncation to max_seq_len={S}")
        raise err
    return pairs


def _cut_sides(r: dict, cs: int, ce: int, rs: int, re: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) of a row's chosen side [cs, ce) and rejected side [rs, re), as a batch holds them (nothing
    predicts a side's first token)."""
    out = []
    for side, s, e in (("chosen", cs, ce), ("rejected", rs, re)):
        labels = np.asarray(r[f"{side}_labels"][s:e], dtype=np.int64)
        labels[:1] = IGNORE
        out.append((np.asarray(r[f"{side}_ids"][s:e], dtype=np.int64), labels))
    return out


def pair_batch(pairs: Pairs, ks: list[int], pad: int) -> dict:
    """Pairs ks -> a Batch (packing.collate) of 2 x len(ks) rows, chosen and rejected interleaved, and pair_ids."""
    rows = [[side] for k in ks for side in pairs.get(k)]
    return {**collate(rows, pad), "pair_ids": torch.tensor(list(ks), dtype=torch.int64)}


def side_plan(plan: Plan) -> Plan:
    """A plan of pairs -> the same plan of sides (pair k: sides 2k, 2k+1), for plan_efficiency and its line."""
    return [[[2 * k + j] for row in mb for k in row for j in (0, 1)] for mb in plan]


def once_plan(pairs: Pairs, micro_batch_size: int, group_by_length: bool) -> Plan:
    """Every pair once (evaluation): grouped by length like training, seed 0."""
    once = [int((pairs.source == i).sum()) for i in range(len(pairs.sources))]
    shape = BatchShape(micro_batch_size, 0, False, "best_fit", group_by_length)
    return EpochPlanner(pairs.lengths, pairs.source, once, 0, shape).plan(0)


def pair_count_lines(pairs: Pairs, max_seq_len: int) -> list[str]:
    c = pairs.counts
    over = (f"over-long pairs (a side > max_seq_len={max_seq_len}): {c.truncated:,} truncated ({c.prompt_cut:,} "
            f"with the prompt cut from its left, {c.completion_cut:,} with a completion cut at its end), "
            f"{c.dropped:,} dropped" + (f"; {c.cut:,} rows tokenised only to {c.cut_to:,} tokens from each end "
                                        f"of a side" if c.cut else ""))
    lines = count_lines(pairs, max_seq_len, overlong=over)
    lines[0] = lines[0].replace("examples:", "pairs:", 1)
    if c.identical_cut:
        lines.insert(lines.index(over) + 1, f"pairs identical after truncation to max_seq_len={max_seq_len}: "
                     f"{c.identical_cut:,} dropped (chosen and rejected keep the same tokens: no preference to learn)")
    return [ln.replace("; length min", "; longer side min", 1) for ln in lines]


def pair_summary(pairs: Pairs, plan: Plan, max_seq_len: int) -> str:
    return "\n".join(pair_count_lines(pairs, max_seq_len) + [efficiency_line(side_plan(plan), pairs.side_lengths,
                                                                                False)])


class _Side:
    """One side of the pairs, as preview.show_example reads examples."""

    def __init__(self, pairs: Pairs, j: int):
        self.pairs, self.j, self.sources, self.source = pairs, j, pairs.sources, pairs.source

    def get(self, k: int):
        return self.pairs.get(k)[self.j]

    def where(self, k: int) -> str:
        return self.pairs.where(k)


def render_pair_preview(cfg: DataConfig, tok, pairs: Pairs, n: int) -> str:
    """What `megatrain data CONFIG --preview N` prints for preference data: each pair's two sides, tokens beside
    labels (the prompt masked), then the statistics."""
    lines = []
    for k in range(min(n, len(pairs))):
        for j, side in enumerate(SIDES):
            shown = show_example(tok, _Side(pairs, j), k, len(pairs))
            lines += [shown[0].replace("--- example", f"--- {side} of pair", 1)] + shown[1:]
        lines.append("")
    lines.append("--- statistics")
    return "\n".join(lines + pair_count_lines(pairs, cfg.max_seq_len))
