"""bench_cli.py --lengths LOW:HIGH: unpacked rows of uniformly random lengths (data.packing false), as an
alpaca-style SFT without packing has them. Each micro-batch is padded to its longest row, so micro-batches have
lengths of their own; the step records' `tokens` count real tokens only (padding is never counted), and their
`compiled_graphs` / `compile_limit_hits` (run/metrics.py) say whether a step compiled the layers again."""

from __future__ import annotations

import json
import random
from pathlib import Path


def parse(spec: str, seq: int) -> tuple[int, int]:
    """LOW:HIGH -> (low, high), or ValueError naming what is wrong."""
    try:
        low, high = (int(x) for x in spec.split(":"))
    except ValueError:
        raise ValueError(f"--lengths {spec}: give LOW:HIGH, two whole numbers of tokens") from None
    if not 2 <= low <= high <= seq:
        raise ValueError(f"--lengths {spec}: need 2 <= LOW <= HIGH <= --seq ({seq})")
    return low, high


def write_rows(path: Path, rows: int, low: int, high: int, n_words: int, seed: int = 0) -> list[int]:
    """`rows` text rows of LOW..HIGH tokens (uniform, seeded): k - 1 words of one token each, plus the EOS the run
    appends (data.add_eos). Returns the rows' lengths in tokens."""
    rng = random.Random(seed)
    lengths = []
    with path.open("w") as f:
        for _ in range(rows):
            k = rng.randint(low, high)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(n_words)}" for _ in range(k - 1))}) + "\n")
            lengths.append(k)
    return lengths


def summary(steps: list[dict], warmup: int, lengths: list[int], seq: int) -> dict:
    """The result's fields of a --lengths run: the rows' mean length and its share of --seq, the graphs compiled per
    step, the measured steps that compiled (`recompiled_steps`: none is the point) and the recompile-limit hits."""
    graphs = [r.get("compiled_graphs") for r in steps]
    return {"row_lengths": [min(lengths), max(lengths)], "row_mean_tokens": sum(lengths) / len(lengths),
            "row_fill": sum(lengths) / len(lengths) / seq, "compiled_graphs_per_step": graphs,
            "recompiled_steps": [r["step"] for r in steps if r["step"] > warmup and r.get("compiled_graphs")],
            "compile_limit_hits": sum(r.get("compile_limit_hits") or 0 for r in steps)}


def line(res: dict) -> str:
    return (f"rows of {res['row_lengths'][0]}..{res['row_lengths'][1]} tokens (mean {res['row_mean_tokens']:.0f}, "
            f"{100 * res['row_fill']:.0f}% of --seq), unpacked: graphs compiled per step "
            f"{res['compiled_graphs_per_step']}, measured steps that compiled {res['recompiled_steps'] or 'none'}, "
            f"recompile-limit hits {res['compile_limit_hits']}")
