"""The tables of a multi-GPU call (results/2026-11-27/x4-h100, x4-h100-b and x4-h100-c; calls/next-x2-h200.sh): scaling over
1/2/4 GPUs and the one-GPU runs, from the bench_cli/bench_deepspeed JSONs in two folders; a run not (yet) there is a
row of "-".

    python bench/x4_tables.py SCALING_DIR [ONEGPU_DIR]

Scaling is reported twice: over the mean of the measured steps (what bench_cli reports) and over the last step
alone, since on x4-h100 the first measured step of each run was still 20-70% slower than the next. The last step's
longest GPU idle stretches (`idle_gaps`, recorded from session 27 on) say where a rank waited.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(folder: Path, name: str) -> dict:
    f = folder / f"{name}.json"
    return json.loads(f.read_text())["result"] if f.is_file() else {}


def cell(value, spec: str, width: int) -> str:
    return format(value, spec).rjust(width) if isinstance(value, (int, float)) else "-".rjust(width)


def scaling(folder: Path) -> list[str]:
    runs = {n: load(folder, f"qwen7b_{n}gpu") for n in (1, 2, 4)}
    last = {n: (r.get("steps") or [{}])[-1] for n, r in runs.items()}
    base_mean, base_last = runs[1].get("tokens_per_s"), last[1].get("tokens_per_s")
    lines = [f"{'GPUs':>4} {'step s':>7} {'tokens/s':>9} {'x 1':>5} {'last step s':>12} {'tokens/s':>9} {'x 1':>5} "
             f"{'TFLOP/s 6N':>11} {'GPU idle':>9} {'GPU peak':>9} {'node PSS GiB':>13} {'plan s':>7}"]
    for n, r in runs.items():
        s = last[n]
        mean_x = r["tokens_per_s"] / base_mean if r.get("tokens_per_s") and base_mean else None
        last_x = s["tokens_per_s"] / base_last if s.get("tokens_per_s") and base_last else None
        plan = (r.get("plan") or {}).get("step_time_s")
        lines.append(f"{n:>4} {cell(r.get('step_s'), '.2f', 7)} {cell(r.get('tokens_per_s'), ',.0f', 9)} "
                     f"{cell(mean_x, '.2f', 5)} {cell(s.get('step_time_s'), '.2f', 12)} "
                     f"{cell(s.get('tokens_per_s'), ',.0f', 9)} {cell(last_x, '.2f', 5)} "
                     f"{cell(r.get('tflops_6n'), '.0f', 11)} {cell(r.get('gpu_idle'), '.1%', 9)} "
                     f"{cell(r.get('gpu_peak_gib'), '.1f', 9)} {cell(r.get('host_node_pss_gib'), '.1f', 13)} "
                     f"{cell(plan, '.2f', 7)}")
    lines.append("targets: 2 GPUs >= 1.9x (issue 13), 4 GPUs >= 3.7x (issue 14); node host memory about one store")
    for n, s in last.items():
        if s.get("idle_gaps"):
            gaps = "; ".join(f"{g['ms']:.0f} ms after {g['after'] or 'start'} before {g['before'] or 'end'}"
                             for g in s["idle_gaps"])
            lines.append(f"{n} GPU(s), last step's longest idle stretches: {gaps}")
    return lines


def status(r: dict) -> str:
    if not r:
        return "-"
    if r.get("status"):
        return r["status"]
    return f"megatrain exited {r['cli_exit_status']}" if r.get("cli_exit_status") else "ran"


def one_gpu(folder: Path) -> list[str]:
    rows = {name: load(folder, name) for name in ("qwen14b_mt", "qwen14b_ds", "qwen32b")}
    keys = ("step_s", "tokens_per_s", "tflops_6n", "gpu_peak_gib", "host_peak_rss_gib", "host_bytes_per_param")
    lines = [f"{'run':<12}" + "".join(f"{k:>21}" for k in keys) + "  status"]
    for name, r in rows.items():
        lines.append(f"{name:<12}" + "".join(cell(r.get(k), '.2f', 21) for k in keys)
                     + f"  {status(r)}")
    mt, ds = rows["qwen14b_mt"].get("tokens_per_s"), rows["qwen14b_ds"].get("tokens_per_s")
    lines.append(f"Qwen2.5-14B megatrain / DeepSpeed ZeRO-3 offload: {mt / ds:.2f}x (target >= 3x; the paper: 1.84x)"
                 if mt and ds else "Qwen2.5-14B ratio: not measured")
    return lines


def main(argv: list[str]) -> int:
    if not argv or len(argv) > 2:
        print(next(line.strip() for line in __doc__.splitlines() if "x4_tables.py " in line), file=sys.stderr)
        return 2
    lines = scaling(Path(argv[0]))
    if len(argv) == 2:
        lines += [""] + one_gpu(Path(argv[1]))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
