"""Before the first step: check every input, then build the run (store, runtime, data). Writes nothing.

`check_inputs` reads everything the run will read and refuses what is wrong with one message naming the key,
file and line (config, model directory, tokenizer, data, eval and exact-match files, resume checkpoint, output
and export directories) and what will not fit (the plan); `prepare` then allocates and loads. Nothing is
written to output.dir before both have succeeded.

In a distributed run (`dist`, megatrain/distributed) every rank checks its inputs (local rank 0 first: it fills the
tokenised-data cache the others then read) and none goes on before all have; the host store is allocated in
memory shared by the node's ranks and filled by local rank 0 alone; the plan is the node's; each rank's loader
reads its share of every step.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import data as data_lib
from ..checkpoint import resume as resume_lib
from ..checkpoint.folder_lock import holder
from ..config import Config, check_paths
from ..errors import MegatrainError, load_json, read_text
from ..models import get_adapter, load_hf_config
from ..runtime import (CpuAdamW, EngineOptions, HostStore, Placement, Runtime, RuntimeOptions, build_runtime,
                       store_dtypes)
from ..planner.workload import compiles_layers, fixed_placement, tunes_first
from .oom import host_allocation


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise MegatrainError("train.device: 'cuda' was asked for but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


@dataclass
class Inputs:
    """What `check_inputs` read and validated."""

    device: torch.device
    hf_config: object
    adapter: object
    plan: object  # megatrain.planner.Plan (None: it could not be computed)
    out_dir: Path
    resumed: resume_lib.Resumed | None
    tokenizer: object
    loader: object
    eval_batches: list | None
    exact_match: list | None


@dataclass
class Run:
    cfg: Config
    adapter: object
    runtime: Runtime
    loader: object
    eval_batches: list | None
    exact_match: list | None
    tokenizer: object
    out_dir: Path
    resumed: resume_lib.Resumed | None = None  # the checkpoint this run continues, loaded into the store
    plan: object = None  # megatrain.planner.Plan of this run (None: it could not be computed)
    dist: object = None  # megatrain.distributed.Distributed of a distributed run (None: one process)
    startup_s: dict = field(default_factory=dict)  # seconds of each phase of `prepare` (StartupClock)
    tuned_first: str = ""  # what engine.tune_first compiled and tuned before the store existed ("": it did not)

    @property
    def store(self) -> HostStore:
        return self.runtime.store

    @property
    def engine(self):
        return self.runtime.engine

    @property
    def pipeline(self):
        return self.runtime.pipeline

    @property
    def writes(self) -> bool:
        """This process writes output.dir (rank 0 of a distributed run)."""
        return self.dist is None or self.dist.world.writer

    @property
    def world_size(self) -> int:
        return 1 if self.dist is None else self.dist.world.size

    @property
    def world_info(self) -> dict:
        """The ranks of the run, as checkpoint manifests name them."""
        w = None if self.dist is None else self.dist.world
        return {"world_size": self.world_size, "nodes": w.nodes if w else 1, "ranks_per_node": w.local_size if w else 1}

    def tokens_of(self, data) -> int:
        """Real tokens of the step just trained: every rank's (a PreparedStep holds this rank's)."""
        return data.tokens if self.dist is None else self.engine.world_tokens

    def failing(self, exc: BaseException) -> None:
        """This process is failing: a distributed run's other ranks are told at once (Distributed.publish)."""
        if self.dist is not None:
            self.dist.publish(exc)

    def agree_stop(self, requested: str | None) -> str | None:
        """A stop request (signal name) as every rank agrees on it at this step boundary."""
        return requested if self.dist is None else self.dist.agree_stop(requested)


def check_inputs(cfg: Config, dist=None) -> Inputs:
    """Every check that can fail on the user's input, before any large allocation. Writes nothing."""
    from ..planner.profile import default_profile_path

    # every path of the right kind, the profile parses; output.dir and export.dir not files nor under one
    check_paths(cfg, default_profile=default_profile_path())
    if dist is not None and cfg.memory.disk_path:
        raise MegatrainError("memory.disk_path: the SSD tier is built for one process (a distributed run's ranks "
                             "share one host store and shard its updates, which the tier does not); unset "
                             "memory.disk_path, or run `megatrain train` without torchrun")
    device = dist.device if dist is not None else resolve_device(cfg.train.device)
    if cfg.engine.tune_first == "on" and (dist is not None and dist.world.size > 1 or not compiles_layers(cfg.engine, device.type)):
        raise MegatrainError("engine.tune_first: " + (
            "one process only (each rank would build its own copy of the model); unset it under torchrun"
            if dist is not None and dist.world.size > 1 else f"the layers are not compiled on {device.type} "
            f"(engine.compile: {cfg.engine.compile}): there is nothing to tune; unset it, or set engine.compile: on"))
    hf_config = load_hf_config(cfg.model.path)
    adapter = get_adapter(hf_config)
    if (gen := Path(cfg.model.path) / "generation_config.json").is_file():
        load_json(gen)  # copied into every checkpoint and export unread: it must parse
    if cfg.data.max_seq_len > getattr(hf_config, "max_position_embeddings", cfg.data.max_seq_len):
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's max_position_embeddings "
                             f"({hf_config.max_position_embeddings})")
    from ..planner import check_before_run

    world = (dist.world.nodes, dist.world.local_size) if dist is not None else (1, 1)
    plan = check_before_run(cfg, adapter, device.type, world,  # refuses what cannot fit, before a weight is read
                            agree=dist.agreed if dist is not None else None)
    data_lib.validate_inputs(cfg.data)
    exact = load_exact_match(cfg.train.exact_match_path) if cfg.train.exact_match_path else None
    out_dir = Path(cfg.output.dir)
    if (who := holder(out_dir)) is not None:  # said now, before minutes of loading; trainer takes the lock
        raise MegatrainError(f"output.dir: {out_dir} is in use by another run ({who}); wait for it to end or "
                             f"choose another output.dir")
    resumed = None
    if (resume_path := resume_lib.resolve(cfg.resume, out_dir)) is None:
        resume_lib.check_fresh_start(out_dir, cfg.output.overwrite, cfg.resume)
    else:
        resumed = resume_lib.open_checkpoint(resume_path)
        resume_lib.check_model_config(resumed, hf_config, cfg.model.path)
        resume_lib.check_no_newer(resumed, out_dir)
    if cfg.export.at_end:
        from ..checkpoint.export import check_export_target

        check_export_target(Path(cfg.export.dir or out_dir / "export"), replace_export=True)
    tokenizer = data_lib.load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    if len(tokenizer) > adapter.vocab_size:
        raise MegatrainError(f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"vocab_size is {adapter.vocab_size}")
    loader = data_lib.build_train_loader(cfg.data, tokenizer, seed=cfg.train.seed,
                                         micro_batch_size=cfg.train.micro_batch_size,
                                         grad_accum_steps=cfg.train.grad_accum_steps,
                                         rank=dist.world.rank if dist else 0, world=dist.world.size if dist else 1)
    eval_batches = data_lib.build_eval_batches(cfg.data, tokenizer, micro_batch_size=cfg.train.micro_batch_size)
    if exact and not tokenizer.chat_template:  # (the loader has set data.chat_template on it, when given)
        raise MegatrainError("train.exact_match_path: the prompts are rendered with the tokenizer's chat template, "
                             "but the tokenizer has none; set data.chat_template")
    return Inputs(device, hf_config, adapter, plan, out_dir, resumed, tokenizer, loader, eval_batches, exact)


class StartupClock:
    """Seconds spent in each phase before the first step, in order (the start summary prints them, the first step
    record of metrics.jsonl keeps them): where a large model's minutes of start-up go."""

    def __init__(self, since_process_start: bool = False):
        """since_process_start: the first phase is the process's life before `prepare` (the command line's runs:
        the interpreter, the imports, the config read, a distributed run's process groups)."""
        self._t = time.perf_counter()
        self.phases: dict[str, float] = {}
        if since_process_start:
            import psutil

            self.phases["process start to config read"] = max(0.0, time.time() - psutil.Process().create_time())

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now


def prepare(cfg: Config, dist=None, since_process_start: bool = False) -> Run:
    """Check every input, then allocate and fill the store and build the runtime. Writes nothing.
    dist: the run's megatrain.distributed.Distributed (None: one process). since_process_start: StartupClock's."""
    clock = StartupClock(since_process_start)
    if dist is not None and not dist.world.fills_store:
        dist.node_phase("checked-first")  # local rank 0 checks first: it tokenises the data into the cache
        clock.lap("waiting for the other ranks")
    inp = check_inputs(cfg, dist)
    clock.lap("inputs checked and planned")
    if dist is not None:
        if dist.world.fills_store:
            dist.node_phase("checked-first")
        dist.phase("checked")  # nobody allocates, or writes to output.dir, before every rank has checked
        clock.lap("waiting for the other ranks")
    adapter, plan = inp.adapter, inp.plan
    options = runtime_options(cfg, inp.device, plan, dist.world.local_size if dist is not None else 1)
    stream_dtype, compute_dtype = store_dtypes(cfg.train.precision, options.engine.placement.stream_dtype)
    disk_states = disk_states_of(cfg, plan)
    tuned = ""
    if tunes_first(cfg.engine, inp.device.type, dist is not None and dist.world.size > 1):
        from .tune_first import first_step, tune_first

        step = first_step(inp.loader, inp.resumed.state["loader"] if inp.resumed is not None else None)
        tuned = tune_first(adapter, inp.device, options.engine, cfg.train.precision, step, inp.eval_batches)
        clock.lap("kernels compiled and tuned first (a copy of the model with one layer of each kind)")
    with host_allocation("host store (fp32 master, Adam m and v, streaming copy)", plan, adapter):
        store = HostStore(adapter, stream_dtype, compute_dtype, allocate=dist.memory.allocate if dist else None,
                          disk_path=cfg.memory.disk_path if disk_states else None, disk_states=disk_states)
        if dist is not None:
            dist.make_flags(len(store.tiles))
    clock.lap("store allocated")
    if dist is None or dist.world.fills_store:
        fill_store(cfg, inp, store)
        clock.lap("store filled" + (f" (from {inp.resumed.path.name})" if inp.resumed is not None else
                                    " (random init)" if cfg.model.init == "random" else " (weights read)"))
    if inp.resumed is not None:
        inp.loader.load_state_dict(inp.resumed.state["loader"])
    optimizer = CpuAdamW(cfg.train.betas, cfg.train.eps, cfg.train.weight_decay)
    with host_allocation("pinned buffers (gradient landing buffers, offloaded gradients)", plan, adapter):
        if dist is None:
            runtime = build_runtime(store, inp.device, optimizer, options)
        else:
            from ..distributed import build_distributed_runtime

            dist.store_filled(store)
            clock.lap("waiting for the other ranks")
            runtime = build_distributed_runtime(store, inp.device, optimizer, options, dist)
    clock.lap("runtime built (buffers pinned, slots allocated)")
    return Run(cfg, adapter, runtime, inp.loader, inp.eval_batches, inp.exact_match, inp.tokenizer, inp.out_dir,
               inp.resumed, plan, dist, startup_s=clock.phases, tuned_first=tuned)


def fill_store(cfg: Config, inp: Inputs, store: HostStore) -> None:
    """The store's first state: the checkpoint resumed (instead of the model's weights, not after them: the
    weights are read once), a random init, or the model's weights."""
    if inp.resumed is not None:
        resume_lib.load_store(inp.resumed, store)
    elif cfg.model.init == "random":
        std = cfg.train.init_std or getattr(inp.hf_config, "initializer_range", 0.02)
        store.init_random(cfg.train.seed, std)
    else:
        store.load_safetensors(cfg.model.path)


def disk_states_of(cfg: Config, plan=None) -> tuple[str, ...]:
    """The states the run keeps on the SSD tier: the plan's choice (memory.disk_states when set; without a plan,
    those)."""
    if plan is not None:
        return tuple(plan.workload.disk_states)
    return tuple(k for k in ("v", "m", "master") if k in (cfg.memory.disk_states or ()))


def runtime_options(cfg: Config, device: torch.device, plan=None, ranks_per_node: int = 1) -> RuntimeOptions:
    """The runtime the plan was made for: its placement (without a plan: the memory keys set, defaults for the
    rest), and its optimizer's threads."""
    e = cfg.engine
    compile_layers = compiles_layers(cfg.engine, device.type)
    if plan is not None:
        placement = plan.placement
    else:
        placement = Placement(**fixed_placement(cfg))
    # the optimizer's threads: the node's number its rate was measured with (run_profile, a probed profile), split
    # between the node's ranks, never more than this process has (a rank: its share of the cores, Distributed.start)
    threads = plan.profile.adamw_threads if plan is not None else None
    if threads:
        threads = min(max(1, threads // ranks_per_node), torch.get_num_threads())
    return RuntimeOptions(engine=EngineOptions(loss_chunk_tokens=e.loss_chunk_tokens, num_slots=e.num_slots,
                                               compile_layers=compile_layers, placement=placement),
                          adam_threads=threads)


def load_exact_match(path: str) -> list[tuple[str, str]]:
    """(prompt, expected answer) pairs of an alpaca JSON-lines file; every problem names the file and line."""
    key = "train.exact_match_path"
    p = Path(path).expanduser()
    if not p.exists():
        raise MegatrainError(f"{key}: {p} does not exist")
    if p.is_dir():
        raise MegatrainError(f"{key}: {p} is a directory; expected an alpaca JSON-lines file")
    try:
        text = read_text(p)
    except MegatrainError as e:
        raise MegatrainError(f"{key}: {e}") from None
    pairs = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise MegatrainError(f"{key}: {p}:{n}: malformed JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise MegatrainError(f"{key}: {p}:{n}: expected an alpaca row (an object with instruction, output), "
                                 f"got {type(row).__name__}")
        for col, required in (("instruction", True), ("input", False), ("output", True)):
            v = row.get(col)
            if v is None and required:
                raise MegatrainError(f"{key}: {p}:{n}: missing key '{col}' (an alpaca row has instruction, "
                                     f"output and optionally input)")
            if v is not None and not isinstance(v, str):
                raise MegatrainError(f"{key}: {p}:{n}: '{col}' must be a string, got {type(v).__name__}")
        prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
        pairs.append((prompt, row["output"]))
    if not pairs:
        raise MegatrainError(f"{key}: {p} holds no rows")
    return pairs
