"""The placement `megatrain plan` chooses for the runs this project measured or plans, from config.json alone: run it
before and after a change to the planner to see which runs it moves (and re-measure those whose placement changed).

    python bench/plan_choices.py [--json OUT.json]
    python bench/plan_choices.py --ssd [--json OUT.json]

Every row: compiled layers, CUDA, no memory keys but the GPU budget the row names (else the profile's GPU) and the
host RAM given; the H100 rows use the H100's probe (bench/results/probe-h100), the rows planned with the H200 probe
(bench/results/probe-h200) say so, the rest use the default (H200) profile. Prints one line a row: fits, host GiB of
the limit, predicted step, placement keys; the table last.

--ssd: what the plan says of the SSD tier (memory.disk_path) instead, with the H200 probe and the disk's read/write
rates given: which states go to the SSD (Adam v, then m, then the fp32 master), the host RAM used, the SSD's bytes
resident and moved per step, the disk's seconds, the bandwidth that would hide them, the predicted step and its
bound; each row with gradient clipping on and off. Rows: Qwen2.5-14B 158 x 1024 in 128 GiB with a local disk
(1.2 / 1.6 GB/s; bench/results/qwen2.5-14b-host128-ssd-h100-cli measured it); Mistral-Large-2 (123B) at 158 x 1024
and at 1M tokens (32 x 32 rows), 1,536 GiB of host RAM and a 12 GB/s NVMe RAID; Llama-3.1-405B at 160 x 1024 (10 x 16
rows) with the RAID and the local disk, and at 1M tokens (64 x 16 rows). With clipping 405B does not fit: the finished
gradients waiting for the global norm (4 B/param) fit neither the GPU nor the host, and the SSD tier does not take
gradients; at 1M tokens the wave groups' fp32 accumulators wait in host RAM either way.
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
from megatrain.planner.profile import DEFAULTS, GiB, load_profile  # noqa: E402
from megatrain.planner.report import render  # noqa: E402

H100 = HERE / "results" / "probe-h100" / "profile.json"
H200 = HERE / "results" / "probe-h200" / "profile.json"
# label, model, rows per micro-batch, micro-batches, tokens per row, GPU budget GiB (None: the profile's GPU),
# host GiB, profile (None: defaults), clipping, layers (None: the config's)
RUNS = [
    ("Llama-3.1-8B 64x4096, H100", "llama-3.1-8b", 16, 4, 4096, None, 125, H100, True, None),
    ("Llama-3.1-8B 16x4096, 22 GiB, H100", "llama-3.1-8b", 1, 16, 4096, 22, 124, H100, True, None),
    ("Qwen2.5-14B 158x1024, 80 GiB, x2 host", "qwen2.5-14b", 79, 2, 1024, 80, 249, None, True, None),
    ("Qwen2.5-32B 158x1024, x4 host", "qwen2.5-32b", 79, 2, 1024, None, 500, None, True, None),
    ("Qwen2.5-32B 158x1024, x4 host, no clip", "qwen2.5-32b", 79, 2, 1024, None, 500, None, False, None),
    ("Llama-3.1-70B 128x4096, 1536 GiB, H200 probe", "llama-3.1-70b", 16, 8, 4096, None, 1536, H200, True, None),
    ("Qwen2.5-7B 1x131072", "qwen2.5-7b", 1, 1, 131072, None, 125, None, True, None),
    ("Qwen2.5-7B 1x262144", "qwen2.5-7b", 1, 1, 262144, None, 125, None, True, None),
    ("Qwen2.5-7B 1x524288", "qwen2.5-7b", 1, 1, 524288, None, 125, None, True, None),
    ("Llama-3.1-8B 1x131072", "llama-3.1-8b", 1, 1, 131072, None, 125, None, True, None),
    ("Llama-3.1-8B 1x524288, 74 GiB, H100, no clip", "llama-3.1-8b", 1, 1, 524288, 74, 125, H100, False, None),
    ("Llama-3.1-8B 1x1048576, no clip", "llama-3.1-8b", 1, 1, 1048576, None, 125, None, False, None),
    ("gpt-oss-120b 256x4096, 1536 GiB, no clip", "gpt-oss-120b", 16, 16, 4096, None, 1536, H200, False, None),
    ("Mistral-Large-2 158x1024, 1536 GiB, no clip", "mistral-large-2-123b", 79, 2, 1024, None, 1536, H200, False,
     None),
    ("width 2048, 128 layers, 16 GiB, x2 host", "llama-2048-shape", 16, 4, 2048, 16, 249, None, True, 128),
    ("Gemma-2-9B 64x4096", "gemma-2-9b", 8, 8, 4096, None, 125, None, True, None),
]


def plan_row(label, name, micro, n, seq, gpu_gib, host_gib, profile, clipping, layers) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(HERE / "model-configs" / name)
    if layers:
        cfg.num_hidden_layers = layers
    cfg.max_position_embeddings = max(seq, getattr(cfg, "max_position_embeddings", seq))
    prof = load_profile(profile) if profile else DEFAULTS
    p = make_plan(get_adapter(cfg), Workload((micro,) * n, seq, compile=True, clipping=clipping), prof, suggest=False,
                  gpu_limit=gpu_gib * GiB if gpu_gib else float(prof.gpu_total_bytes), host_available=host_gib * GiB,
                  choose_keys=FREE_ALL)
    return {"run": label, "fits": p.fits, "host_gib": p.host_total / GiB, "host_limit_gib": host_gib,
            "gpu_needed_gib": p.gpu_needed / GiB, "step_s": p.step_s, "placement": p.placement_keys, "why": p.why}


LOCAL, RAID = (1.2e9, 1.6e9), (12e9, 12e9)  # disk read, write bytes/s: a local disk, an NVMe RAID
# --ssd: model, rows per micro-batch, micro-batches, tokens per row, host GiB, disk
SSD_RUNS = [("qwen2.5-14b", 79, 2, 1024, 128.0, LOCAL), ("mistral-large-2-123b", 79, 2, 1024, 1536.0, RAID),
            ("mistral-large-2-123b", 32, 32, 1024, 1536.0, RAID), ("llama-3.1-405b", 16, 10, 1024, 1536.0, RAID),
            ("llama-3.1-405b", 16, 10, 1024, 1536.0, LOCAL), ("llama-3.1-405b", 16, 64, 1024, 1536.0, RAID)]


def ssd_row(name, micro, n_micro, seq, host_gib, disk, clipping, prof):
    from transformers import AutoConfig

    adapter = get_adapter(AutoConfig.from_pretrained(HERE / "model-configs" / name))
    prof = replace(prof, disk_read_bps=disk[0], disk_write_bps=disk[1])
    p = make_plan(adapter, Workload((micro,) * n_micro, seq, compile=True, clipping=clipping), prof, suggest=False,
                  gpu_limit=float(prof.gpu_total_bytes), host_available=host_gib * GiB, host_source="given",
                  choose_keys=FREE_ALL, disk_path="memory.disk_path")
    ssd = p.ssd
    return p, {"model": name, "rows": micro * n_micro, "micro_batch": micro, "seq": seq, "host_budget_gib": host_gib,
               "clipping": clipping, "disk_read_gbps": disk[0] / 1e9, "disk_write_gbps": disk[1] / 1e9,
               "fits": p.fits, "disk_states": list(p.workload.disk_states), "stream_dtype": p.placement.stream_dtype,
               "placement": p.placement_keys, "why": p.why, "host_gib": p.host_total / GiB,
               "host_bytes_per_param": p.host_total / p.params, "params": p.params,
               "ssd_resident_gib": ssd["resident_bytes"] / GiB if ssd else 0.0,
               "ssd_read_gib_per_step": ssd["read_bytes"] / GiB if ssd else 0.0,
               "ssd_write_gib_per_step": ssd["write_bytes"] / GiB if ssd else 0.0,
               "disk_s": ssd["disk_s"] if ssd else 0.0, "hidden_gbps": ssd["hidden_bps"] / 1e9 if ssd else 0.0,
               "step_s": p.step_s, "compute_s": p.time["compute_s"], "bound": p.time["bound"],
               "tokens_per_s": p.time["tokens_per_s"], "tflops_6n": p.time["tflops_6n"],
               "gpu_needed_gib": p.gpu_needed / GiB, "problems": p.problems}


def ssd_main(json_out: str | None) -> int:
    """The SSD tier's plans: the first row's report in full, then the table."""
    prof = load_profile(H200)
    rows = []
    for i, run in enumerate(SSD_RUNS):
        for clip in (True, False):
            p, r = ssd_row(*run, clip, prof)
            rows.append(r)
            if i == 0 and clip:
                print(render(p) + "\n")
    print(f"{'model':<22}{'rows':>10}{'host GiB':>9}{'disk r/w GB/s':>14} {'clip':<5}{'fits':<6}{'on SSD':<15}"
          f"{'stream':<7}{'host use':>9}{'SSD GiB':>9}{'r+w GiB/step':>13}{'disk s':>8}{'hide GB/s':>10}{'step s':>8}"
          f"{'TFLOP/s':>8}  bound")
    for r in rows:
        rows_seq = f"{r['rows']}x{r['seq']}"
        print(f"{r['model']:<22}{rows_seq:>10}{r['host_budget_gib']:>9.0f}"
              f"{r['disk_read_gbps']:>7.1f}/{r['disk_write_gbps']:<6.1f} "
              f"{'on' if r['clipping'] else 'off':<5}{str(r['fits']):<6}{','.join(r['disk_states']) or '-':<15}"
              f"{r['stream_dtype']:<7}{r['host_gib']:>9.1f}{r['ssd_resident_gib']:>9.1f}"
              f"{r['ssd_read_gib_per_step'] + r['ssd_write_gib_per_step']:>13.1f}{r['disk_s']:>8.1f}"
              f"{r['hidden_gbps']:>10.2f}{r['step_s']:>8.1f}{r['tflops_6n'] if r['fits'] else 0:>8.0f}  "
              f"{r['bound'] if r['fits'] else 'does not fit'}")
    if json_out:
        Path(json_out).write_text(json.dumps({"profile": str(H200.relative_to(HERE.parent)), "runs": rows}, indent=1))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--ssd", action="store_true", help="the SSD tier's plans instead")
    args = ap.parse_args()
    if args.ssd:
        return ssd_main(args.json)
    rows = []
    for run in RUNS:
        rows.append(plan_row(*run))
        print(f"{rows[-1]['run']}: {rows[-1]['why']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{'run':<46}{'fits':<6}{'host GiB':>16}{'GPU GiB':>9}{'step s':>9}  placement")
    for r in rows:
        host = f"{r['host_gib']:.1f}/{r['host_limit_gib']}"
        print(f"{r['run']:<46}{r['fits']!s:<6}{host:>16}{r['gpu_needed_gib']:>9.1f}{r['step_s']:>9.2f}  "
              f"{r['placement']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
