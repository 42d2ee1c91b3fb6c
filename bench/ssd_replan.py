"""An SSD-tier run's step time against its plan, re-made with each measured step's own disk rates: tells a wrong
step model from a wrong disk rate (issue 16: "step time within 15% of the plan").

    python bench/ssd_replan.py RESULT.json [RESULT.json ...] [--rerun CLI_LOG METRICS_JSONL ...]

RESULT.json is a `bench/bench_cli.py --json` result of a run with memory.disk_path, or a reference run's result.json
(its output beside it, `<stem>_cli.log` or the reference run's log.txt: the CPU AdamW rate and the disk rates the run
measured at its start are read from the start summary). For each one the
plan is re-made (`make_plan`) for the same model, batch, compile mode, clipping and placement (the run's, with the
states the run put on the SSD: those missing from its plan's host lines) and the CPU AdamW rate it measured, with
  - the disk rates the run planned with (measured at its start), which must give the run's own plan back; and
  - each step's own rates: the tier's bytes over the seconds a read (write) was in flight in that step.
The plan is compared with the steady steps: those after the first optimizer pass (with clipping on, the first step's
updates run in the second step), whose reads find only never-written regions; runs whose tier did not zero-fill
those regions counted such reads as disk reads, at the rate at which the file system returns holes (8-11 GB/s), and
are marked.
The step's own rates are each kind's bytes over the seconds during which one was in flight; the tier's reads and
writes overlap in time, so these understate what the disk did and the re-plan with them runs long. Runs that record
the disk's rate with both kinds together over the seconds any request was in flight (`disk_gbps`) get a row "this
step's disk" that re-plans with it as both rates.

--rerun: a run of the first RESULT's command whose benchmark JSON was not written (stopped at its time limit after
its last step): its output and its metrics.jsonl. The table is printed last; --json writes it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from plan_vs_measured import adapter_of, workload_of  # noqa: E402

from megatrain.planner import make_plan  # noqa: E402
from megatrain.planner.profile import DEFAULTS  # noqa: E402

ADAMW = re.compile(r"CPU AdamW measured here at start: ([\d.]+) Gparam/s(?: with (\d+) threads)?")
DISK = re.compile(r"measured here at start: disk at \S+: read ([\d.]+) GB/s, write ([\d.]+) GB/s")
STATES = {"v": "Adam v", "m": "Adam m", "master": "fp32 master"}


def start_rates(log: Path) -> dict:
    """The CPU AdamW rate (and threads) and the disk rates a run measured at its start, from its output."""
    text = log.read_text(errors="replace")
    a, d = ADAMW.search(text), DISK.search(text)
    if a is None or d is None:
        raise SystemExit(f"{log}: no start-up measurement of the CPU AdamW or the disk in it")
    return {"adamw_params_per_s": float(a.group(1)) * 1e9, "adamw_threads": int(a.group(2) or 0),
            "read_bps": float(d.group(1)) * 1e9, "write_bps": float(d.group(2)) * 1e9}


PLANNED = re.compile(r"predicted ([\d.]+) s/step")


def rerun_result(like: dict, log: Path, metrics: Path) -> dict:
    """A benchmark result for a run of `like`'s command known only by its output and metrics.jsonl."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "step_time_s" in s]
    m = PLANNED.search(log.read_text(errors="replace"))
    if m is None or not steps:
        raise SystemExit(f"{log}, {metrics}: no plan or no steps in them")
    r = json.loads(json.dumps(like))
    warm = len(r["result"]["steps"]) - int(r["result"]["steps_measured"])  # warm-up steps
    measured = [s["step_time_s"] for s in steps[warm:]]
    r["result"].update(label=r["result"]["label"] + " (rerun)", steps=steps, step_s=sum(measured) / len(measured))
    r["result"]["plan"] = {**r["result"]["plan"], "step_time_s": float(m.group(1))}
    return r


def replan(path: Path, payload: dict | None = None, log: Path | None = None) -> list[dict]:
    payload = payload or json.loads(path.read_text())
    r = payload["result"]
    cli_log = path.with_name(path.stem + "_cli.log")
    rates = start_rates(log or (cli_log if cli_log.exists() else path.with_name("log.txt")))
    host_lines = " ".join(r["plan"]["host"])
    disk_states = tuple(k for k, name in STATES.items() if name not in host_lines)
    adapter = adapter_of({**r, "command": payload.get("command", "")})
    w = replace(workload_of({**r, "command": payload.get("command", "")}, adapter.vocab_size),
                disk_states=disk_states, clipping=bool(r.get("clipping", True)))
    prof = replace(DEFAULTS, adamw_params_per_s=rates["adamw_params_per_s"],
                   adamw_threads=rates["adamw_threads"] or DEFAULTS.adamw_threads)

    def step_s(read_bps: float, write_bps: float) -> float:
        return make_plan(adapter, w, replace(prof, disk_read_bps=read_bps, disk_write_bps=write_bps),
                         suggest=False).step_s

    steps = [x for x in r["steps"] if x.get("disk_write_gb")]  # the steps with an optimizer pass
    steady = steps[1:]  # the first pass reads nothing from the disk (its states were never written)
    if not steady:
        raise SystemExit(f"{path}: no step after the first optimizer pass: nothing steady to compare with")
    rows = [{"run": r["label"], "file": str(path), "rates": "measured at start", "step": None,
             "read_gbps": rates["read_bps"] / 1e9, "write_gbps": rates["write_bps"] / 1e9,
             "pred_s": step_s(rates["read_bps"], rates["write_bps"]),
             "meas_s": sum(x["step_time_s"] for x in steady) / len(steady),
             "run_plan_s": r["plan"]["step_time_s"], "first_pass": False}]
    for x in steps:
        rd, wr = x["disk_read_gbps"] * 1e9, x["disk_write_gbps"] * 1e9
        if not rd:
            continue  # a first pass that read nothing (the tier zero-fills): no read to take a rate from
        rows.append({"run": r["label"], "file": str(path), "rates": "this step's own", "step": x["step"],
                     "read_gbps": rd / 1e9, "write_gbps": wr / 1e9, "pred_s": step_s(rd, wr),
                     "meas_s": x["step_time_s"], "run_plan_s": r["plan"]["step_time_s"],
                     "first_pass": x is steps[0]})
        if x.get("disk_gbps"):  # both kinds over the seconds any request was in flight
            both = x["disk_gbps"] * 1e9
            rows.append({**rows[-1], "rates": "this step's disk", "read_gbps": both / 1e9, "write_gbps": both / 1e9,
                         "pred_s": step_s(both, both)})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--rerun", nargs=2, action="append", default=[], type=Path, metavar=("CLI_LOG", "METRICS"))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [row for p in args.results for row in replan(p)]
    like = json.loads(args.results[0].read_text())
    for log, metrics in args.rerun:
        rows += replan(metrics, rerun_result(like, log, metrics), log)
    print(f"{'run':<46}{'step':>5} {'disk rates':<19}{'read/write GB/s':>16}{'plan s':>9}{'measured s':>11}"
          f"{'err':>8}")
    for x in rows:
        meas = x["meas_s"]
        label = "steady" if x["step"] is None else str(x["step"]) + (" *" if x["first_pass"] else "")
        print(f"{x['run']:<46}{label:>5} {x['rates']:<19}{x['read_gbps']:>8.2f}/{x['write_gbps']:<7.2f}"
              f"{x['pred_s']:>9.1f}{meas:>11.1f}{x['pred_s'] / meas - 1:>+8.1%}")
    print("first row of each run: its plan re-made with the rates it measured at its start (the run's own plan: "
          + ", ".join(f"{x['run_plan_s']:.1f} s" for x in rows if x["step"] is None) + ") against the mean of its "
          "steady steps (after the first optimizer pass)\n* the first optimizer pass: its reads were of never-written "
          "regions (holes), counted as disk reads where the tier did not zero-fill them")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
