"""Markdown table of every benchmark JSON under bench/results/ (for bench/README.md), or under the folders given
(a device call's $OUT). A "wall s" column (wall time per step: bench_megatrain.py's and bench_cli.py's
`wall_step_s`) appears when some result has one."""

import json
import sys
from pathlib import Path

COLS = [("label", "run"), ("params", "params (B)"), ("tokens_per_step", "tokens/step"), ("step_s", "step s"),
        ("tokens_per_s", "tokens/s"), ("tflops_6n", "TFLOP/s 6·N"), ("tflops_6n_active", "TFLOP/s 6·N_active"),
        ("mfu", "MFU (attn)"), ("gpu_idle", "GPU idle"),
        ("busy_h2d", "H2D busy"), ("busy_d2h", "D2H busy"), ("gpu_peak_gib", "GPU peak GiB"),
        ("host_peak_rss_gib", "host RSS GiB"), ("host_bytes_per_param", "host B/param")]
WALL = ("wall_step_s", "wall s")


def fmt(key, v):
    if v is None:
        return "-"
    if key == "params":
        return f"{v / 1e9:.2f}"
    if key in ("mfu", "gpu_idle", "busy_h2d", "busy_d2h"):
        return f"{100 * v:.1f}%"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 100 else f"{v:,.0f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def main(root="bench/results"):
    rows = []
    for f in sorted(Path(root).rglob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        r = d.get("result", {}) if isinstance(d, dict) else {}
        if not isinstance(r, dict) or "step_s" not in r:
            continue
        rows.append((f, d, r))
    cols = COLS[:4] + [WALL] + COLS[4:] if any(r.get(WALL[0]) is not None for _, _, r in rows) else COLS
    print("| " + " | ".join(h for _, h in cols) + " | file |")
    print("|" + "---|" * (len(cols) + 1))
    for f, d, r in rows:
        print("| " + " | ".join(fmt(k, r.get(k)) for k, _ in cols) + f" | {f.relative_to(root)} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
