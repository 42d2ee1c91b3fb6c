"""What `megatrain plan` says of one long sequence per step (issue 15's runs), from config.json alone with a machine
profile (default: the H200 probe, bench/results/probe-h200), CUDA defaults (compiled layers), no memory keys set,
the host RAM given (default 125 GiB, what the H100/H200 machines have free): fits or not, the placement chosen
(memory.seq_tile among it), predicted step time, GPU peak and need, host RAM.

    python bench/plan_long_context.py [--json OUT.json] [--profile PROFILE.json] [--host-gib 125]

Each row: model, tokens, the GPU's memory (GiB; the profile's GPU unless stated), compiled or eager, gradient clipping
(train.max_grad_norm 1.0) or none (null: no gradient waits for the global norm).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner import Workload, make_plan  # noqa: E402
from megatrain.planner.placement import FREE_ALL  # noqa: E402
from megatrain.planner.profile import GiB, load_profile  # noqa: E402

RUNS = [("qwen2.5-7b", s, None, True, True) for s in (32768, 65536, 131072, 262144, 524288)] + [
    ("llama-3.1-8b", 131072, None, True, True),
    ("llama-3.1-8b", 262144, 78.0, True, True), ("llama-3.1-8b", 262144, 78.0, False, True),
    ("llama-3.1-8b", 524288, 78.0, True, True), ("llama-3.1-8b", 524288, 78.0, True, False),
    ("llama-3.1-8b", 1048576, None, True, True), ("llama-3.1-8b", 1048576, None, True, False),
]


def plan_row(name: str, seq: int, gpu_gib: float | None, compile: bool, prof, host_gib: float, clipping: bool = True):
    from transformers import AutoConfig

    adapter = get_adapter(AutoConfig.from_pretrained(HERE / "model-configs" / name))
    gpu = gpu_gib * GiB if gpu_gib else float(prof.gpu_total_bytes)
    p = make_plan(adapter, Workload((1,), seq, compile=compile, clipping=clipping), prof, suggest=False, gpu_limit=gpu,
                  host_available=host_gib * GiB, choose_keys=FREE_ALL)
    return p, {"model": name, "tokens": seq, "gpu_gib": gpu / GiB, "compile": compile, "clipping": clipping,
               "fits": p.fits,
               "placement": p.placement_keys, "why": p.why, "step_s": p.step_s, "gpu_peak_gib": p.gpu_peak / GiB,
               "gpu_needed_gib": p.gpu_needed / GiB, "gpu_peak_phase": p.gpu_peak_phase,
               "host_gib": p.host_total / GiB, "tflops_6n": p.time["tflops_6n"], "bound": p.time["bound"],
               "problems": p.problems}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(HERE / "results" / "probe-h200" / "profile.json"))
    ap.add_argument("--host-gib", type=float, default=125.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    prof = load_profile(args.profile)
    rows = []
    print(f"{'model':<14}{'tokens':>9} {'GPU':>6} {'mode':<9}{'clip':<5}{'fits':<6}{'step s':>8}{'peak GiB':>10}{'need GiB':>10}"
          f"{'host GiB':>10}  placement")
    for name, seq, gpu, comp, clip in RUNS:
        _, r = plan_row(name, seq, gpu, comp, prof, args.host_gib, clip)
        rows.append(r)
        print(f"{name:<14}{seq:>9} {r['gpu_gib']:>6.1f} {'compiled' if comp else 'eager':<9}{'on' if clip else 'off':<5}"
              f"{str(r['fits']):<6}"
              f"{r['step_s']:>8.1f}{r['gpu_peak_gib']:>10.1f}{r['gpu_needed_gib']:>10.1f}{r['host_gib']:>10.1f}  "
              f"{r['placement']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "host_gib": args.host_gib, "runs": rows},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
