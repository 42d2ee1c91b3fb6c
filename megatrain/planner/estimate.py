"""The plan of one workload: `Plan`, its figures (host RAM, GPU memory, disk, step time) and the problems against
the limits it was planned for, and `estimate`, which computes it.

    estimate   the placement (placement.py: chosen from the budgets for the keys the caller leaves free), memory
               (memory.py), time (timing.py) and the checks against what is available. What would fit when the
               run does not is suggest.py's, which estimates its candidates with it; make_plan (plan.py) adds that
    Plan       the figures, as fields (report.py renders them as text) and as JSON (`megatrain plan --json`)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..runtime.layer import can_stash
from .memory import (DEVICE_WORK, TUNE_COPY, autotune_host, checkpoint_bytes, gpu_needed, gpu_phases, host_memory,
                     peak_phase, pinned_bytes)
from .choice import choose
from .placement import describe
from .profile import COMPILED_SPEEDUP, GiB, Profile
from .tally import sized
from .timing import executed_flops, step_time
from .tune_copy import beside_store, copy_host, store_states
from .workload import Workload
from .world import World, comm, node_host, node_pinned, world_time

__all__ = ["Plan", "estimate"]


@dataclass
class Plan:
    model: str
    params: int
    workload: Workload
    profile: Profile
    host: dict[str, float]  # component -> bytes
    pinned: float
    host_available: float | None
    host_source: str
    gpu: dict[str, float]  # components at the peak phase (empty on a CPU device)
    gpu_peak: float  # allocated bytes at the peak (what torch.cuda.max_memory_allocated reports)
    gpu_peak_phase: str
    gpu_needed: float  # peak + allocator reserve + CUDA context
    gpu_limit: float | None
    gpu_limit_source: str
    disk_per_checkpoint: float
    disk_free: float | None
    time: dict[str, float]
    notes: list[str] = field(default_factory=list)
    checkpoint_copies: int = 0
    config_keys: set = field(default_factory=set)  # the config's keys (memory.spill_layers, ...) for suggestions
    problems: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    why: str = ""  # how the placement was chosen
    free: frozenset = frozenset()  # the placement keys the planner chose (the config leaves them unset)
    active_params: int = 0  # parameters that multiply each token (a MoE's top-k experts; = params when dense)
    world: World = field(default_factory=World)  # the ranks: host is then per node, time the world's step
    comm: dict = field(default_factory=dict)  # world.comm: bytes per rank and step on each link, seconds
    disk_path: str | None = None  # memory.disk_path: the SSD tier's folder (None: no SSD tier allowed)
    ssd_free: float | None = None  # free bytes there
    precision_why: str = ""  # the resolved train.precision and why, one line (precision.precision_line)
    io: dict = field(default_factory=dict)  # load, save, resume, export seconds (io_time.io_times; set by the caller)
    objective: dict = field(default_factory=dict)  # a preference objective's figures (objective.plan_objective)
    rollout: dict = field(default_factory=dict)  # a grpo run's rollout phase (rollout_plan.plan_rollout)

    @property
    def ssd(self) -> dict:
        """The SSD tier's figures (timing.ssd_time): bytes resident, read and written per step, the disk's seconds,
        the bytes per second that would hide it; empty without states on disk."""
        return self.time.get("ssd", {})

    @property
    def placement(self):
        """runtime.schedule.Placement the run uses (EngineOptions.placement)."""
        return self.workload.placement

    @property
    def placement_keys(self) -> str:
        return describe(self.workload.placement, len(self.workload.groups))

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def step_s(self) -> float:
        return self.time["step_s"]

    def as_json(self) -> dict:
        """The plan's figures, for scripts (`megatrain plan --json`)."""
        pl, t = self.workload.placement, self.time
        return {"model": self.model, "params": self.params, "active_params": self.active_params,
                "device": self.workload.device,
                "tokens_per_step": self.workload.tokens_per_step, "micro_batches": list(self.workload.micro_batches),
                "seq_len": self.workload.seq_len, "fits": self.fits, "problems": self.problems,
                "suggestions": self.suggestions,
                "placement": {**asdict(pl), "wave_groups": len(self.workload.groups)},
                "placement_why": self.why, "chosen_keys": sorted(self.free), "io": self.io,
                "host_peak_gib": self.host_total / GiB, "host_bytes_per_param": self.host_total / self.params,
                "host_available_gib": None if self.host_available is None else self.host_available / GiB,
                "pinned_gib": self.pinned / GiB, "host": {k: v / GiB for k, v in self.host.items()},
                "gpu_peak_gib": self.gpu_peak / GiB, "gpu_needed_gib": self.gpu_needed / GiB,
                "gpu_limit_gib": None if self.gpu_limit is None else self.gpu_limit / GiB,
                "gpu_peak_phase": self.gpu_peak_phase, "gpu": {k: v / GiB for k, v in self.gpu.items()},
                "disk_per_checkpoint_gib": self.disk_per_checkpoint / GiB,
                "step_time_s": t["step_s"], "tokens_per_s": t["tokens_per_s"], "tflops_6n": t["tflops_6n"],
                "tflops_6n_active": t.get("tflops_6n_active", t["tflops_6n"]),
                "executed_tflops": t["executed_tflops"], "mfu": t.get("mfu"), "bound": t["bound"],
                "clipping": self.workload.clipping, "gpu_idle_s": t.get("gpu_idle_s"),
                "optimizer_s": t["optimizer_s"], "optimizer_wait_s": t["optimizer_wait_s"],
                "optimizer_window_s": t["optimizer_window_s"], "other_mode": t.get("other_mode"),
                "disk_path": self.disk_path, "disk_states": list(self.workload.disk_states),
                "ssd": {"resident_gib": self.ssd["resident_bytes"] / GiB,
                        "read_gib_per_step": self.ssd["read_bytes"] / GiB,
                        "write_gib_per_step": self.ssd["write_bytes"] / GiB, "disk_s": self.ssd["disk_s"],
                        "hidden_gb_per_s": self.ssd["hidden_bps"] / 1e9, "read_gb_per_s": self.ssd["read_bps"] / 1e9,
                        "write_gb_per_s": self.ssd["write_bps"] / 1e9,
                        "free_gib": None if self.ssd_free is None else self.ssd_free / GiB} if self.ssd else None,
                "precision": self.workload.precision, "precision_why": self.precision_why,
                "notes": self.notes, "world": self.world_json(), "profile": self.profile.source,
                "cpu_adamw_params_per_s": self.profile.adamw_params_per_s,
                "objective": {k: v for k, v in self.objective.items() if k != "sft_time"} or None,
                "rollout": self.rollout or None}

    def world_json(self) -> dict:
        w, c = self.world, self.comm
        out = {"nodes": w.nodes, "ranks_per_node": w.ranks_per_node, "world_size": w.size,
               "global_tokens_per_step": self.workload.tokens_per_step * w.size}
        if w.size > 1:
            out.update(intra_node_gib_per_rank=c["intra_node_bytes_per_rank"] / GiB,
                       inter_node_gib_per_rank=c["inter_node_bytes_per_rank"] / GiB,
                       inter_node_gib_per_node=c["inter_node_bytes_per_node"] / GiB,
                       comm_s=c["comm_s"], exposed_comm_s=self.time["exposed_comm_s"],
                       rank_step_s=self.time["rank_step_s"])
        return out


def estimate(adapter, w: Workload, profile: Profile, *, host_available: float | None = None,
             host_source: str = "", gpu_limit: float | None = None, gpu_limit_source: str = "",
             disk_free: float | None = None, checkpoint_copies: int = 0,
             config_keys: frozenset = frozenset(), choose_keys: frozenset = frozenset(),
             world: World = World(), disk_path: str | None = None, ssd_free: float | None = None) -> Plan:
    """The plan of workload `w` (its suggestions left empty: make_plan adds them).
    checkpoint_copies: checkpoints on disk at once at most (0: no saves, the disk is not checked).
    choose_keys: the placement keys (workload.PLACEMENT_KEYS) the planner chooses from the limits (placement.py);
    the others are the workload's. world: the ranks; `w` is one rank's step, host_available the node's.
    disk_path: memory.disk_path (the planner may then put states on the SSD tier when host RAM is short, unless the
    workload fixes them); ssd_free: the free bytes there."""
    units = sized(adapter.units())  # (each unit summed once: the search and the timing read them often)
    params = sum(u.numel for u in units)
    notes = []
    if w.placement.reuse_attention and not can_stash(adapter):
        from ..errors import MegatrainError

        raise MegatrainError(f"memory.reuse_attention: {w.placement.reuse_attention}, but {adapter.model_type}'s "
                             "attention does not split into q/k/v, attention and output (its attention reads weights "
                             "of its own), so its layers cannot keep it for the backward: set 0 or leave it unset")
    if w.placement.attn_block and w.device == "cuda" and w.precision != "bf16":
        from ..errors import MegatrainError

        raise MegatrainError(f"memory.attn_block: {w.placement.attn_block}, but train.precision is {w.precision}: the "
                             "attention blocked for its backward runs a fused kernel (cuDNN's or flash's), which takes "
                             "bf16 on CUDA; set memory.attn_block: 0 or leave it unset")
    if not profile.measured:
        notes.append("no machine profile: rates are the built-in defaults, one H200's (planner/calibration.py); "
                     "run `megatrain probe` on the training machine for its own")
    why = "as given"
    if choose_keys or disk_path:
        w, why = choose(adapter, units, w, profile, _rank_host_limit(host_available, params, world), gpu_limit,
                        frozenset(choose_keys), disk=bool(disk_path) and world.size == 1)
    host = host_memory(units, w, adapter.tied)
    if w.tune_first and w.compile and w.device == "cuda":
        layers, phase = copy_host(adapter, w)
        beside = beside_store(host, phase, host_available)  # the store allocated and filled meanwhile
        total, run_peak = sum(phase.values()) + (store_states(host) if beside else 0.0), sum(host.values())
        if total > run_peak:  # the copy's phase (with the autotuner's block), beside the store or alone, is the peak
            host[TUNE_COPY] = total - run_peak
        when = "while the store is allocated and filled beside it" if beside else "before the store is allocated"
        notes.append(f"engine.tune_first: the kernels are compiled and tuned first on a copy of the model with "
                     f"{layers} layer{'s' if layers > 1 else ''}, {when}: {total / GiB:.1f} GiB of host then, the "
                     f"autotuner's page-locked copies (up to {autotune_host(units, w) / GiB:.2f} GiB) included"
                     + ("" if total > run_peak else ", not on this peak"))
    pinned = pinned_bytes(host, w)
    name, comps = peak_phase(gpu_phases(adapter, units, w, notes, profile))
    peak = sum(comps.values())
    if w.device == "cuda":
        needed, gpu = gpu_needed(peak, w), comps
    else:  # the device is the host: its activations and gradients are host RAM
        host[DEVICE_WORK] = peak
        needed, gpu = 0.0, {}
    pinned, host = node_pinned(pinned, host, world), node_host(host, world)
    c = comm(params, [u.numel for u in units], world, executed_flops(adapter, units, w)) if world.size > 1 else {}
    plan = Plan(f"{adapter.model_type}", params, w, profile, host, pinned, host_available, host_source, gpu,
                peak if w.device == "cuda" else 0.0, name, needed, gpu_limit, gpu_limit_source,
                checkpoint_bytes(params), disk_free, world_time(step_time(adapter, units, w, profile), c, world),
                notes, active_params=sum(adapter.active_numel(u) for u in units), world=world, comm=c)
    if " taken as x" in plan.time["rate_source"]:
        notes.append(f"layer rate: the profile has this layer shape {'eager' if w.compile else 'compiled'} only "
                     f"({plan.time['rate_source']}); converted by COMPILED_SPEEDUP={COMPILED_SPEEDUP}, the "
                     f"compiled/eager ratio of the H200 runs (`megatrain probe --compile both` measures both)")
    plan.checkpoint_copies = checkpoint_copies
    plan.config_keys = set(config_keys)
    plan.why, plan.free = why, frozenset(choose_keys)
    plan.disk_path, plan.ssd_free = disk_path, ssd_free
    _check(plan)
    return plan


def _rank_host_limit(available: float | None, params: int, world: World) -> float | None:
    """The host RAM one rank may plan for when the node's ranks share one store (about 14 B/param) and each adds
    its own share: a rank's host figure within it keeps the node's within `available`."""
    if available is None or world.ranks_per_node == 1:
        return available
    store = 14.0 * params
    return store + (available - store) / world.ranks_per_node


def _check(plan: Plan) -> None:
    host_short = plan.host_available is not None and plan.host_total > plan.host_available
    if host_short:
        plan.problems.append(f"host RAM: needs {plan.host_total / GiB:.1f} GiB, {plan.host_available / GiB:.1f} GiB "
                             f"available ({plan.host_source})")
    if plan.workload.device == "cuda" and plan.gpu_limit is not None and plan.gpu_needed > plan.gpu_limit:
        # the search refuses for host RAM before it walks the GPU: with host RAM short, the figure is the default
        # placement's, not the least a placement needs
        searched = " with the default placement (host RAM short, no other was searched)" if host_short and \
            plan.free else ""
        plan.problems.append(f"GPU memory: needs {plan.gpu_needed / GiB:.1f} GiB at the peak{searched} "
                             f"({plan.gpu_peak_phase}; {plan.gpu_peak / GiB:.1f} GiB allocated), "
                             f"{plan.gpu_limit / GiB:.1f} GiB available ({plan.gpu_limit_source})")
    ssd = plan.ssd
    if ssd and plan.ssd_free is not None and ssd["resident_bytes"] > plan.ssd_free:
        plan.problems.append(f"SSD: the tier's files take {size_text(ssd['resident_bytes'])}, "
                             f"{size_text(plan.ssd_free)} free in memory.disk_path ({plan.disk_path})")
    if plan.workload.disk_states and plan.world.size > 1:
        plan.problems.append("memory.disk_path: the SSD tier is built for one process (the node's ranks share one "
                             "host store); unset memory.disk_path or memory.disk_states for several ranks")
    n = plan.checkpoint_copies
    if n and plan.disk_free is not None and n * plan.disk_per_checkpoint > plan.disk_free:
        plan.problems.append(f"disk: {n} checkpoint{'s' if n > 1 else ''} of {size_text(plan.disk_per_checkpoint)} "
                             f"(checkpoint.keep + the one being written), {size_text(plan.disk_free)} free in "
                             f"the output folder")


def size_text(nbytes: float) -> str:
    """Bytes as GiB with one decimal, or MiB below a tenth of a GiB (a small model's checkpoint, a nearly full disk)."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"



def rows_timing(rows, padded) -> tuple[float, float]:
    """Unpacked micro-batches of `rows` rows each padded to `padded` tokens: (the mean padded tokens per micro-batch,
    the attention span sum(r·L²)/sum(r·L), the length a token's causal attention is counted at)."""
    r, L = np.asarray(rows, dtype=np.float64), np.asarray(padded, dtype=np.float64)  # (an epoch: 10^5 and more)
    tokens = float((r * L).sum())
    if not tokens:
        return 0.0, 0.0
    return tokens / len(r), float((r * L * L).sum()) / tokens


def retime_unpacked(plan: Plan, adapter, mb_tokens: float, span: float) -> None:
    """Unpacked rows, once the data is read: each micro-batch is padded to its longest row, not to max_seq_len, so
    the step is timed again at the data's mean padded micro-batch (mb_tokens) and attention span (rows_timing).
    Memory and placement stay those of max_seq_len (the epoch's largest micro-batch comes first). The plan's
    workload keeps its shape: only its time, tokens and FLOPs change."""
    w = plan.workload
    if w.packed or not mb_tokens:
        return
    micro = max(w.micro_batches)
    seq = max(1, min(w.seq_len, round(mb_tokens / micro)))  # the rows' padded length the step's tokens average to
    if seq >= w.seq_len:
        return
    timed = replace(w, seq_len=seq, rows_span=min(float(w.seq_len), span),
                    targets_per_row=None if w.targets_per_row is None else min(w.targets_per_row, seq - 1))
    plan.time = world_time(step_time(adapter, adapter.units(), timed, plan.profile), plan.comm, plan.world)
    plan.time["timed_rows"] = {"mean_padded_row": seq, "attention_span": timed.span_len}
    plan.notes.append(f"unpacked rows: the step timed at the data's micro-batches, each padded to its longest row: "
                      f"{seq:,} tokens a row on average (of max_seq_len {w.seq_len:,}), attention over "
                      f"{timed.span_len:,.0f} (sum(r·L²)/sum(r·L))")


def packed_step_time(plan: Plan, adapter):
    """Packed rows on CUDA: span -> the plan's step time with a step's own attention span (its documents set its
    attention work, so a step of long documents takes longer than the plan's step at the data's mean span), timed
    as retime_packed times the plan and kept per 1% of span. None for other rows."""
    w = plan.workload
    if not w.packed or w.device != "cuda":
        return None
    units, times = adapter.units(), {}

    def at(span: float) -> float:
        key = round(math.log(min(max(span, 1.0), w.seq_len)) * 100)
        if key not in times:
            timed = replace(w, attn_len=min(math.exp(key / 100), w.seq_len))
            times[key] = world_time(step_time(adapter, units, timed, plan.profile, other_mode=False), plan.comm,
                                    plan.world)["step_s"]
        return times[key]
    return at


def retime_packed(plan: Plan, adapter, attn_len: float) -> None:
    """Packed rows, once the data is read: the step timed again with the rows' attention span (data.sampler.
    packed_span: a row attends within each document and each piece of its padding, not over the row the plan was
    made for). Memory and placement stay: they depend on the row's length, not on where its documents end."""
    w = plan.workload
    if not w.packed or not attn_len or attn_len >= w.seq_len:
        return
    plan.workload = replace(w, attn_len=attn_len)
    plan.time = world_time(step_time(adapter, adapter.units(), plan.workload, plan.profile), plan.comm, plan.world)
    plan.notes.append(f"packed rows: attention timed over the rows' documents and padding pieces ({attn_len:,.0f} "
                      f"tokens a token: the sum of their squared lengths over the rows' tokens), not over the "
                      f"{w.seq_len:,}-token row")
