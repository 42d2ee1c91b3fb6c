"""The plan held against the run (GPU runs): once the steps are steady, a step time off the plan by more than
TOLERANCE is said once, with where the difference shows and what would make the plan right.

Steady: after STEADY_AFTER steps of this process (the first compiles the layers and, with clipping, the second runs
the first optimizer pass: the SSD tier's states not yet written, the CPU AdamW's first touch). The line names the
step's GPU idle time against the plan's, the rate the SSD tier's disk gave while busy against the rates the plan
used (and where those came from), and, when the plan ran on built-in rates, `megatrain probe`, which measures the
machine's own. Issue 16's runs are why: the disk measured at one run's start read 1.38 / 1.17 GB/s where its steps
then got about 1.5, and the plan was 36% long with nothing in the run to say so.

A grpo step is held against the plan's training step by its own part (`train_s`: without its rollout batch's
sampling and log-prob passes, which only a batch's first step carries), and the first steady step that ran a rollout
against the plan's rollout phase.

Stalls, also said once (any device, with a plan or without): the slowest steady step (its own part) when it is more
than SLOW_STEP behind the median of the steady steps so far (the latest WINDOW), once there are MEDIAN_OF of them, so
that a step that stalls early is named when later ones show the median; with its GPU idle time and its longest idle
stretches (the record's `busy_compute` and `idle_gaps`: run/stepstats.py), the CPU AdamW's rate, and its longest
piece of work when that took HELD_TIMES its usual time: the benchmark's own reads of the run's smaps held the
optimizer's threads 0.4-0.6 s at a time (docs/planner.md, "Steps at an even pace").

Packed rows vary in attention work from step to step (a row of a few long documents attends over far more than one
of many short ones), so there each step is held, against the plan and against the median, at the plan's time for its
own documents' attention span (the record's attn_len; planner.estimate.packed_step_time).
"""

from __future__ import annotations

import statistics
from collections import deque

TOLERANCE = 0.15  # the planner's stated accuracy for step time (bench/plan_vs_measured.py)
STEADY_AFTER = 2
SLOW_STEP = 0.15  # a steady step this far behind the median of the steady steps is a stall
MEDIAN_OF = 3  # steady steps the median needs before a stall is named
HELD_TIMES, HELD_AFTER_S = 5.0, 0.1  # the optimizer's piece of work this much over its usual time was held
WINDOW = 100  # the median of the latest this many steady steps


class PlanCheck:
    def __init__(self, plan, first_step: int, expect=None):
        """plan: the run's planner.Plan (None: nothing to check against a plan); first_step: the step this process
        started after; expect: span -> the plan's step time at a step's own attention span (packed rows:
        planner.estimate.packed_step_time), or None: every step is held against the plan's one time."""
        self.plan = plan if plan is not None and plan.workload.device == "cuda" else None
        self.expect = expect if self.plan is not None else None
        self.first_step = first_step
        self.done = self.plan is None
        self.steady: deque = deque(maxlen=WINDOW)  # the latest steady steps' records, until a stall is named
        self.slow_said = False
        self.rollout = (getattr(plan, "rollout", None) or {}) if self.plan is not None else {}  # grpo's phase
        self.rollout_done = not self.rollout

    def __call__(self, record: dict) -> str | None:
        """The notices for this step's record (the logger's, with the stats and disk fields), or None."""
        if record.get("step", 0) <= self.first_step + STEADY_AFTER or not record.get("step_time_s"):
            return None
        if not self.slow_said:
            self.steady.append(record)
        lines = [line for line in (self._plan_line(record), self._rollout_line(record), self._slow_line()) if line]
        return "\n".join(lines) or None

    def _expected(self, record: dict) -> float | None:
        """The plan's time for this step's own work (expect at its attention span), or None."""
        return self.expect(record["attn_len"]) if self.expect and record.get("attn_len") else None

    def _pace(self, record: dict) -> float:
        """A step's time over the plan's for its own work (packed rows: its documents' attention), else its time."""
        e = self._expected(record)
        return own_time(record) / e if e else own_time(record)

    def _slow_line(self) -> str | None:
        """Once: the slowest steady step so far, when it is more than SLOW_STEP behind their median (with packed
        rows, by pace: its time over what the plan gives its own documents, so a step of long documents is not a
        stall)."""
        if self.slow_said or len(self.steady) < MEDIAN_OF:
            return None
        median = statistics.median(self._pace(r) for r in self.steady)
        slow = max(self.steady, key=self._pace)
        if self._pace(slow) <= median * (1 + SLOW_STEP):
            return None
        self.slow_said = True
        rates = [r["optimizer_gparams_per_s"] for r in self.steady if r.get("optimizer_gparams_per_s")]
        e = self._expected(slow)
        return slow_step_line(slow, median * e if e else median, len(self.steady),
                              statistics.median(rates) if rates else None, own_work=bool(e))

    def _plan_line(self, record: dict) -> str | None:
        if self.done:
            return None
        self.done = True
        t = self.plan.time
        measured, own = own_time(record), None if self.rollout else self._expected(record)
        predicted = self.rollout["train_step_s"] if self.rollout else own or t["step_s"]
        err = predicted / measured - 1
        if abs(err) <= TOLERANCE:
            return None
        what = f"step {record['step']}'s training" if "train_s" in record else f"step {record['step']}"
        at = f" for its documents' attention span of {record['attn_len']:,.0f} tokens" if own else ""
        parts = [f"plan check: {what} took {measured:.2f} s, the plan {predicted:.2f} s{at} "
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


    def _rollout_line(self, record: dict) -> str | None:
        """Once, on the first steady grpo step that ran a rollout: its rollout off the plan's by more than TOLERANCE."""
        if self.rollout_done or not record.get("rollout_s"):
            return None
        self.rollout_done = True
        r, measured = self.rollout, record["rollout_s"]
        err = r["rollout_s"] / measured - 1
        if abs(err) <= TOLERANCE:
            return None
        rate = f" ({record['rollout_tokens_per_s']:,.0f} tokens/s)" if record.get("rollout_tokens_per_s") else ""
        return (f"plan check: step {record['step']}'s rollout took {measured:.2f} s{rate}, the plan "
                f"{r['rollout_s']:.2f} s ({abs(err):.0%} {'long' if err > 0 else 'short'}; {r['mode']}, decode step "
                f"{r['decode_step_s'] * 1e3:.1f} ms planned"
                + (f", {record['rollout_decode_step_median_s'] * 1e3:.1f} ms median measured"
                   if record.get("rollout_decode_step_median_s") else "") + ")"
                + "".join(f"; {what} {record[k]:.2f} s (planned {r[p]:.2f})"
                          for k, p, what in (("rollout_drain_s", "drain_s", "the last step's updates"),
                                             ("rollout_setup_s", "setup_s", "the sampler's set-up"),
                                             ("rollout_prefill_s", "prefill_s", "prefill"))
                          if record.get(k) is not None and p in r))


def own_time(record: dict) -> float:
    """A step's own time: a grpo step's without its rollout batch's sampling and log-prob passes (its train_s)."""
    return record["train_s"] if "train_s" in record else record["step_time_s"]


def slow_step_line(record: dict, median: float, steps: int, optimizer_median: float | None = None,
                   own_work: bool = False) -> str:
    """A step well behind the median of `steps` steady steps: its time (a grpo step's training part), the ratio, its
    GPU idle time and its longest idle stretches of the compute stream (each with the work it followed and the work
    it waited for), and the CPU AdamW's rate in it against the steady steps' median (`optimizer_median`, Gparam/s):
    a GPU that waited for an optimizer running at its usual rate waited on something else. own_work: `median` is
    the time the steady steps' median pace gives this step's own documents (packed rows)."""
    t = own_time(record)
    what = f"step {record['step']}'s training" if "train_s" in record else f"step {record['step']}"
    line = (f"slow step: {what} took {t:.2f} s, {t / median:.2f}x the {median:.2f} s its documents take at the "
            f"median pace of {steps} steady steps" if own_work else
            f"slow step: {what} took {t:.2f} s, {t / median:.2f}x the median {median:.2f} s of {steps} steady steps")
    if "busy_compute" in record:
        line += f"; GPU idle {(1 - record['busy_compute']) * t:.2f} s"
    gaps = record.get("idle_gaps") or []
    if gaps:
        line += "; longest idle stretches: " + ", ".join(idle_stretch(g) for g in gaps)
    if record.get("optimizer_gparams_per_s") and optimizer_median:
        line += (f"; CPU AdamW {record['optimizer_gparams_per_s']:.2f} Gparam/s (median "
                 f"{optimizer_median:.2f})")
    longest, usual = record.get("optimizer_longest_s", 0.0), record.get("optimizer_longest_usual_s", 0.0)
    if longest > HELD_AFTER_S and longest > HELD_TIMES * usual:
        line += (f"; the optimizer's longest piece of work took {longest:.2f} s where its size takes {usual:.3f} s: "
                 f"its threads were held, not slowed (page faults waiting behind another process reading this "
                 f"one's /proc/PID/smaps, memory reclaim)")
    return line


def idle_stretch(g: dict) -> str:
    """One idle stretch of the compute stream, as stepstats records it ({"ms", "after", "before"})."""
    where = " ".join(x for x in (f"after {g['after']}" if g.get("after") else "",
                                 f"before {g['before']}" if g.get("before") else "") if x)
    return f"{g['ms'] / 1e3:.2f} s" + (f" ({where})" if where else "")
