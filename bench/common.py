"""Shared by the GPU benchmarks: model construction from a config.json, memory readings, the table."""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

H200_BF16_PEAK = 989.4e12  # dense bf16 FLOP/s, H200 SXM datasheet (measured 8192^3 matmul: ~790e12)
HERE = Path(__file__).resolve().parent


def hf_config(path: str, **overrides):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    for k, v in overrides.items():
        if v is not None:
            setattr(cfg, k, v)
    if overrides.get("num_hidden_layers") is not None and getattr(cfg, "layer_types", None):
        types = list(cfg.layer_types)  # the first layers of the real pattern, as bench_cli.py truncates
        cfg.layer_types = (types * (cfg.num_hidden_layers // len(types) + 1))[:cfg.num_hidden_layers]
    return cfg


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def git_rev() -> str:
    """MEGATRAIN_REV when set (the device's copy of the tree carries stale git metadata: the run scripts pass the
    commit they ran), else `git rev-parse` here."""
    if os.environ.get("MEGATRAIN_REV", "unknown") != "unknown":
        return os.environ["MEGATRAIN_REV"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, text=True).strip()
    except Exception:
        return os.environ.get("MEGATRAIN_REV", "unknown")


def machine() -> str:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{gpu}, {os.cpu_count()} CPUs, torch {torch.__version__}"


def write_json(path: str | None, payload: dict) -> None:
    """`payload` with the date, machine, revision and the command that ran (bench/refruns.py add reads them)."""
    command = " ".join([os.path.relpath(sys.argv[0], HERE.parent), *map(shlex.quote, sys.argv[1:])])
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), "git": git_rev(),
               "command": command, **payload}
    text = json.dumps(payload, indent=2)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(_f(r.get(c))) for r in rows)) for c in cols]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(cols)] + [line([_f(r.get(c)) for c in cols]) for r in rows])


def _f(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return "-" if v is None else str(v)


def step_spread(steps: list[dict], key: str) -> dict:
    """The stall check over the measured steps (issue 36: every step after the first within 1.05x of the median):
    each step's seconds (`key`), their median, the slowest step, its ratio to the median, its GPU idle seconds and
    its longest idle stretches of the compute stream (the records' `busy_compute` and `idle_gaps`, when measured),
    and each step's attention span (`attn_len`: packed rows' steps differ in work by their documents)."""
    import statistics

    timed = [r for r in steps if r.get(key) is not None]
    if not timed:
        return {}
    median = statistics.median(r[key] for r in timed)
    slow = max(timed, key=lambda r: r[key])
    busy = slow.get("busy_compute")
    spans = {}  # packed rows: each step's documents' attention span, which sets its work (a slow step of long
    #             documents is no stall)
    if any(r.get("attn_len") for r in timed):
        spans = {"step_attn_len": [round(r.get("attn_len") or 0) for r in timed],
                 "slowest_attn_len": slow.get("attn_len")}
    return {"step_times_s": [round(r[key], 3) for r in timed], "step_median_s": median, "slowest_step": slow["step"],
            "slowest_step_s": slow[key], "slowest_over_median": slow[key] / median if median else None,
            "slowest_idle_s": (1 - busy) * slow[key] if busy is not None else None,
            "slowest_idle_gaps": slow.get("idle_gaps") or [], **spans,
            **optimizer_spread(timed, slow)}


def optimizer_spread(steps: list[dict], slow: dict) -> dict:
    """The CPU AdamW's rate (Gparam/s) in the slowest step and its median over the steps, when the records carry it
    (`optimizer_gparams_per_s`): whether a stall's GPU waited for a slowed optimizer; and its longest piece of work
    in that step against what the piece usually takes: whether the optimizer was held."""
    import statistics

    rates = [r["optimizer_gparams_per_s"] for r in steps if r.get("optimizer_gparams_per_s")]
    if not rates or not slow.get("optimizer_gparams_per_s"):
        return {}
    out = {"optimizer_gparams_per_s_median": statistics.median(rates),
           "slowest_optimizer_gparams_per_s": slow["optimizer_gparams_per_s"]}
    if slow.get("optimizer_longest_s") is not None:  # its longest piece of work, and what that piece usually takes
        out.update(slowest_optimizer_longest_s=slow["optimizer_longest_s"],
                   slowest_optimizer_longest_usual_s=slow.get("optimizer_longest_usual_s"))
    return out


def spread_lines(res: dict) -> str:
    """step_spread's figures as text: every step, the median, the slowest step and its idle stretches."""
    if not res.get("step_times_s"):
        return "steps: none measured"
    spans = res.get("step_attn_len")
    lines = [f"steps (s): {' '.join(f'{t:.2f}' for t in res['step_times_s'])}; median {res['step_median_s']:.2f}; "
             + (f"attention spans {' '.join(f'{a:,}' for a in spans)}; " if spans and len(set(spans)) > 1 else "")
             + f"slowest: step {res['slowest_step']}, {res['slowest_step_s']:.2f} s, {res['slowest_over_median']:.2f}x "
             f"the median" + (f", GPU idle {res['slowest_idle_s']:.2f} s" if res.get("slowest_idle_s") is not None
                               else "")
             + (f", CPU AdamW {res['slowest_optimizer_gparams_per_s']:.2f} Gparam/s (median "
                f"{res['optimizer_gparams_per_s_median']:.2f})" if res.get("slowest_optimizer_gparams_per_s") else "")
             + (f", its longest piece {res['slowest_optimizer_longest_s']:.3f} s (usually "
                f"{res['slowest_optimizer_longest_usual_s']:.3f} s)" if res.get("slowest_optimizer_longest_s") else "")]
    lines += [f"  idle {g['ms']:8.1f} ms after [{g.get('after', '')}] before [{g.get('before', '')}]"
              for g in res.get("slowest_idle_gaps") or []]
    return "\n".join(lines)
