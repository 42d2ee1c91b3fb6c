"""steps.txt: every step of this call's runs, from their metrics (python make_steps.py > steps.txt, in this folder)."""
import json


def steps_from_metrics(f):
    return [json.loads(line) for line in open(f) if '"step_time_s"' in line]


def gaps(s):
    return "; ".join(f"{g['ms']:.0f} {g['before'] or 'end'}" for g in (s.get("idle_gaps") or [])[:3])


print("Qwen2.5-14B 158 x 1024, memory.host_budget_gb=128, memory.disk_path=/var/tmp (Adam v, m on the SSD); one H100 "
      "80GB of nvidia-h200-x2 (came as 2 H100s, 32 vCPUs, 251 GiB), 2026-11-27, rev b908871")
print(f"{'run':<7}{'step':>5}{'step s':>9}{'tokens/s':>10}{'GPU busy':>9}{'host GiB':>9}{'SSD r/w GB':>12}"
      f"{'r/w GB/s (busy)':>25}{'(r+w)/step':>11}  longest GPU idle stretches (ms, before)")
for name, f, plan in (("run 1", "runs/qwen14b_ssd_metrics.log", 161.09), ("run 2", "runs/qwen14b_ssd2_metrics.log", 210.51)):
    for s in steps_from_metrics(f):
        rw = f"{s['disk_read_gb']:.0f}/{s['disk_write_gb']:.0f}"
        rates = f"{s['disk_read_gbps']:.2f}/{s['disk_write_gbps']:.2f}" if s["disk_read_gb"] else "-"
        note = " (reads: holes)" if s["step"] == 2 else ""
        print(f"{name:<7}{s['step']:>5}{s['step_time_s']:>9.2f}{s['tokens_per_s']:>10,.0f}{s['busy_compute']:>9.2f}"
              f"{s['host_rss_gib']:>9.1f}{rw:>12}{rates + note:>25}{s['disk_gbps_step']:>11.2f}  {gaps(s)}")
    print(f"{'':<7}plan made at start {plan:.2f} s against the steady step 3's {s['step_time_s']:.2f} s: "
          f"{plan / s['step_time_s'] - 1:+.1%}")
print()
print("Qwen2.5-7B 158 x 1024 per GPU, 1 GPU then torchrun on 2 (same host)")
for n in (1, 2):
    r = json.load(open(f"runs/qwen7b_{n}gpu.json"))["result"]
    for s in r["steps"]:
        print(f"{str(n) + ' GPU':<7}{s['step']:>5}{s['step_time_s']:>9.2f}{s['tokens_per_s']:>10,.0f}"
              f"{s['busy_compute']:>9.2f}{s['host_rss_gib']:>9.1f}  {gaps(s)}")
    print(f"{'':<7}measured (last 2): {r['step_s']:.2f} s, {r['tokens_per_s']:,.0f} tokens/s, plan {r['plan']['step_time_s']:.2f} s")
