"""Step time and GPU peak against sequence length, one sequence per step (issue 15): what `megatrain plan` predicts
from config.json alone (lines: Qwen2.5-7B and Llama-3.1-8B on the H200, the placement the planner chooses with no
memory keys, compiled, clipping on, 125 GiB of host RAM, the default H200 profile that the device runs plan with)
and what the H200 runs measured (markers, from the reference runs under bench/results). A length the planner finds
no placement for is left out of its line and listed in the table.

    python bench/plot_long_context.py [--out docs/img/long_context]   (needs matplotlib)

Writes OUT.png and OUT.json (every point), prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from megatrain.planner.profile import load_profile  # noqa: E402
from plan_long_context import plan_row  # noqa: E402
from refruns import RESULTS, result  # noqa: E402

LENGTHS = (32768, 65536, 131072, 262144, 524288, 1048576)
MODELS = ("qwen2.5-7b", "llama-3.1-8b")
# (model, reference run, label of its run, what it was): the H200 runs of one sequence per step, clipping on
MEASURED = [
    ("llama-3.1-8b", "llama-3.1-8b-32k-noclip-h200-cli", "llama-3.1-8b-1x32768-clip",
     "no keys (before reuse_attention)"),
    ("llama-3.1-8b", "llama-3.1-8b-131k-h200-cli", None, "no keys: seq_tile 8192, reuse_attention 32"),
] + [("qwen2.5-7b", "qwen2.5-7b-long-context-h200-cli", f"qwen2.5-7b-1x{k * 1024}-cli",
      "no keys" + (", --extend-context" if k > 128 else "")) for k in (32, 64, 128, 256, 512)]
# Runs on the 80 GB H100 (squares), each beside the plan for its modes with the H100 probe profile (hollow squares):
# (model, reference run, what, GPU budget GiB, clipping)
H100 = RESULTS / "probe-h100" / "profile.json"
MEASURED_H100 = [
    ("llama-3.1-8b", "llama-3.1-8b-524k-h100-cli",
     "no clipping, memory.gpu_budget_gb 74, attention backward in blocks with cuDNN's kernels", 74.0, False),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "img" / "long_context"))
    ap.add_argument("--host-gib", type=float, default=125.0)
    args = ap.parse_args()
    prof = load_profile(None)
    planned = []
    for name in MODELS:
        for seq in LENGTHS:
            _, r = plan_row(name, seq, None, True, prof, args.host_gib)
            planned.append(r)
    measured = []
    for name, path, label, what in MEASURED:
        r = result(path, label)
        measured.append({"model": name, "tokens": r["seq"], "step_s": r["step_s"], "gpu_peak_gib": r["gpu_peak_gib"],
                         "tokens_per_s": r["tokens_per_s"], "file": path, "what": what})
    h100 = []
    for name, path, what, budget, clip in MEASURED_H100:
        r = result(path)
        _, plan = plan_row(name, r["seq"], budget, True, load_profile(H100), args.host_gib, clip)
        h100.append({"model": name, "tokens": r["seq"], "step_s": r["step_s"], "gpu_peak_gib": r["gpu_peak_gib"],
                     "tokens_per_s": r["tokens_per_s"], "file": path, "what": what, "plan": plan})

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.8))
    colors = {"qwen2.5-7b": "tab:blue", "llama-3.1-8b": "tab:orange"}
    for name in MODELS:
        pts = [r for r in planned if r["model"] == name and r["fits"]]
        xs = [r["tokens"] for r in pts]
        ax_t.plot(xs, [r["step_s"] for r in pts], "-", color=colors[name], label=f"{name}, planned")
        ax_m.plot(xs, [r["gpu_peak_gib"] for r in pts], "-", color=colors[name], label=f"{name}, planned")
    for m in measured:
        before = "before" in m["what"]
        style = dict(marker="x" if before else "o", color=colors[m["model"]], linestyle="none", markersize=9)
        label = f"{m['model']}, measured" + (" (before reuse_attention)" if before else "")
        ax_t.plot([m["tokens"]], [m["step_s"]], label=label, **style)
        ax_m.plot([m["tokens"]], [m["gpu_peak_gib"]], label=label, **style)
    for m in h100:
        before = m["what"].startswith("before")
        for key, ax in (("step_s", ax_t), ("gpu_peak_gib", ax_m)):
            ax.plot([m["tokens"]], [m[key]], marker="x" if before else "s", color=colors[m["model"]],
                    linestyle="none", markersize=8,
                    label=f"{m['model']}, measured on the H100 80GB" + (" (flash op's kernels)" if before else ""))
            if not before:  # the plan is today's (cuDNN's kernels): beside the run that used them
                ax.plot([m["tokens"]], [m["plan"][key]], marker="s", mfc="none", color=colors[m["model"]],
                        linestyle="none", markersize=11, label=f"{m['model']}, planned for that H100 run")
    for ax, what in ((ax_t, "step time (s)"), (ax_m, "GPU peak allocated (GiB)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(LENGTHS, [f"{t // 1024}k" for t in LENGTHS])
        ax.set_xlabel("tokens in the one sequence of a step")
        ax.set_ylabel(what)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), fontsize=7)
    ax_t.set_yscale("log")
    ax_m.axhline(prof.gpu_total_bytes / 2**30, color="grey", linestyle=":", linewidth=1)
    fig.suptitle("One sequence per step on one H200 (squares: the H100): megatrain plan (lines, hollow) and measured")
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=110)
    out.with_suffix(".json").write_text(json.dumps({"profile": "default H200", "host_gib": args.host_gib,
                                                    "planned": planned, "measured": measured, "h100": h100},
                                                   indent=1))
    print(f"{'model':<14}{'tokens':>9}  {'fits':<6}{'plan s':>8}{'plan GiB':>10}{'meas s':>8}{'meas GiB':>10}  placement")
    for r in planned:
        ms = [m for m in measured if m["model"] == r["model"] and m["tokens"] == r["tokens"]
              and "before" not in m["what"]]
        ms_s = f"{ms[0]['step_s']:>8.1f}{ms[0]['gpu_peak_gib']:>10.1f}" if ms else f"{'-':>8}{'-':>10}"
        print(f"{r['model']:<14}{r['tokens']:>9}  {str(r['fits']):<6}{r['step_s']:>8.1f}{r['gpu_peak_gib']:>10.1f}"
              f"{ms_s}  {r['placement'] if r['fits'] else r['why'][:90]}")
    for m in h100:
        p = m["plan"]
        print(f"{m['model']:<14}{m['tokens']:>9}  {'H100':<6}{p['step_s']:>8.1f}{p['gpu_peak_gib']:>10.1f}"
              f"{m['step_s']:>8.1f}{m['gpu_peak_gib']:>10.1f}  {m['what']}: {p['placement']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
