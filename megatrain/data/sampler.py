"""The order of examples: seeded, epoch-aware, resumable to the exact next micro-batch.

Each epoch's plan is a pure function of (seed, epoch, example lengths, sources' quotas, batch shape), so the state
of the sampler is just (epoch, cursor): the number of micro-batches of the epoch already handed out. Restoring it
recomputes the epoch's plan and continues at the cursor.

An epoch draws each source's quota (weight x its size, or num_samples): whole copies of the source plus a fresh
random subset for the fraction, then shuffles everything. The plan then groups examples into micro-batches:
- packing: documents packed into rows of max_seq_len (best-fit decreasing then rows shuffled, or greedy in the
  shuffled order), micro_batch_size rows per micro-batch;
- no packing, group_by_length: the shuffled order is cut into windows of 64 micro-batches, each window sorted by
  length and cut into micro-batches (little padding), the micro-batches shuffled, the largest moved to the front
  (an out-of-memory shows at the first step, not hours later);
- otherwise: micro-batches in the shuffled order.
Only the last micro-batch of an epoch may hold fewer than micro_batch_size rows.

Several ranks (megatrain/distributed): every rank draws the whole step's micro-batches, grad_accum_steps per rank
in all, and keeps its own contiguous block of them (`rank_share`), so the ranks read disjoint parts of each step
and together exactly what one process with all of them would. The state stays (epoch, cursor), the same on every
rank; a different number of ranks continues at the same next micro-batch (the step's micro-batches are cut
differently, none skipped or repeated).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np

from ..errors import MegatrainError
from .packing import pack_best_fit, pack_greedy, pad_work

GROUP_WINDOW = 64  # micro-batches per length-sorting window

Plan = list[list[list[int]]]  # micro-batches -> rows -> example indices


@dataclass(frozen=True)
class BatchShape:
    micro_batch_size: int
    max_seq_len: int
    packing: bool = False
    packing_strategy: str = "best_fit"
    group_by_length: bool = True


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed % (1 << 63), epoch, stream]))


class EpochPlanner:
    def __init__(self, lengths: np.ndarray, source: np.ndarray, quotas: list[int], seed: int, shape: BatchShape):
        self.lengths, self.source, self.quotas, self.seed, self.shape = lengths, source, quotas, seed, shape
        self._by_source = [np.flatnonzero(source == s) for s in range(len(quotas))]

    def order(self, epoch: int) -> np.ndarray:
        """The examples of this epoch (each source's quota), shuffled."""
        rng = _rng(self.seed, epoch, 0)
        picks = []
        for idx, q in zip(self._by_source, self.quotas):
            if len(idx) == 0:
                continue
            copies, rest = divmod(q, len(idx))
            picks += [np.tile(idx, copies), np.sort(rng.choice(idx, rest, replace=False))]
        return rng.permutation(np.concatenate(picks))

    def plan(self, epoch: int) -> Plan:
        """Without the cyclic garbage collector while it runs: a plan is a million small lists, which set the
        collector off again and again over every object of the process (3x its time; none of them is a cycle)."""
        was = gc.isenabled()
        gc.disable()
        try:
            return self._plan(epoch)
        finally:
            if was:
                gc.enable()

    def _plan(self, epoch: int) -> Plan:
        sh, L = self.shape, self.lengths
        order = self.order(epoch)
        rng = _rng(self.seed, epoch, 1)
        B = sh.micro_batch_size
        if sh.packing:
            if sh.packing_strategy == "best_fit":
                rows = pack_best_fit(order, L, sh.max_seq_len)
                rows = [rows[i] for i in rng.permutation(len(rows))]
            else:
                rows = pack_greedy(order, L, sh.max_seq_len)
            return [rows[j: j + B] for j in range(0, len(rows), B)]
        if not sh.group_by_length:
            return [[[k] for k in order[j: j + B].tolist()] for j in range(0, len(order), B)]
        window = B * GROUP_WINDOW
        mbs = []
        for w in range(0, len(order), window):
            chunk = order[w: w + window]
            chunk = chunk[np.argsort(-L[chunk], kind="stable")]
            mbs += [chunk[j: j + B] for j in range(0, len(chunk), B)]
        short = [mbs.pop()] if len(mbs[-1]) < B else []  # the remainder of the epoch stays last
        mbs = [mbs[i] for i in rng.permutation(len(mbs))]
        if mbs:
            biggest = int(np.argmax([L[mb].max() for mb in mbs]))
            mbs.insert(0, mbs.pop(biggest))
        return [[[k] for k in mb.tolist()] for mb in mbs + short]


def _docs_by_row(plan: Plan, lengths: np.ndarray) -> tuple[int, np.ndarray, np.ndarray]:
    """A plan's rows laid end to end: (how many, the row of each document, each document's length), int64."""
    rows = [row for mb in plan for row in mb]
    per_row = np.fromiter(map(len, rows), np.int64, len(rows))
    ks = np.fromiter((k for row in rows for k in row), np.int64, int(per_row.sum()))
    return len(rows), np.repeat(np.arange(len(rows)), per_row), lengths[ks].astype(np.int64)


def run_part(plan: Plan, cursor: int, count: int) -> Plan:
    """The micro-batches of an epoch's plan that a run of `count` more micro-batches from `cursor` trains, for the
    planner to time the run at (a short run's rows can be far from its epoch's average: packed rows of long
    documents differ by row in their attention's work); the whole plan when the run reaches past the epoch's end
    (the later epochs' plans are drawn alike)."""
    return plan if cursor + count > len(plan) else plan[cursor: cursor + count]


def micro_batch_shapes(plan: Plan, lengths: np.ndarray, row_length: int | None = None) -> tuple[np.ndarray, np.ndarray,
                                                                                                 np.ndarray]:
    """Per micro-batch of a plan: (rows, the padded row length: its longest row or row_length if longer, real
    tokens). Numpy over all rows at once: a million examples in a second."""
    per_mb = np.fromiter(map(len, plan), np.int64, len(plan))
    n, row_of, d = _docs_by_row(plan, lengths)
    if not n:
        return per_mb, np.zeros(len(plan), np.int64), np.zeros(len(plan), np.int64)
    row_lens = np.zeros(n, np.int64)
    np.add.at(row_lens, row_of, d)
    mb_of_row = np.repeat(np.arange(len(plan)), per_mb)
    longest, real = np.zeros(len(plan), np.int64), np.zeros(len(plan), np.int64)
    np.maximum.at(longest, mb_of_row, row_lens)
    np.add.at(real, mb_of_row, row_lens)
    return per_mb, np.maximum(longest, row_length or 0), real


def plan_efficiency(plan: Plan, lengths: np.ndarray, row_length: int | None = None) -> tuple[int, int]:
    """(real tokens, tokens in the padded micro-batches) of a plan; row_length: rows padded to it (packed rows)."""
    rows, padded, real = micro_batch_shapes(plan, lengths, row_length)
    return int(real.sum()), int((rows * padded).sum())


def packed_span(plan: Plan, lengths: np.ndarray, row_length: int) -> float:
    """The attention span per token of a plan's packed rows of row_length tokens: attention's work over each
    segment (a document, a piece of padding: packing.collate) grows with its length squared, so the rows' work is
    that of every token attending over (sum d² + the padding's pieces²) / (rows x row_length) tokens: what the
    planner counts each token of a row at (planner Workload.attn_len). 0.0 for a plan of no rows."""
    n, row_of, d = _docs_by_row(plan, lengths)
    if not n:
        return 0.0
    pad = np.maximum(row_length - np.bincount(row_of, weights=d, minlength=n).astype(np.int64), 0)
    return (float((d.astype(np.float64) ** 2).sum()) + float(pad_work(pad).sum())) / (n * row_length)


class ResumableSampler:
    """Hands out the micro-batches of epoch after epoch; its state is (epoch, cursor) plus checks."""

    def __init__(self, planner: EpochPlanner):
        self.planner = planner
        self.epoch, self.cursor = 0, 0
        self._plan: Plan | None = None

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = self.planner.plan(self.epoch)
        return self._plan

    def next(self) -> list[list[int]]:
        if self.cursor >= len(self.plan):
            self.epoch, self.cursor, self._plan = self.epoch + 1, 0, None
        mb = self.plan[self.cursor]
        self.cursor += 1
        return mb

    def _identity(self) -> dict:
        p = self.planner
        return {"seed": p.seed, "examples": int(len(p.lengths)), "tokens": int(p.lengths.sum()),
                "quotas": [int(q) for q in p.quotas], "micro_batch_size": p.shape.micro_batch_size,
                "max_seq_len": p.shape.max_seq_len, "packing": p.shape.packing,
                "packing_strategy": p.shape.packing_strategy, "group_by_length": p.shape.group_by_length}

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        now = self._identity()
        for k, v in now.items():
            if k in state and state[k] != v:
                raise MegatrainError(f"data: cannot resume the exact sample order: {k} was {state[k]} in the "
                                     f"checkpoint and is {v} now (the data or batch settings changed)")
        self.epoch, self.cursor, self._plan = int(state["epoch"]), int(state["cursor"]), None


def rank_share(step_microbatches: list, rank: int, world: int) -> list:
    """Rank `rank`'s micro-batches of a step drawn for `world` ranks: the rank-th of `world` equal blocks."""
    if len(step_microbatches) % world:
        raise ValueError(f"{len(step_microbatches)} micro-batches do not split between {world} ranks")
    per = len(step_microbatches) // world
    return step_microbatches[rank * per: (rank + 1) * per]
