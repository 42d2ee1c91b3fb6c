"""steps.txt: every step of this call's SSD run, from its metrics (python make_steps.py > steps.txt, in this folder)."""
import json


def gaps(s):
    return "; ".join(f"{g['ms']:.0f} {g['before'] or 'end'}" for g in (s.get("idle_gaps") or [])[:3])


plan = json.load(open("runs/qwen14b_ssd.json"))["result"]["plan"]["step_time_s"]
steps = [json.loads(line) for line in open("runs/qwen14b_ssd_metrics.log") if '"step_time_s"' in line]
print("Qwen2.5-14B 158 x 1024, memory.host_budget_gb=128, memory.disk_path=/var/tmp (Adam v, m on the SSD); one H100 "
      "80GB of nvidia-h200-x2 (came as 2 H100s, 32 vCPUs, 251 GiB), 2026-11-27, rev c2a900f")
print(f"{'step':>5}{'step s':>9}{'tokens/s':>10}{'GPU busy':>9}{'host GiB':>9}{'SSD r/w GB':>12}{'r/w GB/s':>11}"
      f"{'SSD busy':>9}{'(r+w)/step':>11}  longest GPU idle stretches (ms, before)")
for s in steps:
    rw = f"{s['disk_read_gb']:.0f}/{s['disk_write_gb']:.0f}"
    rates = f"{s['disk_read_gbps']:.2f}/{s['disk_write_gbps']:.2f}" if s["disk_write_gb"] else "-"
    print(f"{s['step']:>5}{s['step_time_s']:>9.2f}{s['tokens_per_s']:>10,.0f}{s['busy_compute']:>9.2f}"
          f"{s['host_rss_gib']:>9.1f}{rw:>12}{rates:>11}{s.get('disk_busy', 0):>9.2f}{s['disk_gbps_step']:>11.2f}  {gaps(s)}")
steady = [s["step_time_s"] for s in steps[2:]]
mean = sum(steady) / len(steady)
print(f"plan made at start {plan:.2f} s against the steady steps 3-{steps[-1]['step']} ({mean:.2f} s): "
      f"{plan / mean - 1:+.1%}")
