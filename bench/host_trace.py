"""What the host did during each training step of a run: a sampler thread reads /proc every PERIOD seconds while the
run's process lives (bench_cli.py --trace-host), and the samples are cut at the moments its metrics.jsonl gained a
step record. Per step: the CPU seconds of the run's process (all its threads) and of its descendants (torch.compile's
workers), the machine's CPU seconds (busy, iowait, and steal: time a hypervisor gave to other guests), the busiest
threads (name and CPU seconds), the kernel's memory events from /proc/vmstat (page faults, major faults, transparent
huge pages allocated and collapsed, compaction stalls, direct reclaim), the most runnable tasks seen at once
(/proc/stat's procs_running) and the run's dirty/writeback pages. A slow step whose GPU idled shows here
whether the CPU was saturated, whether the kernel was faulting, compacting or reclaiming, or whether nothing was busy
(then the cause is a wait, not work)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

PERIOD = 0.25
VMSTAT = ("pgfault", "pgmajfault", "thp_fault_alloc", "thp_collapse_alloc", "compact_stall", "allocstall_normal",
          "allocstall_movable", "pgscan_direct", "pgsteal_direct", "pswpin", "pswpout")
CLK = 100.0  # USER_HZ: /proc's CPU times are in these ticks on Linux


def _vmstat() -> dict[str, int]:
    out = {}
    for line in Path("/proc/vmstat").read_text().splitlines():
        k, v = line.split()
        if k in VMSTAT:
            out[k] = int(v)
    return out


def _machine() -> tuple[int, dict[str, float]]:
    """From /proc/stat: the runnable tasks now, and the machine's CPU seconds so far (all cores): busy (user, nice,
    system, irq, softirq), iowait, and steal (time the hypervisor gave this VM's CPUs to others: a step slowed by
    a neighbour shows it)."""
    running, cpu = 0, {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("procs_running"):
            running = int(line.split()[1])
        elif line.startswith("cpu "):
            f = [int(x) / CLK for x in line.split()[1:9]]
            cpu = {"busy": f[0] + f[1] + f[2] + f[5] + f[6], "iowait": f[4], "steal": f[7]}
    return running, cpu


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of one process."""
    out = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[int(task.name)] = (name, (int(fields[11]) + int(fields[12])) / CLK)
    return out


def _children_cpu(pid: int) -> float:
    """CPU seconds of the process's live descendants."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                kids = []
            for k in kids:
                todo.append(k)
                try:
                    stat = Path(f"/proc/{k}/stat").read_text()
                    f = stat[stat.rindex(")") + 2:].split()
                    total += (int(f[11]) + int(f[12])) / CLK
                except OSError:
                    pass
    return total


class HostTrace:
    """Samples /proc while `pid` runs; `per_step()` cuts the samples at each new step record of `metrics`."""

    def __init__(self, pid: int, metrics: Path):
        self.pid, self.metrics = pid, metrics
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="host-trace", daemon=True)
        self._thread.start()

    def _steps_logged(self) -> int:
        try:
            return sum(1 for line in self.metrics.read_text().splitlines() if '"loss"' in line)
        except OSError:
            return 0

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                running, machine = _machine()
                self.samples.append({"t": time.perf_counter(), "steps": self._steps_logged(), "vm": _vmstat(),
                                     "running": running, "machine": machine, "threads": _threads(self.pid),
                                     "children_cpu": _children_cpu(self.pid)})
            except (OSError, ValueError):
                pass  # the process ended between two reads
            self._stop.wait(PERIOD)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def per_step(self, top: int = 4) -> list[dict]:
        """One dict per step record seen: the window from the previous record's sample to this one's."""
        out, start = [], 0
        for i, s in enumerate(self.samples):
            if i and s["steps"] > self.samples[i - 1]["steps"]:
                a, b = self.samples[start], s
                window = self.samples[start: i + 1]
                cpu = {}
                for tid, (name, sec) in b["threads"].items():
                    cpu[tid] = (name, sec - a["threads"].get(tid, (name, 0.0))[1])
                busiest = sorted(cpu.items(), key=lambda kv: -kv[1][1])[:top]
                out.append({"step": s["steps"], "window_s": b["t"] - a["t"],
                            "cpu_s": sum(v for _, v in cpu.values()),
                            "children_cpu_s": max(0.0, b["children_cpu"] - a["children_cpu"]),
                            "busiest_threads": [f"{name}/{tid} {sec:.1f}" for tid, (name, sec) in busiest],
                            "max_running": max(w["running"] for w in window),
                            **{f"machine_{k}_s": b["machine"].get(k, 0.0) - a["machine"].get(k, 0.0)
                               for k in ("busy", "iowait", "steal")},
                            **{k: b["vm"].get(k, 0) - a["vm"].get(k, 0) for k in VMSTAT}})
                start = i
        return out


def trace_lines(steps: list[dict]) -> list[str]:
    """One line a step: the CPU it used, the kernel's memory events, the busiest threads."""
    lines = []
    for s in steps:
        vm = ", ".join(f"{k} {s[k]:,}" for k in VMSTAT if s.get(k))
        lines.append(f"step {s['step']}: {s['window_s']:.1f} s, CPU {s['cpu_s']:.1f} s (+{s['children_cpu_s']:.1f} s "
                     f"descendants; machine {s.get('machine_busy_s', 0.0):.1f} s, steal "
                     f"{s.get('machine_steal_s', 0.0):.1f} s), up to {s['max_running']} runnable; "
                     f"{vm or 'no memory events'}; busiest: "
                     + ", ".join(s["busiest_threads"]))
    return lines
