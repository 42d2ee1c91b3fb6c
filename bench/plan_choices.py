"""The placement `megatrain plan` chooses for the runs this project measured or plans, from config.json alone: run it
before and after a change to the planner to see which runs it moves (and re-measure those whose placement changed).

    python bench/plan_choices.py [--json OUT.json]

Every row: compiled layers, CUDA, no memory keys but the GPU budget the row names (else the profile's GPU) and the
host RAM given; the H100 rows use the H100's probe (results/2026-11-23/bounded-h100-2), the rows planned with the
H200 probe say so, the rest use the default (H200) profile. Prints one line a row: fits, host GiB of the limit,
predicted step, placement keys; the table last.
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
from megatrain.planner.profile import DEFAULTS, GiB, load_profile  # noqa: E402

H100 = HERE / "results" / "2026-11-23" / "bounded-h100-2" / "h100_profile.json"
H200 = HERE / "results" / "2026-11-21" / "h200_profile.json"
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    args = ap.parse_args()
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
