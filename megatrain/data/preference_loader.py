"""The interface of preference pairs for the trainer (train.objective dpo, ipo, simpo, orpo):

    is_preference(cfg) -> bool     whether the configured data is pairs (format preference, or ranking entries)
    build_pair_loader(cfg, tokenizer, seed=, micro_batch_size=, grad_accum_steps=, rank=0, world=1) -> PairLoader
        StepLoader's interface (next_step, state_dict, load_state_dict, epoch, summary) and fingerprint()
    build_pair_eval_batches(cfg, tokenizer, micro_batch_size=) -> list[Batch] | None    every held-out pair once
    all_pair_batches(cfg, tokenizer, micro_batch_size=, side="train") -> PairBatches    every pair once, by pair id
    pair_fingerprint(cfg, tokenizer, side="train") -> str

micro_batch_size counts pairs. A pair Batch is packing.collate's dict of 2P rows, chosen and rejected interleaved
(rows 2i, 2i+1 are pair i's), right-padded, labels -100 off the completions, one sequence per row, plus
`pair_ids` int64 [P]: each pair's index in its set (preference_examples.py), stable across runs of the same data and
settings (it keys stored reference log-probs). Pairs are grouped by the length of their longer side, in the seeded
order of sampler.py (EpochPlanner, ResumableSampler), and split between ranks with rank_share like SFT batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import MegatrainError
from .config import DataConfig
from .loader import EvalBatches, StepLoader
from .preference_examples import Pairs, build_pairs, once_plan, pair_batch, pair_summary
from .sources import is_preference
from .sampler import BatchShape, EpochPlanner, ResumableSampler
from .tokenizer import apply_chat_template_override, pad_id


class PairLoader(StepLoader):
    """Yields the micro-batches of pairs of one optimizer step at a time, seeded, resuming exactly."""

    examples: Pairs

    def _batch(self, rows: list[list[int]]) -> dict:
        return pair_batch(self.examples, [k for row in rows for k in row], self.pad_id)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "pairs": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("pairs"):
            raise MegatrainError("data: cannot resume: the checkpoint's data order is of SFT examples, and this run "
                                 "trains on preference pairs")
        super().load_state_dict(state)

    def summary(self) -> str:
        return pair_summary(self.examples, self.sampler.plan, self.cfg.max_seq_len)

    def fingerprint(self) -> str:
        return self.examples.fingerprint()


def build_pair_loader(cfg: DataConfig, tokenizer, *, seed: int, micro_batch_size: int, grad_accum_steps: int,
                      rank: int = 0, world: int = 1) -> PairLoader:
    apply_chat_template_override(tokenizer, cfg.chat_template)
    pairs = build_pairs(cfg, tokenizer, "train")
    shape = BatchShape(micro_batch_size, cfg.max_seq_len, False, cfg.packing_strategy, cfg.group_by_length)
    planner = EpochPlanner(pairs.lengths, pairs.source, pairs.quotas(), seed, shape)
    return PairLoader(cfg, pairs, ResumableSampler(planner), grad_accum_steps, pad_id(tokenizer), rank, world)


def _has_eval(cfg: DataConfig) -> bool:
    return bool(cfg.eval_path or cfg.eval_datasets or cfg.eval_fraction > 0)


def build_pair_eval_batches(cfg: DataConfig, tokenizer, *, micro_batch_size: int) -> EvalBatches | None:
    """Every held-out pair once, grouped by length like training, with the set's counts; None without evaluation
    data."""
    if not _has_eval(cfg):
        return None
    apply_chat_template_override(tokenizer, cfg.chat_template)
    pairs = build_pairs(cfg, tokenizer, "eval")
    pad = pad_id(tokenizer)
    plan = once_plan(pairs, micro_batch_size, cfg.group_by_length)
    return EvalBatches([pair_batch(pairs, [k for row in mb for k in row], pad) for mb in plan],
                       pair_summary(pairs, plan, cfg.max_seq_len))


class PairBatches(Sequence):
    """Every pair of a set once, micro_batch_size pairs a batch in pair id order; batches are made when read."""

    def __init__(self, pairs: Pairs, micro_batch_size: int, pad: int):
        self.pairs, self.micro_batch_size, self.pad = pairs, micro_batch_size, pad

    def __len__(self) -> int:
        return -(-len(self.pairs) // self.micro_batch_size)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        a = (i % len(self)) * self.micro_batch_size
        return pair_batch(self.pairs, list(range(a, min(a + self.micro_batch_size, len(self.pairs)))), self.pad)

    def fingerprint(self) -> str:
        return self.pairs.fingerprint()


def all_pair_batches(cfg: DataConfig, tokenizer, *, micro_batch_size: int, side: str = "train") -> PairBatches | None:
    """Every pair of `side` ("train" or "eval") once, in pair id order (what the reference pass scores); None for
    "eval" without evaluation data."""
    if side == "eval" and not _has_eval(cfg):
        return None
    apply_chat_template_override(tokenizer, cfg.chat_template)
    return PairBatches(build_pairs(cfg, tokenizer, side), micro_batch_size, pad_id(tokenizer))


def pair_fingerprint(cfg: DataConfig, tokenizer, side: str = "train") -> str:
    """The fingerprint of a set of pairs (Pairs.fingerprint): stored reference log-probs are valid while it holds."""
    apply_chat_template_override(tokenizer, cfg.chat_template)
    return build_pairs(cfg, tokenizer, side).fingerprint()


__all__ = ["PairBatches", "PairLoader", "all_pair_batches", "build_pair_eval_batches", "build_pair_loader",
           "is_preference", "pair_fingerprint"]
