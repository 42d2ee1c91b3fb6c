"""GPU peak against depth and against tokens per step, before and after issue 11: what `megatrain plan` predicts
(lines) with the default placement (every layer's input and every finished gradient on the GPU: the engine before
placements) and with the placement the planner chooses (no memory keys; or under memory.gpu_budget_gb), and what the
GPU runs measured (markers: torch.cuda.max_memory_allocated).

    python bench/plot_gpu_memory.py [--out bench/results/2026-11-24/gpu_memory]   (needs matplotlib)

Planned with the H200 probe (bench/results/2026-11-21/h200_profile.json), compiled layers, from config.json alone.
Writes OUT.png and OUT.json (every point), prints a table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from transformers import AutoConfig  # noqa: E402

from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner import Workload, make_plan  # noqa: E402
from megatrain.planner.placement import FREE_ALL  # noqa: E402
from megatrain.planner.profile import GiB, load_profile  # noqa: E402

PROFILE = load_profile(HERE / "results" / "2026-11-21" / "h200_profile.json")
R = "bench/results/"
MEASURED = {  # (series, x, GPU peak GiB, result file)
    "depth": [("default placement (H200)", 16, None, R + "2026-11-21/depth131k_16.json"),
              ("hand-set spill (H200, 2026-11-21)", 32, None, R + "2026-11-21/depth131k_32.json"),
              ("hand-set spill (H200, 2026-11-21)", 64, None, R + "2026-11-21/depth131k_64.json"),
              ("hand-set spill (H200, 2026-11-21)", 128, None, R + "2026-11-21/depth131k_128.json")] + [
              ("planner, no keys (H200)", d, None, R + f"2026-11-24/depth-nokeys/depth_{d}.json")
              for d in (16, 32, 64, 128)] + [
              ("planner, gpu_budget_gb=16 (H200 of the x2 kind)", 128, None,
               R + "2026-11-24/x2-peer2/depth_128_b16.json")],
    "tokens": [("default placement, micro-batches of 16 rows (H200)", 64 * 4096, None, R + "2026-11-21/llama8b.json"),
               ("planner, H100 80 GB", 64 * 4096, None, R + "2026-11-23/bounded-h100/llama8b_64x4096.json"),
               ("planner, gpu_budget_gb=22 (H200)", 16 * 4096, None,
                R + "2026-11-23/bounded-h200x2/llama8b_16x4096_22g.json")],
}


def adapter(name: str, layers: int | None = None):
    cfg = AutoConfig.from_pretrained(HERE / "model-configs" / name)
    if layers:
        cfg.num_hidden_layers = layers
    return get_adapter(cfg)


def peak(a, w: Workload, gpu_gib: float | None, choose: bool) -> float | None:
    gpu = gpu_gib * GiB if gpu_gib else float(PROFILE.gpu_total_bytes)
    p = make_plan(a, w, PROFILE, suggest=False, gpu_limit=gpu, choose_keys=FREE_ALL if choose else frozenset())
    return p.gpu_peak / GiB if p.fits or not choose else None


def series() -> dict:
    depths = [16, 32, 48, 64, 96, 128]
    rows = [8, 16, 32, 64, 96, 128]
    out = {"depth": {}, "tokens": {}}
    for label, gpu, choose in (("default placement (before)", None, False), ("planner, H200 141 GB", None, True),
                               ("planner, gpu_budget_gb=16", 16, True)):
        out["depth"][label] = [(d, peak(adapter("llama-2048-shape", d), Workload((16,) * 4, 2048, compile=True),
                                        gpu, choose)) for d in depths]
    a = adapter("llama-3.1-8b")
    for label, gpu, choose in (("default placement (before)", None, False), ("planner, H100 80 GB", 78.7, True),
                               ("planner, gpu_budget_gb=22", 22, True)):
        out["tokens"][label] = [(r * 4096, peak(a, Workload((1,) * r, 4096, compile=True), gpu, choose))
                                for r in rows]
    return out


def measured() -> dict:
    out = {}
    for panel, pts in MEASURED.items():
        out[panel] = []
        for label, x, _, f in pts:
            path = HERE.parent / f
            if path.exists():
                out[panel].append((label, x, json.loads(path.read_text())["result"]["gpu_peak_gib"], f))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "2026-11-24" / "gpu_memory"))
    args = ap.parse_args()
    planned, meas = series(), measured()
    Path(args.out + ".json").write_text(json.dumps({"planned": planned, "measured": meas}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    titles = {"depth": "width 2048, 131,072 tokens/step: GPU peak vs depth",
              "tokens": "Llama-3.1-8B, rows of 4,096: GPU peak vs tokens per step"}
    xlabel = {"depth": "layers", "tokens": "tokens per step"}
    for ax, panel in zip(axes, ("depth", "tokens")):
        for label, pts in planned[panel].items():
            xs = [x for x, y in pts if y is not None]
            ax.plot(xs, [y for x, y in pts if y is not None], marker=".", label=f"plan: {label}")
        labels = dict.fromkeys(label for label, *_ in meas[panel])
        for label in labels:
            pts = [(x, y) for lab, x, y, _ in meas[panel] if lab == label]
            ax.scatter([x for x, _ in pts], [y for _, y in pts], s=60, marker="x", zorder=5,
                       label=f"measured: {label}")
        ax.set_title(titles[panel], fontsize=10)
        ax.set_xlabel(xlabel[panel])
        ax.set_ylabel("GPU peak allocated (GiB)")
        ax.axhline(80, color="grey", lw=0.5, ls="--")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print(f"{'panel':<8}{'series':<34}" + "".join(f"{x:>10}" for x, _ in planned["depth"]["default placement (before)"]))
    for panel in ("depth", "tokens"):
        for label, pts in planned[panel].items():
            print(f"{panel:<8}{label:<34}" + "".join(f"{'-' if y is None else f'{y:.1f}':>10}" for _, y in pts))
    for panel, pts in meas.items():
        for label, x, y, f in pts:
            print(f"measured {panel}: {label} at {x}: {y:.1f} GiB ({f})")


if __name__ == "__main__":
    main()
