"""What would fit: config changes that bring a run that does not fit under the machine's limits.

Each candidate is a changed `Workload` planned again with estimate (estimate.py) against the same host RAM and GPU
limit, the planner choosing the placement keys the config leaves free (placement.py); the suggestions are the ones
that fit, least disruptive first:

    1. the memory.* keys the config fixes left to the planner (a placement that fits, in config keys)
    2. smaller micro-batches, the same rows per step (train.micro_batch_size, train.grad_accum_steps)
    3. fp32 streaming (12 B/param of host RAM instead of 14)
    4. shorter rows (data.max_seq_len), when nothing above fits
    5. when host RAM is short and no memory.disk_path is set: the SSD tier (Adam v, then m, then the master on a
       local SSD), with the states the planner would move and the step time it predicts (disk-bound or not)

and, for the disk, fewer kept checkpoints or another folder. run/oom.py asks the same question after an
out-of-memory error, with a GPU target below the peak the plan predicted.
"""

from __future__ import annotations

from dataclasses import replace

from .estimate import Plan, estimate
from .placement import FREE_ALL
from .profile import GiB
from .workload import Workload


def memory_ok(p: Plan, gpu_target: float | None) -> bool:
    """Host, GPU and the SSD tier fit (the checkpoints' disk is a separate matter: another folder or fewer kept)."""
    if any(x.startswith(("host RAM", "GPU memory", "SSD")) for x in p.problems):
        return False
    return gpu_target is None or p.workload.device != "cuda" or p.gpu_needed <= gpu_target


def host_floor(plan: Plan) -> float:
    """The least host RAM any workload of this model needs: the fp32 master and Adam m and v (12 B/param), less
    what the SSD tier can take (all of them when its free space is unknown)."""
    states = 12.0 * plan.params
    if plan.disk_path:
        states -= states if plan.ssd_free is None else min(states, plan.ssd_free)
    return states


def suggestions(adapter, plan: Plan, gpu_target: float | None = None) -> list[str]:
    """Config changes that would fit, least disruptive first. gpu_target: GPU bytes to get under instead of the
    plan's limit (after an out-of-memory error: a share of the predicted peak)."""
    w = plan.workload
    per_step, micro = sum(w.micro_batches), max(w.micro_batches)
    out: list[str] = []
    memory_problem = not memory_ok(plan, gpu_target)
    if gpu_target is None and plan.gpu_limit:
        gpu_target = 0.95 * plan.gpu_limit  # a suggestion keeps 5% of the GPU in hand

    def trial(cand: Workload, free: frozenset = plan.free, disk_path: str | None = plan.disk_path) -> Plan | None:
        p = estimate(adapter, cand, plan.profile, host_available=plan.host_available, host_source=plan.host_source,
                     gpu_limit=gpu_target, config_keys=frozenset(plan.config_keys), choose_keys=free,
                     disk_path=disk_path, ssd_free=plan.ssd_free if disk_path == plan.disk_path else None)
        return p if memory_ok(p, gpu_target) else None

    def line(p: Plan, change: str) -> str:
        what = f"host {p.host_total / GiB:.0f} GiB" + (f", GPU {p.gpu_needed / GiB:.0f} GiB"
                                                        if p.workload.device == "cuda" else "")
        chosen = f"; the planner's placement: {p.placement_keys}" if p.free and p.workload.device == "cuda" else ""
        return f"{change}  ({what}, {p.step_s:.1f} s/step predicted{chosen})"

    # no change below brings the host need under the optimizer states the SSD tier cannot take: none is tried
    hopeless = plan.host_available is not None and host_floor(plan) > plan.host_available
    if memory_problem and not hopeless:
        fixed = FREE_ALL - plan.free  # 1. the placement keys the config fixes, left to the planner
        if fixed and w.device == "cuda" and (p := trial(w, FREE_ALL)):
            out.append(line(p, "leave " + ", ".join(f"memory.{k}" for k in sorted(fixed)) + " unset"))
        b = micro // 2  # 2. smaller micro-batches, the same rows per step
        while b >= 1:
            sizes = tuple([b] * (per_step // b) + ([per_step % b] if per_step % b else []))
            if p := trial(replace(w, micro_batches=sizes)):
                out.append(line(p, f"train.micro_batch_size={b} train.grad_accum_steps={-(-per_step // b)} "
                                   f"(the same rows per step)"))
                break
            b //= 2
        if w.precision == "bf16" and (p := trial(replace(w, precision="fp32"))):  # 3. 12 B/param of host RAM
            out.append(line(p, "train.precision=fp32 (12 B/param of host RAM instead of 14; fp32 compute)"))
        T = w.seq_len // 2  # 4. shorter rows, when nothing above fits
        while T >= 128 and not out:
            if p := trial(replace(w, seq_len=T)):
                out.append(line(p, f"data.max_seq_len={T}"))
                break
            T //= 2
    if memory_problem:
        host_short = hopeless or any(x.startswith(("host RAM", "SSD")) for x in plan.problems)
        if host_short and not plan.disk_path and plan.world.size == 1 and \
                (p := trial(w, plan.free, "/a/local/ssd/folder")):  # 5. the SSD tier
            ssd = p.ssd
            out.append(line(p, f"memory.disk_path=<a folder on a local SSD> (the planner puts "
                               f"{', '.join(p.workload.disk_states)} there: {ssd['resident_bytes'] / GiB:.0f} GiB on "
                               f"the SSD, {(ssd['read_bytes'] + ssd['write_bytes']) / GiB:.0f} GiB read+written per "
                               f"step, {ssd['disk_s']:.1f} s at {ssd['read_bps'] / 1e9:.1f}/"
                               f"{ssd['write_bps'] / 1e9:.1f} GB/s read/write"
                               + ("; disk-bound" if p.time["bound"].startswith("SSD") else "") + ")"))
        if not out:
            if host_short:
                floor = 12.0 * plan.params + sum(v for k, v in plan.host.items()
                                                 if k.startswith(("gradient landing", "runtime", "data")))
                ssd = "" if not plan.disk_path else " less what the SSD tier holds (" + (
                    "its size unknown" if plan.ssd_free is None else f"{plan.ssd_free / GiB:.0f} GiB free") + ")"
                out.append(f"nothing smaller fits: fp32 master weights and Adam m and v alone take 12 B/param, "
                           f"{floor / GiB:.0f} GiB with the runtime{ssd}; use a machine with more host RAM"
                           + (" or SSD space" if plan.disk_path else "") + " (or a smaller model)")
            else:
                out.append("nothing smaller fits on this GPU: even one row per micro-batch, with every placement "
                           "of checkpoints, gradients and wave groups, exceeds it; use a GPU with more memory, more "
                           "host RAM (memory.host_budget_gb), or shorter rows")
    if any(x.startswith("disk") for x in plan.problems):
        if plan.checkpoint_copies > 1:
            out.append(f"checkpoint.keep=1 ({2 * plan.disk_per_checkpoint / GiB:.0f} GiB while a new one is written)")
        out.append(f"output.dir on a file system with {plan.checkpoint_copies * plan.disk_per_checkpoint / GiB:.0f} "
                   f"GiB free, or fewer saves (checkpoint.every=0, checkpoint.at_end=false)")
    return out
