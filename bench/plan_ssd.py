"""What `megatrain plan` says of the SSD tier (memory.disk_path, issue 16): from config.json alone, with the H200
machine profile of bench/results/2026-11-21 (compiled layers, CUDA defaults, the placement chosen), the host RAM
given, and the disk's read/write rates: which states go to the SSD (Adam v, then m, then the fp32 master), the host
RAM left, the SSD's bytes resident and moved per step, the disk's seconds, the bandwidth that would hide them, and
the predicted step time with its bound.

    python bench/plan_ssd.py [--json OUT.json] [--profile PROFILE.json]

Rows (each with gradient clipping on, train.max_grad_norm 1.0, and off, null):
  Qwen2.5-14B, 158 x 1024 (2 micro-batches of 79 rows), memory.host_budget_gb 128, the x2 machine's disk (DESIGN.md:
      O_DIRECT 16 MiB requests read 1.2 GB/s, write 1.6 GB/s); disk-bound. Measured on an H100 of the x2 kind
      (results/2026-11-27/x2-h100): steady steps of 168.9 and 154.7 s, the disk giving the tier 1.35-1.50 GB/s
      read, 1.40-1.64 write
  Mistral-Large-2 (123B), 158 x 1024 (2 x 79 rows) and 1M tokens (32 x 32 rows: issue 16's row), 1536 GiB of host
      RAM, a 12 GB/s NVMe RAID
  Llama-3.1-405B, 160 x 1024 (10 x 16 rows: one 158-row micro-batch of 405B's layers needs terabytes of GPU
      memory), 1536 GiB of host RAM, the same RAID and the x2 machine's disk. With clipping it does not fit: the
      finished gradients waiting for the global norm (4 B/param, 1.5 TiB) fit neither the GPU nor the host beside
      the bf16 copy, and the SSD tier does not take gradients (yet). At 1M tokens (16 x 64 rows) it does not fit
      either way: so many micro-batches need wave groups, whose fp32 accumulators (1.5 TiB) wait in host RAM
The plan reports first (the 14B's in full), then the table last.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner import Workload, make_plan  # noqa: E402
from megatrain.planner.placement import FREE_ALL  # noqa: E402
from megatrain.planner.profile import GiB, load_profile  # noqa: E402
from megatrain.planner.report import render  # noqa: E402

LOCAL = (1.2e9, 1.6e9)  # DESIGN.md's local disk: read, write
RAID = (12e9, 12e9)
# (model, rows per micro-batch, micro-batches, tokens per row, host GiB, disk (read, write) bytes/s)
RUNS = [("qwen2.5-14b", 79, 2, 1024, 128.0, LOCAL), ("mistral-large-2-123b", 79, 2, 1024, 1536.0, RAID),
        ("mistral-large-2-123b", 32, 32, 1024, 1536.0, RAID),  # issue 16's row: 1M (1,048,576) tokens per step
        ("llama-3.1-405b", 16, 10, 1024, 1536.0, RAID), ("llama-3.1-405b", 16, 10, 1024, 1536.0, LOCAL),
        ("llama-3.1-405b", 16, 64, 1024, 1536.0, RAID)]  # the same 1M tokens


def plan_row(name: str, micro: int, n_micro: int, seq: int, host_gib: float, disk: tuple[float, float], clipping: bool, prof):
    from transformers import AutoConfig

    adapter = get_adapter(AutoConfig.from_pretrained(HERE / "model-configs" / name))
    prof = replace(prof, disk_read_bps=disk[0], disk_write_bps=disk[1])
    p = make_plan(adapter, Workload((micro,) * n_micro, seq, compile=True, clipping=clipping), prof, suggest=False,
                  gpu_limit=float(prof.gpu_total_bytes), host_available=host_gib * GiB, host_source="given",
                  choose_keys=FREE_ALL, disk_path="memory.disk_path")
    ssd = p.ssd
    return p, {"model": name, "rows": micro * n_micro, "micro_batch": micro, "seq": seq, "host_budget_gib": host_gib, "clipping": clipping,
               "disk_read_gbps": disk[0] / 1e9, "disk_write_gbps": disk[1] / 1e9, "fits": p.fits,
               "disk_states": list(p.workload.disk_states), "stream_dtype": p.placement.stream_dtype,
               "placement": p.placement_keys, "why": p.why, "host_gib": p.host_total / GiB,
               "host_bytes_per_param": p.host_total / p.params, "params": p.params,
               "ssd_resident_gib": ssd["resident_bytes"] / GiB if ssd else 0.0,
               "ssd_read_gib_per_step": ssd["read_bytes"] / GiB if ssd else 0.0,
               "ssd_write_gib_per_step": ssd["write_bytes"] / GiB if ssd else 0.0,
               "disk_s": ssd["disk_s"] if ssd else 0.0, "hidden_gbps": ssd["hidden_bps"] / 1e9 if ssd else 0.0,
               "step_s": p.step_s, "compute_s": p.time["compute_s"], "bound": p.time["bound"],
               "tokens_per_s": p.time["tokens_per_s"], "tflops_6n": p.time["tflops_6n"],
               "gpu_needed_gib": p.gpu_needed / GiB, "problems": p.problems}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(HERE / "results" / "2026-11-21" / "h200_profile.json"))
    ap.add_argument("--json")
    args = ap.parse_args()
    prof = load_profile(args.profile)
    rows = []
    for i, (name, b, n, seq, host, disk) in enumerate(RUNS):
        for clip in (True, False):
            p, r = plan_row(name, b, n, seq, host, disk, clip, prof)
            rows.append(r)
            if i == 0 and clip:
                print(render(p))
                print()
    print(f"{'model':<22}{'rows':>10}{'host GiB':>9}{'disk r/w GB/s':>14} {'clip':<5}{'fits':<6}{'on SSD':<15}{'stream':<7}"
          f"{'host use':>9}{'SSD GiB':>9}{'r+w GiB/step':>13}{'disk s':>8}{'hide GB/s':>10}{'step s':>8}{'TFLOP/s':>8}  bound")
    for r in rows:
        print(f"{r['model']:<22}{str(r['rows']) + 'x' + str(r['seq']):>10}{r['host_budget_gib']:>9.0f}{r['disk_read_gbps']:>7.1f}/{r['disk_write_gbps']:<6.1f} "
              f"{'on' if r['clipping'] else 'off':<5}{str(r['fits']):<6}{','.join(r['disk_states']) or '-':<15}"
              f"{r['stream_dtype']:<7}{r['host_gib']:>9.1f}{r['ssd_resident_gib']:>9.1f}"
              f"{r['ssd_read_gib_per_step'] + r['ssd_write_gib_per_step']:>13.1f}{r['disk_s']:>8.1f}"
              f"{r['hidden_gbps']:>10.2f}{r['step_s']:>8.1f}{r['tflops_6n'] if r['fits'] else 0:>8.0f}  "
              f"{r['bound'] if r['fits'] else 'does not fit'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": args.profile, "runs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
