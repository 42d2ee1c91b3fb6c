"""Wall time of `megatrain plan` (the CLI, process start and imports included) for the runs issue 36 names, and where
the time goes: a cProfile summary per case.

    python bench/plan_speed.py [--repeat 3] [--top 15] [--no-profile] [--json OUT.json] [--only SUBSTRING]
                               [--root CHECKOUT] [--timeout S]

Every case plans for CUDA (train.device=cuda) from config.json alone (bench/model-configs) with a GPU profile (the
H100 probe, bench/results/probe-h100; the 70B and 405B rows the H200 probe, as bench/plan_choices.py plans them),
memory.host_budget_gb as the row names it, no checkpoint written (so that the output folder's free space is not what
the plan is about). The 405B row plans the SSD tier (memory.disk_path) with a 12 GB/s RAID's rates written into a
copy of the profile (as bench/plan_choices.py --ssd). Each case runs `python -m megatrain plan` in a fresh process
`--repeat` times (the fastest and the median wall time printed, and the median CPU time, user + sys), then once
under cProfile: the functions with the most cumulative time, and the most time of their own. On a machine with a GPU
the plan takes that GPU's free memory as its limit (as `megatrain plan` does there); elsewhere the profile's. --root
times another checkout's megatrain (the same cases, this script's configs and profiles: before and after a change);
--timeout ends a run after S seconds. Python's bytecode is cached as a user's install caches it (in this run's
temporary folder, whatever PYTHONDONTWRITEBYTECODE says: the `--help` runs and each case's first run compile it).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
H100 = HERE / "results" / "probe-h100" / "profile.json"
H200 = HERE / "results" / "probe-h200" / "profile.json"
LAST_CPU = 0.0  # CPU seconds (user + sys) of the last run's process: on a shared machine steadier than wall time
PYCACHE: Path | None = None  # the runs' bytecode cache (main: in its temporary folder)
RAID = (12e9, 12e9)  # disk read, write bytes/s: an NVMe RAID (bench/plan_choices.py --ssd)

# label, model, rows per micro-batch, micro-batches, tokens per row, host GiB, profile, clipping, SSD tier
CASES = [
    ("Qwen2.5-7B 158x1024", "qwen2.5-7b", 79, 2, 1024, 125, H100, True, False),
    ("Llama-3.1-8B 1x131072", "llama-3.1-8b", 1, 1, 131072, 125, H100, True, False),
    ("Llama-3.1-70B 128x4096, 1536 GiB", "llama-3.1-70b", 16, 8, 4096, 1536, H200, True, False),
    ("Llama-3.1-405B 1M tokens, 1536 GiB, SSD", "llama-3.1-405b", 16, 64, 1024, 1536, H200, False, True),
]


def ssd_profile(src: Path, folder: Path) -> Path:
    """A copy of the profile at `src` with the RAID's disk rates, as if probed there."""
    raw = json.loads(src.read_text())
    raw["disk"] = {"read_bps": RAID[0], "write_bps": RAID[1], "path": "an NVMe RAID (given)"}
    out = folder / "profile-raid.json"
    out.write_text(json.dumps(raw))
    return out


def command(case, folder: Path) -> list[str]:
    label, model, micro, n, seq, host, prof, clip, ssd = case
    data = ROOT / "megatrain" / "defaults" / "reverse-train.jsonl"
    args = [f"model.path={HERE / 'model-configs' / model}", f"data.path={data}", "data.format=alpaca",
            "train.device=cuda", f"train.micro_batch_size={micro}", f"train.grad_accum_steps={n}",
            f"data.max_seq_len={seq}", f"memory.host_budget_gb={host}", f"output.dir={folder / 'out'}",
            "checkpoint.at_end=false", f"train.max_grad_norm={1.0 if clip else 'null'}"]
    if ssd:
        disk = folder / "ssd"
        disk.mkdir(exist_ok=True)
        args += [f"plan.profile={ssd_profile(prof, folder)}", f"memory.disk_path={disk}"]
    else:
        args.append(f"plan.profile={prof}")
    return ["plan", *args]


def run(argv: list[str], profile_to: Path | None = None, root: Path = ROOT, timeout: float | None = None) \
        -> tuple[float, subprocess.CompletedProcess | None]:
    """Seconds of `python -m megatrain ARGV` in a fresh process with `root`'s megatrain, and the process (None: it
    ran past `timeout`)."""
    pre = ["-m", "cProfile", "-o", str(profile_to)] if profile_to else []
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           **({"PYTHONPYCACHEPREFIX": str(PYCACHE)} if PYCACHE else {})}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (set on some machines: every run would compile megatrain's sources)
    global LAST_CPU
    r0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *pre, "-m", "megatrain", *argv], capture_output=True, text=True, env=env,
                           cwd=root, timeout=timeout)
    except subprocess.TimeoutExpired:
        p = None
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall, p


def placement(stdout: str) -> str:
    """The plan's placement line (what the plan chose), for comparing before and after."""
    for line in stdout.splitlines():
        if "memory." in line and "=" in line:
            return line.strip()
    return "?"


def summary(path: Path, top: int) -> str:
    """The functions with the most cumulative time, then the most own time (the project's and torch's named by file
    and line)."""
    st = pstats.Stats(str(path))
    total = st.total_tt
    rows = []
    for key, (cc, nc, tt, ct, _) in st.stats.items():
        file, line, name = key
        short = file.replace(str(ROOT) + "/", "")
        if "site-packages/" in short:
            short = short.split("site-packages/", 1)[1]
        rows.append((ct, tt, nc, f"{short}:{line}({name})"))
    out = [f"    total {total:.2f} s (under cProfile)", "    cumulative s   own s    calls  function"]
    for ct, tt, nc, name in sorted(rows, key=lambda r: -r[0])[:top]:
        out.append(f"    {ct:12.2f}{tt:8.2f}{nc:9d}  {name}")
    out.append("    -- most own time --")
    for ct, tt, nc, name in sorted(rows, key=lambda r: -r[1])[:top]:
        out.append(f"    {ct:12.2f}{tt:8.2f}{nc:9d}  {name}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--only", default="")
    ap.add_argument("--json")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose megatrain is timed")
    ap.add_argument("--timeout", type=float, default=None, help="seconds a run may take")
    args = ap.parse_args()
    root = args.root.resolve()
    rows = []
    with tempfile.TemporaryDirectory(prefix="plan-speed-") as tmp:
        folder = Path(tmp)
        global PYCACHE
        PYCACHE = folder / "pycache"
        base = min(run(["plan", "--help"], root=root)[0] for _ in range(args.repeat))  # the interpreter's start
        print(f"megatrain of {root}")
        print(f"process start + `megatrain plan --help`: {base:.2f} s", flush=True)
        for case in CASES:
            if args.only and args.only not in case[0]:
                continue
            argv = command(case, folder)
            times, cpus, last = [], [], None
            for _ in range(args.repeat):
                t, last = run(argv, root=root, timeout=args.timeout)
                times.append(t)
                cpus.append(LAST_CPU)
                if last is None:
                    break
            if last is None:
                print(f"\n{case[0]}: more than {args.timeout:.0f} s", flush=True)
                rows.append({"case": case[0], "wall_s": times, "fastest_s": None, "median_s": None, "fits": None,
                             "placement": f"> {args.timeout:.0f} s"})
                continue
            if last.returncode not in (0, 1):
                print(f"{case[0]}: megatrain plan failed ({last.returncode}):\n{last.stderr[-2000:]}")
                return 1
            row = {"case": case[0], "wall_s": times, "fastest_s": min(times), "median_s": statistics.median(times),
                   "cpu_s": cpus, "cpu_median_s": statistics.median(cpus), "fits": last.returncode == 0,
                   "placement": placement(last.stdout)}
            print(f"\n{case[0]}: fastest {row['fastest_s']:.2f} s, median {row['median_s']:.2f} s of {args.repeat} "
                  f"(CPU user+sys median {row['cpu_median_s']:.2f} s); "
                  f"{'fits' if row['fits'] else 'does not fit'}; {row['placement']}", flush=True)
            if not args.no_profile:
                prof_file = folder / "plan.prof"
                t, _ = run(argv, prof_file, root=root, timeout=args.timeout)
                row["profiled_s"] = t
                print(summary(prof_file, args.top), flush=True)
            rows.append(row)
    print(f"\n{'case':<42}{'fastest s':>10}{'median s':>10}{'CPU s':>8}  fits")
    for r in rows:
        if r["fastest_s"] is None:
            print(f"{r['case']:<42}{r['placement']:>20}")
        else:
            print(f"{r['case']:<42}{r['fastest_s']:>10.2f}{r['median_s']:>10.2f}{r['cpu_median_s']:>8.2f}  {r['fits']}")
    if args.json:
        from common import write_json  # (torch: imported here only, after the timed runs)

        write_json(args.json, {"python": sys.version.split()[0], "root": str(root), "start_s": base, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
