"""What `megatrain plan` says of gpt-oss-120b (issue 12): the 2-layer truncation that was measured on the H200
(bench/results/2026-11-25/h200-gptoss-gemma: 17.0 s/step) and the full 36 layers with 1,536 GiB of host RAM, 256
sequences of 4,096 tokens per step in micro-batches of 16, compiled, with and without gradient clipping, from
config.json alone with the H200 profile that holds the gpt-oss layer probe (forward 505, recompute + backward 406
TFLOP/s at 16 x 4096: bench/results/2026-11-25/h200-olmoe/h200_gptoss_profile.json; its host's CPU AdamW 3.52
Gparam/s), the same with the AdamW rate another H200 host measured (2.63 Gparam/s on a 3.19B-parameter tile), and the
2-layer plan with the default profile too.

    python bench/plan_gptoss.py [--json OUT.json]

Prints a table last.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
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

PROBE = HERE / "results" / "2026-11-25" / "h200-olmoe" / "h200_gptoss_profile.json"
MEASURED_2L = 17.02  # s/step, bench/results/2026-11-25/h200-gptoss-gemma/gptoss120b_2l.json
# CpuAdamW alone on a tile of a gpt-oss-120b layer's 3.19B parameters, on the H200 host of session 26
# (bench/results/2026-11-25/h200-moe-peers/adamw_rate.json; 2.37 on a tile of 268M): the probe's host ran 3.52.
# H200 hosts differ by that much; `megatrain train` measures its own host's rate at start.
HOST_ADAMW = 2.63e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
    cfg = AutoConfig.from_pretrained(HERE / "model-configs" / "gpt-oss-120b")
    rows = []
    for layers, host_gib, clipping, profile, adamw in [
            (2, 124.4, True, PROBE, None), (2, 124.4, True, PROBE, HOST_ADAMW), (2, 124.4, True, None, None),
            (36, 1536, False, PROBE, None), (36, 1536, False, PROBE, HOST_ADAMW), (36, 1536, True, PROBE, None)]:
        c = copy.deepcopy(cfg)
        c.num_hidden_layers = layers
        c.layer_types = c.layer_types[:layers]
        adapter = get_adapter(c)
        prof = load_profile(profile)
        if adamw:
            prof = dataclasses.replace(prof, adamw_params_per_s=adamw)
        w = Workload((16,) * 16, 4096, compile=True, clipping=clipping)
        p = make_plan(adapter, w, prof, suggest=False, gpu_limit=float(prof.gpu_total_bytes),
                      host_available=host_gib * GiB, choose_keys=FREE_ALL)
        n = sum(u.numel for u in adapter.units())
        rows.append({"layers": layers, "host_gib": host_gib, "clipping": clipping,
                     "profile": ("gpt-oss probe" if profile else "default H200") + (
                         f", AdamW {adamw / 1e9:.2f}" if adamw else ""), "fits": p.fits, "step_s": p.step_s,
                     "compute_s": p.time["compute_s"], "gpu_idle_s": p.time["gpu_idle_s"],
                     "tflops_6n_active": p.time["tflops_6n_active"], "tflops_6n": p.time["tflops_6n"],
                     "host_gib_planned": p.host_total / GiB, "host_bytes_per_param": p.host_total / n,
                     "gpu_peak_gib": p.gpu_peak / GiB, "placement": p.placement_keys,
                     "vs_measured": p.step_s / MEASURED_2L - 1 if layers == 2 else None})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"{'layers':>6} {'host GiB':>9} {'clip':<5}{'profile':<26}{'fits':<6}{'step s':>8}{'compute s':>10}"
          f"{'idle s':>8}{'TF 6Na':>8}{'B/param':>8}{'GPU GiB':>8}  vs measured")
    for r in rows:
        vs = f"{100 * r['vs_measured']:+.1f}%" if r["vs_measured"] is not None else "-"
        print(f"{r['layers']:>6} {r['host_gib']:>9.1f} {'on' if r['clipping'] else 'off':<5}{r['profile']:<26}"
              f"{str(r['fits']):<6}{r['step_s']:>8.2f}{r['compute_s']:>10.2f}{r['gpu_idle_s']:>8.2f}"
              f"{r['tflops_6n_active']:>8.0f}{r['host_bytes_per_param']:>8.2f}{r['gpu_peak_gib']:>8.1f}  {vs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
