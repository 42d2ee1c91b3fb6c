"""The plan of a run, and the planner's entry points: host RAM, GPU memory, disk and step time, from config.json
and the config alone, before any weight is read, and whether they fit this machine.

    make_plan         the plan of a Workload (workload.py) for a model adapter and a machine profile: the placement
                      (placement.py: chosen from the budgets for the keys the config leaves free), memory
                      (memory.py), time (timing.py), the checks against what is available, and when the run does
                      not fit, what would (suggest.py)
    plan_for_config   the same from a validated megatrain.config.Config, with what this machine (or the profiled
                      one, or the config) says is available
    plan_command      `megatrain plan CONFIG` (cli.py): prints the report (report.py), or its figures as JSON
    World             several ranks (world.py): the plan is then per node, with the network's bytes and time
    check_before_run  `megatrain train`'s check before it loads weights (run/prepare.py): refuses what won't fit
    target_device     the device `megatrain plan` plans for

The plan mirrors the runtime (megatrain/runtime) without building any of it: sizes come from the runtime's own
functions, the GPU and the time from walking the runtime's own step schedule.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..runtime.layer import can_stash
from .memory import (DEVICE_WORK, TUNE_COPY, autotune_host, checkpoint_bytes, gpu_needed, gpu_phases, host_memory,
                     peak_phase, pinned_bytes)
from .placement import choose, describe
from .precision import precision_line
from .profile import COMPILED_SPEEDUP, GiB, Profile
from .report import refusal, render
from .suggest import suggestions
from .timing import executed_flops, step_time
from .tune_copy import copy_host
from .workload import PLACEMENT_KEYS, Workload, checkpoint_copies, fixed_placement, workload_from_config
from .world import World, comm, node_host, node_pinned, world_time

__all__ = ["Plan", "World", "Workload", "check_before_run", "make_plan", "plan_command", "plan_for_config",
           "target_device"]


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
                "placement_why": self.why, "chosen_keys": sorted(self.free),
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
                "cpu_adamw_params_per_s": self.profile.adamw_params_per_s}

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

    def report(self) -> str:
        return render(self)


def make_plan(adapter, w: Workload, profile: Profile, *, host_available: float | None = None,
              host_source: str = "", gpu_limit: float | None = None, gpu_limit_source: str = "",
              disk_free: float | None = None, checkpoint_copies: int = 0, suggest: bool = True,
              config_keys: frozenset = frozenset(), choose_keys: frozenset = frozenset(),
              world: World = World(), disk_path: str | None = None, ssd_free: float | None = None) -> Plan:
    """checkpoint_copies: checkpoints on disk at once at most (0: no saves, the disk is not checked).
    choose_keys: the placement keys (workload.PLACEMENT_KEYS) the planner chooses from the limits (placement.py);
    the others are the workload's. world: the ranks; `w` is one rank's step, host_available the node's.
    disk_path: memory.disk_path (the planner may then put states on the SSD tier when host RAM is short, unless the
    workload fixes them); ssd_free: the free bytes there."""
    units = adapter.units()
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
        notes.append("no machine profile: rates are the H200 defaults (DESIGN.md, bench 2026-11-21); "
                     "run `megatrain probe` on the training machine for its own")
    why = "as given"
    if choose_keys or disk_path:
        w, why = choose(adapter, units, w, profile, _rank_host_limit(host_available, params, world), gpu_limit,
                        frozenset(choose_keys), disk=bool(disk_path) and world.size == 1)
    host = host_memory(units, w, adapter.tied)
    if w.tune_first and w.compile and w.device == "cuda":
        layers, phase = copy_host(adapter, w)
        total, run_peak = sum(phase.values()), sum(host.values())
        if total > run_peak:  # few layers: the copy's phase, with the autotuner's block, is the peak
            host[TUNE_COPY] = total - run_peak
        notes.append(f"engine.tune_first: the kernels are compiled and tuned first on a copy of the model with "
                     f"{layers} layer{'s' if layers > 1 else ''}, before the store is allocated: {total / GiB:.1f} GiB "
                     f"of host then, the autotuner's page-locked copies (up to {autotune_host(units, w) / GiB:.2f} "
                     f"GiB) included" + ("" if total > run_peak else ", not on this peak"))
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
    if suggest and not plan.fits:
        plan.suggestions = suggestions(adapter, plan)
    return plan


def _rank_host_limit(available: float | None, params: int, world: World) -> float | None:
    """The host RAM one rank may plan for when the node's ranks share one store (about 14 B/param) and each adds
    its own share: a rank's host figure within it keeps the node's within `available`."""
    if available is None or world.ranks_per_node == 1:
        return available
    store = 14.0 * params
    return store + (available - store) / world.ranks_per_node


def _check(plan: Plan) -> None:
    if plan.host_available is not None and plan.host_total > plan.host_available:
        plan.problems.append(f"host RAM: needs {plan.host_total / GiB:.1f} GiB, {plan.host_available / GiB:.1f} GiB "
                             f"available ({plan.host_source})")
    if plan.workload.device == "cuda" and plan.gpu_limit is not None and plan.gpu_needed > plan.gpu_limit:
        plan.problems.append(f"GPU memory: needs {plan.gpu_needed / GiB:.1f} GiB at the peak ({plan.gpu_peak_phase}; "
                             f"{plan.gpu_peak / GiB:.1f} GiB allocated), {plan.gpu_limit / GiB:.1f} GiB available "
                             f"({plan.gpu_limit_source})")
    ssd = plan.ssd
    if ssd and plan.ssd_free is not None and ssd["resident_bytes"] > plan.ssd_free:
        plan.problems.append(f"SSD: the tier's files take {ssd['resident_bytes'] / GiB:.1f} GiB, "
                             f"{plan.ssd_free / GiB:.1f} GiB free in memory.disk_path ({plan.disk_path})")
    if plan.workload.disk_states and plan.world.size > 1:
        plan.problems.append("memory.disk_path: the SSD tier is built for one process (the node's ranks share one "
                             "host store); unset memory.disk_path or memory.disk_states for several ranks")
    n = plan.checkpoint_copies
    if n and plan.disk_free is not None and n * plan.disk_per_checkpoint > plan.disk_free:
        plan.problems.append(f"disk: {n} checkpoint{'s' if n > 1 else ''} of {plan.disk_per_checkpoint / GiB:.1f} GiB "
                             f"(checkpoint.keep + the one being written), {plan.disk_free / GiB:.1f} GiB free in "
                             f"the output folder")


# ---- from a validated Config ------------------------------------------------------------------------------
def plan_for_config(cfg, adapter, device: str, profile: Profile | None = None, world: World = World()) -> Plan:
    """The plan of `megatrain plan` and of the check `megatrain train` runs before loading weights (world: the
    ranks of a distributed run; the plan is then one node's)."""
    from . import sysmem
    from .profile import load_profile, this_host

    prof = profile or load_profile(cfg.plan.profile)
    w = workload_from_config(cfg, device, distributed=world.size > 1)
    # host RAM: the configured amount, else this machine's (cgroup-aware), else (planning for the profiled
    # machine from elsewhere) what the profile recorded
    if cfg.memory.host_budget_gb:
        host_avail, host_src = cfg.memory.host_budget_gb * GiB, "memory.host_budget_gb"
    elif prof.measured and prof.host and prof.host != this_host() and prof.host_available_bytes:
        host_avail, host_src = float(prof.host_available_bytes), f"free on {prof.host} when probed"
    else:
        hm = sysmem.host_memory()
        host_avail, host_src = float(hm.available), f"free now; {hm.source}"
    gpu_limit, gpu_src = None, ""
    if device == "cuda":
        budget = cfg.memory.gpu_budget_gb
        if torch_cuda_available():
            import torch

            free, total = torch.cuda.mem_get_info()
            gpu_limit, gpu_src = float(free), f"free on {torch.cuda.get_device_name()}"
        else:
            gpu_limit = float(prof.gpu_total_bytes)
            gpu_src = f"{prof.gpu_name}, from the profile" if prof.measured else f"{prof.gpu_name}"
        if budget and budget * GiB < gpu_limit:
            gpu_limit, gpu_src = budget * GiB, "memory.gpu_budget_gb"
    ssd_free, stale = None, 0
    if cfg.memory.disk_path:  # the scratch folders of SSD-tier runs that died are removed when the tier opens
        from ..runtime.disk_files import stale_folders

        stale = sum(b for _, b in stale_folders(cfg.memory.disk_path))
        free = sysmem.disk_free(cfg.memory.disk_path)
        ssd_free = None if free is None else free + stale
    keys = frozenset(f"{section}.{k}" for section in ("engine", "train", "data", "memory")
                     for k in type(getattr(cfg, section)).model_fields)
    plan = make_plan(adapter, w, prof, host_available=host_avail, host_source=host_src, gpu_limit=gpu_limit,
                     gpu_limit_source=gpu_src, disk_free=sysmem.disk_free(cfg.output.dir),
                     checkpoint_copies=checkpoint_copies(cfg), config_keys=keys,
                     choose_keys=frozenset(PLACEMENT_KEYS) - set(fixed_placement(cfg)), world=world,
                     disk_path=cfg.memory.disk_path, ssd_free=ssd_free)
    plan.model = f"{adapter.model_type} ({cfg.model.path})"
    slow = prof.cpu_flops / prof.cpu_bf16_flops if device == "cpu" and len(prof.cpu_measured) == 2 else None
    plan.precision_why = precision_line(w.precision, device, slow)
    if stale:
        plan.notes.append(f"memory.disk_path: {stale / GiB:.1f} GiB of SSD-tier files left by runs that did not end "
                          f"count as free: the run removes them at its start")
    if w.device == "cuda" and not torch_cuda_available():
        plan.notes.append("no GPU on this machine: planned for the profile's GPU (train.device=cpu plans a CPU run)")
    return plan


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def target_device(cfg, profile: Profile | None = None) -> str:
    """The device `megatrain plan` plans for: train.device, or with 'auto' the GPU when there is one here or
    the profile describes one (planning for the training machine from elsewhere), else the CPU."""
    choice = cfg.train.device
    if choice != "auto":
        return choice
    if torch_cuda_available():
        return "cuda"
    return "cuda" if profile is not None and profile.measured and profile.gpu_total_bytes else "cpu"


def plan_command(cfg, as_json: bool = False, world: World = World()) -> int:
    """`megatrain plan CONFIG`: print the plan (as_json: its figures as one JSON object); exit status 1, with the
    reason, when the run will not fit. world: `--nnodes`, `--nproc-per-node`."""
    import json
    import sys

    from ..models import get_adapter, load_hf_config
    from .profile import load_profile

    adapter = get_adapter(load_hf_config(cfg.model.path))
    prof = load_profile(cfg.plan.profile)
    device = target_device(cfg, prof)
    if device == "cuda" and torch_cuda_available() or device == "cpu":
        # this machine is the one that trains: plan with what `megatrain train` will measure at its start (the
        # CPU AdamW rate, when no probed profile says it; on a CPU, its rates), so that both plan alike
        prof = run_profile(cfg, device, adapter=adapter)
    plan = plan_for_config(cfg, adapter, device, prof, world)
    print(json.dumps(plan.as_json(), indent=1) if as_json else plan.report())
    if not plan.fits:
        print("megatrain: the run will not fit: " + "; ".join(plan.problems), file=sys.stderr)
        return 1
    return 0


# Parameters of the tile `run_profile` times the CPU AdamW on (~1.1 GiB of host memory for a moment, ~0.5 s for the
# three thread counts).
QUICK_ADAMW_PARAMS = 64 * 2**20


def run_profile(cfg, device: str, adam_params: int = QUICK_ADAMW_PARAMS, agree=None, ranks_per_node: int = 1,
                adapter=None) -> Profile:
    """The profile `megatrain train` plans with: cfg.plan.profile (or the probe's default file); when that is the
    built-in defaults and the run is on a GPU, with this machine's CPU AdamW rate measured now on a small tile:
    the one rate the default profile cannot know (H200 hosts measured 2.96 and 4.55 Gparam/s), and the one that
    sets a step whose forward is shorter than the updates it waits for (one row of 32k tokens on a 7B model).
    It is measured with three quarters and half of the node's cores, and all of them on a node of at most 16
    (probe.adamw_thread_counts), and the node's optimizer uses the fewest threads within 5% of the fastest
    (profile.adamw_threads; a distributed run's ranks split them, as they split the updates: runtime_options).
    agree(name, compute): a distributed run's Distributed.agreed, so that rank 0 measures and every rank plans with
    its numbers (each measuring its own would plan different placements). Rank 0 measures the node as one process,
    while the others wait: the update is bound by the host's memory, which the ranks share, so the node's rate
    is the one-process rate (planner/world.py), and the number of threads that saturates it is the node's.
    On a CPU device (with `adapter`, the run's model): the CPU's fp32 and bf16 rates, measured now on one layer at
    the run's micro-batch shape (with_cpu_rates), unless the profile was probed on another machine."""
    import dataclasses

    import torch

    from .precision import resolve_precision
    from .probe import measure_adamw_threads
    from .profile import load_profile, this_host

    prof = load_profile(cfg.plan.profile)
    if device == "cpu" and adapter is not None and not (prof.measured and prof.host and prof.host != this_host()):
        return with_cpu_rates(prof, adapter, resolve_precision(cfg.train.precision, device),
                              cfg.train.micro_batch_size, cfg.data.max_seq_len, agree)
    if device != "cuda":
        return prof
    if cfg.memory.disk_path and not prof.disk_measured:  # (one process: a distributed run refuses disk_path)
        prof = with_disk_measured(prof, cfg.memory.disk_path)
    if prof.measured:
        return prof
    found = {}
    node_cores = torch.get_num_threads() * ranks_per_node  # a rank's share (Distributed.start) times the ranks

    def measure_threads() -> int:
        threads, rates = measure_adamw_threads(node_cores, adam_params)
        found.update(rate=rates[threads], rates=rates)
        return threads

    if agree is not None:  # rank 0 measures; every rank uses its numbers
        threads = int(agree("adamw_threads", measure_threads))
        rate = agree("adamw_params_per_s", lambda: found["rate"])
    else:
        threads = measure_threads()
        rate = found["rate"]
    tried = f" ({', '.join(f'{t}: {r / 1e9:.2f}' for t, r in found['rates'].items())})" if found else ""
    split = f", {max(1, threads // ranks_per_node)} per rank" if ranks_per_node > 1 else ""
    return dataclasses.replace(prof, adamw_params_per_s=rate, adamw_threads=threads,
                               source=f"defaults, CPU AdamW measured here at start: {rate / 1e9:.2f} Gparam/s "
                                      f"with {threads} threads{split}{tried}")


def with_cpu_rates(prof: Profile, adapter, precision: str, micro: int, seq: int, agree=None) -> Profile:
    """`prof` with this CPU's rate in `precision` measured now (probe.cpu_layer_rates: one layer of the run's model,
    forward and recompute+backward, at `micro` rows of `seq` tokens or fewer; a second at most), and the fp32
    rate besides when bf16 is emulated here (the cost the precision line states): the rate of a CPU step, which no
    default can know (bf16 runs ~10x slower than fp32 without bf16 instructions). agree: a distributed run's
    Distributed.agreed (rank 0 measures). Unchanged when the layer cannot be run."""
    import dataclasses

    from .precision import bf16_support
    from .probe import cpu_layer_rates

    names = ("fp32", "bf16") if precision == "bf16" and not bf16_support("cpu").native else (precision,)
    found = {}

    def measure(key: str) -> float:
        if not found:
            found.update(cpu_layer_rates(adapter, micro, seq, names) or {k: 0.0 for k in names})
        return found[key]

    try:
        rates = {k: agree(f"cpu_{k}_flops", lambda k=k: measure(k)) if agree else measure(k) for k in names}
    except Exception as e:  # the planner must never be the reason a valid run cannot start
        import warnings

        warnings.warn(f"megatrain: the CPU rates could not be measured ({type(e).__name__}: {e}); planning with the "
                      f"profile's")
        return prof
    if not all(rates.values()):  # a layer too large to run for a moment (probe.CPU_LAYER_PARAMS)
        return prof
    shape = found.get("shape", f"{micro}x{seq}")
    return dataclasses.replace(prof, cpu_flops=rates.get("fp32", prof.cpu_flops),
                               cpu_bf16_flops=rates.get("bf16", prof.cpu_bf16_flops), cpu_measured=tuple(rates),
                               source=f"{prof.source}, CPU rate measured here at start on one layer at {shape} "
                                      f"tokens: " + ", ".join(f"{k} {r / 1e9:.1f} GFLOP/s" for k, r in rates.items()))


def with_disk_measured(prof: Profile, disk_path: str, nbytes: int | None = None) -> Profile:
    """`prof` with the read and write rates of the disk under `disk_path` measured now, as the SSD tier moves its
    states (runtime/disk_probe.py: START_BYTES written and read back, 8 requests of 16 MiB in flight, O_DIRECT):
    the one figure that sets an SSD-bound step, and one no default can know (a local NVMe drive, a RAID, a virtual
    disk: 1.2 to 12 GB/s and more)."""
    import dataclasses

    from ..runtime.disk_probe import START_BYTES, describe, measure_disk

    d = measure_disk(disk_path, START_BYTES if nbytes is None else nbytes)
    return dataclasses.replace(prof, disk_read_bps=d["read_bps"], disk_write_bps=d["write_bps"],
                               disk_source=f"measured here at start: {describe(d)}", disk_measured=True)


def check_before_run(cfg, adapter, device: str, world: tuple[int, int] = (1, 1), agree=None) -> Plan | None:
    """`megatrain train`'s check, before any weight is loaded: raises MegatrainError when the run cannot fit.
    Returns the plan (None when it could not be computed: the run goes ahead, with a warning). world: (nodes,
    ranks per node) of a distributed run; agree: its Distributed.agreed (run_profile)."""
    import warnings

    from ..errors import MegatrainError

    try:
        plan = plan_for_config(cfg, adapter, device, profile=run_profile(cfg, device, agree=agree,
                                                                      ranks_per_node=world[1], adapter=adapter),
                               world=World(*world))
    except MegatrainError:
        raise
    except Exception as e:  # the planner must never be the reason a valid run cannot start
        warnings.warn(f"megatrain: the plan could not be computed ({type(e).__name__}: {e}); running unchecked")
        return None
    if not plan.fits and cfg.plan.check:
        raise MegatrainError(refusal(plan))
    return plan
