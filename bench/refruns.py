"""Reading the reference runs: bench/results/<name>/result.json, one folder per thing measured.

A result.json holds what it measures, the command, the machine kind and device, the revision and the date, and the
data as the benchmark wrote it: one run's `result` (or `results`) at its top level, or several runs, each with its own
command and result, under `runs`. A probe's folder holds the profile as profile.json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REQUIRED = ("measures", "command", "kind", "device", "revision", "date")


def load(name: str | Path) -> dict:
    """The result.json of a reference run (a folder name under bench/results, or a folder)."""
    folder = Path(name) if Path(name).is_absolute() else RESULTS / name
    return json.loads((folder / "result.json").read_text())


def runs(name: str | Path) -> list[dict]:
    """Its runs, each a dict with command and result (one benchmark's own "runs", a dict of its modes, are one run)."""
    return runs_of(load(name))


def runs_of(payload: dict) -> list[dict]:
    """The runs of a result.json's (or a benchmark JSON's) payload: its "runs" list, else the payload itself."""
    found = payload.get("runs")
    return found if isinstance(found, list) and found else [payload]


def result(name: str | Path, label: str | None = None) -> dict:
    """The result of its run labelled `label` (or of its only run)."""
    found = [r["result"] for r in runs(name) if label is None or r["result"].get("label") == label]
    if len(found) != 1:
        raise KeyError(f"{name}: {len(found)} runs labelled {label!r}")
    return found[0]


def host_measured(r: dict) -> float | None:
    """A `megatrain train` run's measured host peak (GiB) as its plan counts it: one process's peak RSS; several
    ranks' the node's (the shared store once): bench_cli's counter-based `host_node_rss_gib`, or the summed PSS
    that older results hold."""
    if (r.get("nproc_per_node") or 1) > 1:
        return r.get("host_node_rss_gib") or r.get("host_node_pss_gib")
    return r.get("host_peak_rss_gib")


def names() -> list[str]:
    """Every reference run under bench/results, by name."""
    return sorted(p.parent.name for p in RESULTS.glob("*/result.json"))


def add(name: str, measures: str, kind: str, jsons: list[Path], logs: list[Path]) -> Path:
    """Write bench/results/NAME/result.json from benchmark JSONs (each with date, machine, git, command and its
    data, as the benchmarks write them) and NAME/log.txt from their logs, replacing what the folder held."""
    payloads = [json.loads(Path(f).read_text()) for f in jsons]
    if not payloads:
        raise SystemExit("refruns add: no JSON given")
    last = max(payloads, key=lambda p: str(p.get("date", "")))
    head = {"measures": measures, "kind": kind, "device": last.get("machine", ""),
            "date": str(last.get("date", ""))[:10]}
    if len(payloads) == 1:
        p = payloads[0]
        out = {**head, "command": p["command"], "revision": p.get("git", ""),
               **{k: v for k, v in p.items() if k not in ("machine", "git", "date", "command")}}
    else:
        out = {**head, "command": "\n".join(p["command"] for p in payloads),
               "revision": " ".join(sorted({p.get("git", "") for p in payloads})), "runs": payloads}
    folder = RESULTS / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "result.json").write_text(json.dumps(out, indent=1) + "\n")
    text = [f"==> {Path(f).name} <==\n" + Path(f).read_text(errors="replace").rstrip("\n") + "\n" for f in logs]
    if text:
        (folder / "log.txt").write_text("\n".join(text))
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description="Add or replace a reference run under bench/results.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("add", help="write NAME/result.json and NAME/log.txt from a device call's output")
    a.add_argument("name", help="what it measures, e.g. qwen2.5-7b-158x1024-h100-cli")
    a.add_argument("--measures", required=True, help="one line: what the run measures")
    a.add_argument("--kind", required=True, help="the machine kind that ran it, e.g. nvidia-h100-x1")
    a.add_argument("--json", nargs="+", type=Path, required=True, help="the benchmark JSONs ($OUT/*.json)")
    a.add_argument("--log", nargs="*", type=Path, default=[], help="their logs ($OUT/*.log)")
    sub.add_parser("list", help="the reference runs and what each measures")
    args = ap.parse_args()
    if args.cmd == "add":
        print(add(args.name, args.measures, args.kind, args.json, args.log))
    else:
        for n in names():
            print(f"{n:<48}{load(n)['measures'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
