"""The plan held against the run (GPU runs): once the steps are steady, a step time off the plan by more than
TOLERANCE is said once, with where the difference shows and what would make the plan right.

Steady: after STEADY_AFTER steps of this process (the first compiles the layers and, with clipping, the second runs
the first optimizer pass: the SSD tier's states not yet written, the CPU AdamW's first touch). The line names the
step's GPU idle time against the plan's, the rate the SSD tier's disk gave while busy against the rates the plan
used (and where those came from), and, when the plan ran on built-in rates, `megatrain probe`, which measures the
machine's own. Issue 16's runs are why: the disk measured at one run's start read 1.38 / 1.17 GB/s where its steps
then got about 1.5, and the plan was 36% long with nothing in the run to say so.
"""

from __future__ import annotations

TOLERANCE = 0.15  # the planner's stated accuracy for step time (bench/plan_vs_measured.py)
STEADY_AFTER = 2


class PlanCheck:
    def __init__(self, plan, first_step: int):
        """plan: the run's planner.Plan (None: nothing to check); first_step: the step this process started after."""
        self.plan = plan if plan is not None and plan.workload.device == "cuda" else None
        self.first_step = first_step
        self.done = self.plan is None

    def __call__(self, record: dict) -> str | None:
        """The notice for this step's record (the logger's, with the stats and disk fields), or None."""
        if self.done or record.get("step", 0) <= self.first_step + STEADY_AFTER or not record.get("step_time_s"):
            return None
        self.done = True
        t = self.plan.time
        measured, predicted = record["step_time_s"], t["step_s"]
        err = predicted / measured - 1
        if abs(err) <= TOLERANCE:
            return None
        parts = [f"plan check: step {record['step']} took {measured:.2f} s, the plan {predicted:.2f} s "
                 f"({abs(err):.0%} {'long' if err > 0 else 'short'}; bound by {t['bound']})"]
        if "busy_compute" in record:
            parts.append(f"GPU idle {(1 - record['busy_compute']) * measured:.2f} s (planned "
                         f"{t.get('gpu_idle_s', 0.0):.2f})")
        ssd = t.get("ssd")
        if ssd and record.get("disk_gbps"):
            parts.append(f"the SSD tier's disk did {record['disk_gbps']:.2f} GB/s while busy "
                         f"({record.get('disk_busy', 0.0):.0%} of the step) where the plan used read "
                         f"{ssd['read_bps'] / 1e9:.2f}, write {ssd['write_bps'] / 1e9:.2f} GB/s "
                         f"({ssd.get('source') or 'built in'})")
        hints = []
        if ssd and "megatrain probe" not in (ssd.get("source") or ""):
            hints.append("`megatrain probe --disk DIR` measures the disk at length into the profile (plan.profile)")
        if not self.plan.profile.measured:
            hints.append("the plan used the built-in H200 rates: `megatrain probe` on this machine writes its own")
        return "; ".join(parts) + (". " + "; ".join(hints) if hints else "")
