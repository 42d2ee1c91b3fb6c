"""Builders shared by the preference run tests (no tests here): pair data from the embedded demo's reversal task
(the correct reversal chosen, a wrong one rejected) and a config on the demo's tiny-llama."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from megatrain.config import DEFAULT_CONFIG
from test_checkpoint_helpers import losses as step_losses, records  # noqa: F401 (the run tests read them here)

DEFAULTS = DEFAULT_CONFIG.parent


def reversal_pairs(src: Path, dst: Path, limit: int | None = None) -> Path:
    """The demo's {"instruction": "reverse abc", "output": "cba"} rows as preference pairs: chosen the correct
    reversal, rejected a wrong one, its first two letters swapped ("bca"; words whose first two letters are the
    same are left out). Telling them apart takes the skill the task is about: the answer starts with the word's
    last letter, then the one before it."""
    out = []
    for line in src.read_text().splitlines():
        r = json.loads(line)
        good = r["output"]
        if len(good) >= 2 and good[0] != good[1]:
            wrong = good[1] + good[0] + good[2:]
            out.append(json.dumps({"prompt": r["instruction"], "chosen": good, "rejected": wrong}))
    dst.write_text("\n".join(out[:limit]) + "\n")
    return dst


def demo_pairs(tmp: Path, train: int | None = None, heldout: int | None = None) -> tuple[Path, Path]:
    return (reversal_pairs(DEFAULTS / "reverse-train.jsonl", tmp / "pairs-train.jsonl", train),
            reversal_pairs(DEFAULTS / "reverse-heldout.jsonl", tmp / "pairs-heldout.jsonl", heldout))


def pair_config(tmp: Path, objective: str = "dpo", *, train_pairs: int | None = 64, heldout: int | None = 16,
                **sections) -> Path:
    """A run of `objective` on the demo model (random init) and reversal pairs; output.dir = tmp/run."""
    train, held = demo_pairs(tmp, train_pairs, heldout)
    cfg = {"model": {"path": str(DEFAULTS / "tiny-llama"), "init": "random"},
           "data": {"path": str(train), "eval_path": str(held), "format": "preference", "max_seq_len": 32,
                    "cache_dir": str(tmp / "cache")},
           "train": {"objective": objective, "steps": 4, "micro_batch_size": 4, "grad_accum_steps": 2,
                     "precision": "fp32", "lr": 3e-3, "warmup_steps": 0, "lr_schedule": "constant",
                     "device": "cpu", "eval_every": 0},
           "output": {"dir": str(tmp / "run")}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / f"{objective}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


