"""Data: files -> rows -> samples -> tokens with label masks -> packed or length-grouped micro-batches, in a
seeded order that resumes exactly.

Modules, one job each:
    config.py     the `data:` config section (DataConfig, DatasetSpec)
    sources.py    config -> sources -> files -> raw datasets (JSON/JSONL/parquet/csv/txt, save_to_disk dirs, registry
                  entries); whether they are preference pairs or prompts (read with the config, without torch)
    registry.py   LLaMA-Factory dataset_info.json entries -> source fields, each entry checked
    cache_raw.py  JSON-lines files -> their raw Arrow part a block of lines at a time (cached, memory-mapped again)
    formats.py    a row of text/alpaca/sharegpt/messages/prompt_completion -> one canonical sample
    template.py   a sample -> input_ids and labels through the tokenizer's chat template (incremental rendering)
    encode.py     tokenising whole files with datasets.map, cached under a fingerprint of tokenizer and settings
    examples.py   bad rows, over-long rows and the evaluation hold-out -> the examples of a run, with counts
    packing.py    packing documents into rows; rows -> a Batch
    sampler.py    seeded, epoch-aware, resumable order of micro-batches
    preview.py    what `megatrain data CONFIG --preview N` prints; the run-start summary lines
    tokenizer.py  load_tokenizer; the tokenizer fingerprint; chat template override
    exact_match.py the held-out (prompt, expected answer) pairs of train.exact_match_path
    loader.py     the interface below
    preference.py          a (prompt, chosen, rejected) row -> a pair -> both sides' tokens and labels
    preference_examples.py tokenised pairs -> the pairs of a run (over-long pairs cut, counted); their batches, preview
    preference_loader.py   the pairs' interface for preference objectives (dpo, ipo, simpo, orpo; see there)
    prompts.py    prompts for online RL (data.format prompt, train.objective grpo): rows -> tokenised prompts
                  (chat template with the generation prompt) -> a seeded, resumable order of PromptRows

Interface used by the trainer and the command line (and nothing else of this package):
    load_tokenizer(path) -> PreTrainedTokenizerBase     AutoTokenizer, MegatrainError if missing or unreadable
    validate_inputs(cfg)                                cheap checks before anything is written
    build_train_loader(cfg, tokenizer, seed=, micro_batch_size=, grad_accum_steps=, rank=0, world=1) -> StepLoader
        (rank, world: this process's share of every step, for data-parallel ranks)
        .next_step() -> list[Batch] (grad_accum_steps micro-batches), .state_dict(), .load_state_dict(state),
        .summary() -> str, .epoch
    build_eval_batches(cfg, tokenizer, micro_batch_size=) -> list[Batch] | None
    preview(cfg, tokenizer, n) -> str
    load_exact_match(path) -> list[tuple[str, str]]     train.exact_match_path's (prompt, answer) pairs
    is_preference(cfg), build_pair_loader(...), build_pair_eval_batches(...), all_pair_batches(...),
    pair_fingerprint(...)                               preference pairs (preference_loader.py says how)
    is_prompt(cfg), build_prompt_source(config, tokenizer, seed=, rank=0, world=1) -> PromptSource
        .next_prompts(k) -> list[PromptRow], .state_dict(), .load_state_dict(state), .summary, .epoch
                                                        prompts of train.objective grpo (prompts.py says how)
The loader and preview functions set `data.chat_template`, when given, on the tokenizer object they receive, so a
tokenizer saved with the exported model chats the way it was trained.

A Batch is a dict of CPU int64 tensors:
    input_ids       [B, T]  right-padded
    labels          [B, T]  Hugging Face convention: unshifted, -100 where no loss (prompts, template text,
                            padding, and the first token of every document)
    position_ids    [B, T]  restart at 0 at every packed document: a new document starts wherever
                            position_ids == 0 (a packed row's padding restarts every packing.PAD_PIECE tokens: segments
                            of its own; an unpacked row's continues the row's positions)
    attention_mask  [B, T]  1 on real tokens, 0 on padding (MoE router statistics leave padding out)
    num_real_tokens []      scalar: tokens that are not padding (padding is never counted as tokens)
All errors are MegatrainError with one-line messages naming the key, file and row.
"""

import sys
import types

# each name is imported from its module when first asked for (`megatrain plan` reads the config's data section
# without the loaders, their pyarrow and torch)
_WHERE = {"DataConfig": "config", "DatasetSpec": "config", "load_exact_match": "exact_match", "Batch": "loader",
          "StepLoader": "loader", "build_eval_batches": "loader", "build_train_loader": "loader", "preview": "loader",
          "validate_inputs": "loader", "PairBatches": "preference_loader", "PairLoader": "preference_loader",
          "all_pair_batches": "preference_loader", "build_pair_eval_batches": "preference_loader",
          "build_pair_loader": "preference_loader", "pair_fingerprint": "preference_loader",
          "is_preference": "sources", "PromptRow": "prompts", "PromptSource": "prompts",
          "build_prompt_source": "prompts", "is_prompt": "sources", "render_prompt_preview": "prompts",
          "load_tokenizer": "tokenizer"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


class _Package(types.ModuleType):
    """This package: a submodule named as one of the names above (preview.py, loader.preview) does not take the
    name when it is imported (as `from .loader import preview` rebound it after loader imported preview.py)."""

    def __setattr__(self, name: str, value) -> None:
        if not (name in _WHERE and isinstance(value, types.ModuleType)):
            super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
