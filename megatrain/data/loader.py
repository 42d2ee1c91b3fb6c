"""The interface the trainer and the command line use: checks, the training loader, eval batches, preview."""

from __future__ import annotations

from .config import DataConfig
from .examples import Examples, build_examples
from .packing import collate
from .preference_examples import build_pairs, check_preference, render_pair_preview
from .prompts import check_prompts, render_prompt_preview
from .preview import count_lines, efficiency_line, render_preview
from .sampler import BatchShape, EpochPlanner, ResumableSampler, rank_share
from .sources import check_files, is_preference, is_prompt
from .tokenizer import apply_chat_template_override, pad_id, read_chat_template

Batch = dict  # input_ids, labels, position_ids: int64 [B, T]; num_real_tokens: int64 scalar (see __init__)


def validate_inputs(cfg: DataConfig) -> None:
    """Cheap checks before anything is written: every named file, folder and registry entry exists, non-empty."""
    check_files(cfg)
    if is_preference(cfg):
        check_preference(cfg)
    if is_prompt(cfg):
        check_prompts(cfg)
    if cfg.chat_template:
        read_chat_template(cfg.chat_template)  # a file that exists, is a file, and is UTF-8


def _row_length(cfg: DataConfig) -> int | None:
    """Packed rows are max_seq_len long, however full (packing.collate says why); other rows the longest's length."""
    return cfg.max_seq_len if cfg.packing else None


def _shape(cfg: DataConfig, micro_batch_size: int) -> BatchShape:
    return BatchShape(micro_batch_size, cfg.max_seq_len, cfg.packing, cfg.packing_strategy, cfg.group_by_length)


class StepLoader:
    """Yields the micro-batches of one optimizer step at a time, in a seeded order that resumes exactly."""

    def __init__(self, cfg: DataConfig, examples: Examples, sampler: ResumableSampler, grad_accum_steps: int,
                 pad: int, rank: int = 0, world: int = 1):
        """rank, world: this process's share of each step (sampler.rank_share); grad_accum_steps is per rank."""
        self.cfg, self.examples, self.sampler = cfg, examples, sampler
        self.grad_accum_steps, self.pad_id = grad_accum_steps, pad
        self.rank, self.world = rank, world

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def _batch(self, rows: list[list[int]]) -> Batch:
        return collate([[self.examples.get(k) for k in row] for row in rows], self.pad_id, _row_length(self.cfg),
                       self.cfg.packing)

    def next_step(self) -> list[Batch]:
        drawn = [self.sampler.next() for _ in range(self.grad_accum_steps * self.world)]  # index lists: cheap
        return [self._batch(rows) for rows in rank_share(drawn, self.rank, self.world)]

    def state_dict(self) -> dict:
        return {**self.sampler.state_dict(), "world_size": self.world}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)

    def summary(self) -> str:
        lines = count_lines(self.examples, self.cfg.max_seq_len)
        lines.append(efficiency_line(self.sampler.plan, self.examples.lengths, self.cfg.packing,
                                     self.cfg.max_seq_len))
        return "\n".join(lines)


def build_train_loader(cfg: DataConfig, tokenizer, *, seed: int, micro_batch_size: int,
                       grad_accum_steps: int, rank: int = 0, world: int = 1) -> StepLoader:
    apply_chat_template_override(tokenizer, cfg.chat_template)
    ex = build_examples(cfg, tokenizer, "train")
    planner = EpochPlanner(ex.lengths, ex.source, ex.quotas(), seed, _shape(cfg, micro_batch_size))
    return StepLoader(cfg, ex, ResumableSampler(planner), grad_accum_steps, pad_id(tokenizer), rank, world)


class EvalBatches(list):
    """Every held-out micro-batch once, and `summary`: the set's counts (rows read, skipped, truncated, dropped),
    which the run prints beside the training data's."""

    def __init__(self, batches, summary: str):
        super().__init__(batches)
        self.summary = summary


def build_eval_batches(cfg: DataConfig, tokenizer, *, micro_batch_size: int) -> EvalBatches | None:
    """Every evaluation example once, batched like training (packed, or grouped by length); None without eval data."""
    if not (cfg.eval_path or cfg.eval_datasets or cfg.eval_fraction > 0):
        return None
    apply_chat_template_override(tokenizer, cfg.chat_template)
    ex = build_examples(cfg, tokenizer, "eval")
    once = [int((ex.source == i).sum()) for i in range(len(ex.sources))]
    plan = EpochPlanner(ex.lengths, ex.source, once, 0, _shape(cfg, micro_batch_size)).plan(0)
    pad = pad_id(tokenizer)
    return EvalBatches([collate([[ex.get(k) for k in row] for row in mb], pad, _row_length(cfg), cfg.packing)
                        for mb in plan], "\n".join(count_lines(ex, cfg.max_seq_len)))


def preview(cfg: DataConfig, tokenizer, n: int) -> str:
    apply_chat_template_override(tokenizer, cfg.chat_template)
    if is_prompt(cfg):  # prompts as the model sees them (of the whole Config, grpo.max_new_tokens counts too)
        return render_prompt_preview(cfg, tokenizer, n)
    if is_preference(cfg):  # each pair's two sides
        return render_pair_preview(cfg, tokenizer, build_pairs(cfg, tokenizer, "train"), n)
    return render_preview(cfg, tokenizer, build_examples(cfg, tokenizer, "train"), n)


__all__ = ["Batch", "EvalBatches", "StepLoader", "build_eval_batches", "build_train_loader", "preview",
           "validate_inputs"]
