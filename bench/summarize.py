"""Markdown table of every benchmark JSON under bench/results/ (for bench/README.md)."""

import json
import sys
from pathlib import Path

COLS = [("label", "run"), ("params", "params (B)"), ("tokens_per_step", "tokens/step"), ("step_s", "step s"),
        ("tokens_per_s", "tokens/s"), ("tflops_6n", "TFLOP/s 6·N"), ("mfu", "MFU (attn)"), ("gpu_idle", "GPU idle"),
        ("busy_h2d", "H2D busy"), ("busy_d2h", "D2H busy"), ("gpu_peak_gib", "GPU peak GiB"),
        ("host_peak_rss_gib", "host RSS GiB"), ("host_bytes_per_param", "host B/param")]


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
        d = json.loads(f.read_text())
        r = d.get("result", {})
        if "step_s" not in r:
            continue
        rows.append((f, d, r))
    print("| " + " | ".join(h for _, h in COLS) + " | file |")
    print("|" + "---|" * (len(COLS) + 1))
    for f, d, r in rows:
        print("| " + " | ".join(fmt(k, r.get(k)) for k, _ in COLS) + f" | {f.relative_to(root)} |")


if __name__ == "__main__":
    main(*sys.argv[1:])
