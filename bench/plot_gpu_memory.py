"""GPU peak against depth and against tokens per step: what `megatrain plan` predicts (lines) with the default
placement (every layer's input and every finished gradient on the GPU) and with the placement the planner chooses
(no memory keys; or under memory.gpu_budget_gb), and what the GPU runs measured (markers:
torch.cuda.max_memory_allocated), from the reference runs under bench/results. The lines of the tokens panel are
planned in micro-batches of one row; a run in micro-batches of 16 holds more at once.

    python bench/plot_gpu_memory.py [--out docs/img/gpu_memory]   (needs matplotlib)

Planned with the H200 probe (bench/results/probe-h200), compiled layers, from config.json alone.
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

from transformers import AutoConfig  # noqa: E402

from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner import Workload, make_plan  # noqa: E402
from megatrain.planner.placement import FREE_ALL  # noqa: E402
from megatrain.planner.profile import GiB, load_profile  # noqa: E402
from refruns import RESULTS, result  # noqa: E402

PROFILE = load_profile(RESULTS / "probe-h200" / "profile.json")
MEASURED = {  # (series, x, reference run, label of its run)
    "depth": [("hand-set spill, 40 GiB cap (H200)", d, "planner-fit-h200", f"depth-{d}-131k-spill{s}-budget40")
              for d, s in ((16, 0), (32, 16), (64, 48), (128, 64))] + [
              ("planner, no keys (H200)", d, "depth-131k-h200", f"depth-{d}-131k-auto") for d in (16, 32, 64, 128)] + [
              ("planner, gpu_budget_gb=16 (H200 of the x2 kind)", 128, "depth-128-131k-budget16-h200", None)],
    "tokens": [("planner, micro-batches of 16 rows (H200)", 64 * 4096, "llama-3.1-8b-64x4096-h200", None),
               ("planner, H100 80 GB, micro-batches of 16 rows", 64 * 4096, "llama-3.1-8b-64x4096-h100-cli", None),
               ("planner, gpu_budget_gb=22 (H100)", 16 * 4096, "llama-3.1-8b-16x4096-budget22-h100-cli", None)],
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
        for label, x, name, run in pts:
            out[panel].append((label, x, result(name, run)["gpu_peak_gib"], name))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "img" / "gpu_memory"))
    args = ap.parse_args()
    planned, meas = series(), measured()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
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
