"""Data: files -> examples -> tokens with label masks -> micro-batches, in a resumable order.

Interface used by the trainer (and nothing else of this package):
    validate_inputs(cfg)                              cheap checks before anything is written
    build_train_loader(cfg, tokenizer, seed=, micro_batch_size=, grad_accum_steps=) -> StepLoader
    build_eval_batches(cfg, tokenizer, micro_batch_size=) -> list[Batch] | None
    preview(cfg, tokenizer, n) -> str
A Batch is a dict of CPU int64 tensors [B, T]: input_ids, labels (unshifted, -100 = no loss), position_ids.
"""

from .config import DataConfig
from .loader import Batch, StepLoader, build_eval_batches, build_train_loader, preview, validate_inputs

__all__ = ["Batch", "DataConfig", "StepLoader", "build_eval_batches", "build_train_loader", "preview",
           "validate_inputs"]
