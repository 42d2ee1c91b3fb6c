"""steps.txt: every step of every `megatrain train` run in runs/, with its host peak, start-up phases and plan
(python make_steps.py > steps.txt here; in ../h100-tune-first: python ../x2-h100-c/make_steps.py > steps.txt)."""
import glob
import json

GiB = 2**30
for f in sorted(glob.glob("runs/*.json")):
    r = json.load(open(f)).get("result", {})
    if "steps" not in r:
        continue
    plan = r["plan"]
    print(f"{r['label']} ({f}): {r['params'] / 1e9:.2f} B params, placement stream_dtype="
          f"{r['placement']['stream_dtype']}; host peak {r['host_peak_rss_gib']:.2f} GiB = "
          f"{r['host_bytes_per_param']:.3f} B/param (planned {plan['host_peak_gib']:.2f} GiB, "
          f"{plan['host_peak_gib'] / r['host_peak_rss_gib'] - 1:+.1%}); steady RSS {r['host_rss_gib']:.2f} GiB")
    print("  start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["startup_s"].items())
          + f"; the CLI's total {r['cli_total_s']:.1f} s")
    print(f"{'step':>6}{'step s':>9}{'tokens/s':>10}{'GPU busy':>9}{'loss':>20}{'grad norm':>20}")
    for s in r["steps"]:
        print(f"{s['step']:>6}{s['step_time_s']:>9.2f}{s['tokens_per_s']:>10,.0f}{s.get('busy_compute', 0):>9.2f}"
              f"{s['loss']:>20.15f}{s['grad_norm']:>20.16f}")
    print(f"  measured (steps 3-4) {r['step_s']:.2f} s, GPU idle {r['gpu_idle']:.1%}; plan made at start "
          f"{plan['step_time_s']:.2f} s ({plan['step_time_s'] / r['step_s'] - 1:+.1%})\n")
