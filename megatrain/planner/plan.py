"""The plan of a run, and the planner's entry points: host RAM, GPU memory, disk and step time, from config.json
and the config alone, before any weight is read, and whether they fit this machine.

    make_plan         the plan of a Workload (workload.py) for a model adapter and a machine profile (estimate.py:
                      the placement, memory, time, the checks against what is available), and when the run does
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

from .estimate import Plan, estimate
from .io_time import io_times, load_bytes
from .objective import plan_objective
from .rollout_plan import plan_rollout
from .precision import precision_line
from .profile import GiB, Profile
from .report import refusal, render
from .suggest import suggestions
from .workload import PLACEMENT_KEYS, Workload, checkpoint_copies, fixed_placement, workload_from_config
from .world import World

__all__ = ["Plan", "World", "Workload", "check_before_run", "make_plan", "plan_command", "plan_for_config",
           "target_device"]


def make_plan(adapter, w: Workload, profile: Profile, *, suggest: bool = True, **limits) -> Plan:
    """The plan of workload `w` (estimate.py; `limits`: the limits, the placement keys to choose and the world, as
    estimate takes them), with what would fit (suggest.py) when it does not fit and `suggest`."""
    plan = estimate(adapter, w, profile, **limits)
    if suggest and not plan.fits:
        plan.suggestions = suggestions(adapter, plan)
    return plan


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
            if prof.measured and not prof.gpu_name:
                gpu_src = f"{prof.source} was probed without a GPU; `megatrain probe` on the GPU's host"
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
    plan_objective(plan, cfg, adapter)  # a preference objective's head pass and reference (objective.py)
    plan_rollout(plan, cfg, adapter)  # grpo's rollout phase (rollout_plan.py)
    file_dtype = None if cfg.model.init == "random" else _file_dtype(adapter.hf_config)
    headroom = None if plan.host_available is None else plan.host_available - plan.host_total
    plan.io = io_times(plan.params, prof.disk_read_bps, prof.disk_write_bps, plan.step_s, cfg.checkpoint.every,
                       file_dtype, prof.disk_source, load_bytes(adapter, file_dtype), headroom, prof.adamw_params_per_s)
    slow = prof.cpu_flops / prof.cpu_bf16_flops if device == "cpu" and len(prof.cpu_measured) == 2 else None
    plan.precision_why = precision_line(w.precision, device, slow)
    if stale:
        plan.notes.append(f"memory.disk_path: {stale / GiB:.1f} GiB of SSD-tier files left by runs that did not end "
                          f"count as free: the run removes them at its start")
    if w.device == "cuda" and not torch_cuda_available():
        plan.notes.append("no GPU on this machine: planned for the profile's GPU (train.device=cpu plans a CPU run)")
    return plan


def _file_dtype(hf_config) -> str:
    """The pretrained files' dtype as config.json states it (bf16 when it does not)."""
    d = getattr(hf_config, "dtype", None) or "bfloat16"
    return str(d).replace("torch.", "")


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

    prof = load_profile(cfg.plan.profile)
    device = target_device(cfg, prof)
    # config.json without transformers where it can be (models/fields.py), unless a CPU layer is run to time it here
    adapter = get_adapter(load_hf_config(cfg.model.path, plan_only=device == "cuda"))
    if device == "cuda" and torch_cuda_available() or device == "cpu":
        # this machine is the one that trains: plan with what `megatrain train` will measure at its start (the
        # CPU AdamW rate, when no probed profile says it; on a CPU, its rates), so that both plan alike
        prof = run_profile(cfg, device, adapter=adapter)
    plan = plan_for_config(cfg, adapter, device, prof, world)
    if cfg.train.objective == "sft":  # `megatrain train` retimes the step once it has read the data (run/prepare.py)
        rows = "packed rows: attention over whole rows" if cfg.data.packing else "rows padded to max_seq_len"
        plan.notes.append(f"step time: {rows} of {cfg.data.max_seq_len:,} tokens, a bound (this command reads no "
                          f"data); `megatrain train` times it again over the data's "
                          f"{'documents' if cfg.data.packing else 'micro-batches'} once it has read them")
    print(json.dumps(plan.as_json(), indent=1) if as_json else render(plan))
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
