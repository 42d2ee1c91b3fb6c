"""Before the first step: check every input, then build the run (store, runtime, data). Writes nothing.

`check_inputs` reads everything the run will read and refuses what is wrong with one message naming the key,
file and line (config, model directory, tokenizer, data, eval and exact-match files, resume checkpoint, output
and export directories) and what will not fit (the plan); `prepare` then allocates and loads. Nothing is
written to output.dir before both have succeeded.

The run's processes (`ranks`: megatrain.distributed.Ranks) are one process (OneProcess), or the ranks of a torchrun
launch (Distributed). In a distributed run every rank checks its inputs (local rank 0 first: it fills the
tokenised-data cache the others then read) and none goes on before all have; the host store is allocated in
memory shared by the node's ranks and filled by local rank 0 alone; the plan is the node's; each rank's loader
reads its share of every step. In a run of one process each of those waits returns at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import data as data_lib
from .bounds import check_run_batch
from ..checkpoint import resume as resume_lib
from ..checkpoint.folder_lock import check_run_files, holder
from ..config import Config, check_paths
from ..data import StepLoader
from ..distributed import OneProcess, Ranks
from ..errors import MegatrainError, load_json
from ..models import ModelAdapter, get_adapter, load_hf_config
from ..runtime import (CpuAdamW, Engine, EngineOptions, HostStore, OptimizerPipeline, Placement, Runtime,
                       RuntimeOptions, store_dtypes)
from ..runtime.layer import expect_first_shape
from ..planner.workload import compiles_layers, fixed_placement, tunes_first
from .oom import host_allocation
from .reference import Reference, check_reference_path, choose_reference
from .reference_weights import check_reference_weights
from .startup import Beside, beside_threads, overlap_fits, overlapped_phases

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from ..planner import Plan


@dataclass
class Inputs:
    """What `check_inputs` read and validated."""

    device: torch.device
    hf_config: PretrainedConfig
    adapter: ModelAdapter
    plan: Plan | None  # None: it could not be computed
    out_dir: Path
    resumed: resume_lib.Resumed | None
    tokenizer: PreTrainedTokenizerBase
    loader: StepLoader
    eval_batches: list | None
    exact_match: list[tuple[str, str]] | None
    reference: Reference = field(default_factory=Reference)


@dataclass
class Run:
    cfg: Config
    adapter: ModelAdapter
    runtime: Runtime
    loader: StepLoader
    eval_batches: list | None
    exact_match: list[tuple[str, str]] | None
    tokenizer: PreTrainedTokenizerBase
    out_dir: Path
    ranks: Ranks  # the run's processes: OneProcess, or this rank of a torchrun launch (megatrain.distributed)
    resumed: resume_lib.Resumed | None = None  # the checkpoint this run continues, loaded into the store
    plan: Plan | None = None  # the plan of this run (None: it could not be computed)
    startup_s: dict = field(default_factory=dict)  # seconds of each phase of `prepare` (StartupClock)
    tuned_first: str = ""  # what engine.tune_first compiled and tuned before the store existed ("": it did not)
    reference: Reference = field(default_factory=Reference)  # a dpo or ipo run's reference log-probs

    @property
    def preference(self) -> bool:
        """The run trains a preference objective on pairs (dpo, ipo, simpo, orpo)."""
        return self.cfg.train.objective not in ("sft", "grpo")

    @property
    def store(self) -> HostStore:
        return self.runtime.store

    @property
    def engine(self) -> Engine:
        return self.runtime.engine

    @property
    def pipeline(self) -> OptimizerPipeline:
        return self.runtime.pipeline

    @property
    def writes(self) -> bool:
        """This process writes output.dir (one process, or rank 0 of several)."""
        return self.ranks.world.writer

    @property
    def world_size(self) -> int:
        return self.ranks.world.size

    @property
    def world_info(self) -> dict:
        """The ranks of the run, as checkpoint manifests name them."""
        w = self.ranks.world
        return {"world_size": w.size, "nodes": w.nodes, "ranks_per_node": w.local_size}

    def tokens_of(self, data) -> int:
        """Real tokens of the step just trained: every rank's (a PreparedStep holds this rank's)."""
        return self.ranks.step_tokens(data.tokens)

    def failing(self, exc: BaseException) -> None:
        """This process is failing: a distributed run's other ranks are told at once (Distributed.publish)."""
        self.ranks.publish(exc)

    def agree_stop(self, requested: str | None) -> str | None:
        """A stop request (signal name) as every rank agrees on it at this step boundary."""
        return self.ranks.agree_stop(requested)


def check_inputs(cfg: Config, ranks: Ranks | None = None) -> Inputs:
    """Every check that can fail on the user's input, before any large allocation. Writes nothing but the data
    cache. ranks: the run's processes (default: one process on train.device); they check at once, the node's other
    ranks waiting only for local rank 0 to tokenise the data; a bad input is reported once, by the first rank to find
    it (Distributed.failed)."""
    from ..planner import check_before_run
    from ..data.sampler import micro_batch_shapes, packed_span
    from ..planner.estimate import retime_packed, retime_unpacked, rows_timing
    from ..planner.precision import resolve_precision
    from ..planner.profile import default_profile_path

    ranks = ranks or OneProcess(cfg.train.device)
    world = ranks.world
    # train.precision auto: resolved once, before anything reads it (the memory checks below too), for the device
    # the run will take (which is itself checked after the paths)
    kind = cfg.train.device if cfg.train.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    cfg.train.precision = resolve_precision(cfg.train.precision, kind)
    # every path of the right kind, the profile parses; output.dir and export.dir not files nor under one
    check_paths(cfg, default_profile=default_profile_path())
    if world.size > 1 and cfg.memory.disk_path:
        raise MegatrainError("memory.disk_path: the SSD tier is built for one process (a distributed run's ranks "
                             "share one host store and shard its updates, which the tier does not); unset "
                             "memory.disk_path, or run `megatrain train` without torchrun")
    device = ranks.device
    check_tune_first(cfg, device, world.size)
    hf_config = load_hf_config(cfg.model.path)
    adapter = get_adapter(hf_config)
    check_run_batch(cfg, adapter.hidden_size, device.type, world.size, world.local_size)  # before it is planned
    check_reference_path(cfg, adapter)
    if (gen := Path(cfg.model.path) / "generation_config.json").is_file():
        load_json(gen)  # copied into every checkpoint and export unread: it must parse
    if cfg.data.max_seq_len > getattr(hf_config, "max_position_embeddings", cfg.data.max_seq_len):
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's max_position_embeddings "
                             f"({hf_config.max_position_embeddings})")
    data_lib.validate_inputs(cfg.data)  # the data's files exist (a missing one named before seconds of planning)
    plan = check_before_run(cfg, adapter, device.type, (world.nodes, world.local_size),  # refuses what cannot fit,
                            agree=ranks.agreed)                                           # before a weight is read
    exact = data_lib.load_exact_match(cfg.train.exact_match_path) if cfg.train.exact_match_path else None
    out_dir = Path(cfg.output.dir)
    if (who := holder(out_dir)) is not None:  # said now, before minutes of loading; trainer takes the lock
        raise MegatrainError(f"output.dir: {out_dir} is in use by another run ({who}); wait for it to end or "
                             f"choose another output.dir")
    if world.writer:  # no file of the run's in output.dir is a link to one elsewhere; checkpoints/ can be written
        check_run_files(out_dir)
    resumed = None
    if (resume_path := resume_lib.resolve(cfg.resume, out_dir)) is None:
        resume_lib.check_fresh_start(out_dir, cfg.output.overwrite, cfg.resume)
    else:
        resume_lib.check_resume_target(out_dir, resume_path, cfg.output.overwrite)
        resumed = resume_lib.open_checkpoint(resume_path)
        resume_lib.check_run_state(resumed)
        resume_lib.check_objective(resumed, cfg.train.objective)
        resume_lib.check_model_config(resumed, hf_config, cfg.model.path)
        resume_lib.check_no_newer(resumed, out_dir)
    if cfg.export.at_end:
        from ..checkpoint.export import check_export_target

        check_export_target(Path(cfg.export.dir or out_dir / "export"), out_dir / "checkpoints")
    tokenizer = data_lib.load_tokenizer(cfg.model.tokenizer or cfg.model.path,
                                        "model.tokenizer" if cfg.model.tokenizer else "model.path")
    if len(tokenizer) > adapter.vocab_size:
        raise MegatrainError(f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"vocab_size is {adapter.vocab_size}")
    grpo = cfg.train.objective == "grpo"
    pairs = cfg.train.objective not in ("sft", "grpo")  # (config.objective_problems: then the data is pairs)
    if not world.fills_store:  # the node's other ranks read the data from the cache local rank 0 tokenises into:
        ranks.node_phase("data-cached")  # everything above ran on every rank at once
    if grpo:  # prompts and rewards (run/grpo.py): every reward imported and every prompt read before a write
        from .grpo import check_world, rollouts

        check_world(world.size)
        loader, eval_batches = rollouts(cfg, tokenizer), None
    else:
        build_loader, build_eval = ((data_lib.build_pair_loader, data_lib.build_pair_eval_batches) if pairs else
                                    (data_lib.build_train_loader, data_lib.build_eval_batches))
        loader = build_loader(cfg.data, tokenizer, seed=cfg.train.seed,
                              micro_batch_size=cfg.train.micro_batch_size, grad_accum_steps=cfg.train.grad_accum_steps,
                              rank=world.rank, world=world.size)
        eval_batches = build_eval(cfg.data, tokenizer, micro_batch_size=cfg.train.micro_batch_size)
    if world.fills_store:
        ranks.node_phase("data-cached")
    if plan is not None and not grpo and not pairs:  # the rows this run trains are known now
        trained = trained_rows(cfg, loader.sampler.plan, world.size, resumed)
        if cfg.data.packing:  # attention timed over their documents and padding pieces
            retime_packed(plan, adapter, packed_span(trained, loader.examples.lengths, cfg.data.max_seq_len))
        else:  # each micro-batch padded to its longest row
            rows, padded, _ = micro_batch_shapes(trained, loader.examples.lengths)
            retime_unpacked(plan, adapter, *rows_timing(rows, padded))
    reference = choose_reference(cfg, plan, adapter, loader, tokenizer, eval_batches, resumed) if pairs else \
        Reference()
    if (folder := reference_folder(cfg, reference)) is not None:  # a resume streams the files it started from
        reference.weight_files = check_reference_weights(folder, resumed)
    if exact and not tokenizer.chat_template:  # (the loader has set data.chat_template on it, when given)
        raise MegatrainError("train.exact_match_path: the prompts are rendered with the tokenizer's chat template, "
                             "but the tokenizer has none; set data.chat_template")
    return Inputs(device, hf_config, adapter, plan, out_dir, resumed, tokenizer, loader, eval_batches, exact,
                  reference)


def trained_rows(cfg: Config, epoch_plan, world: int, resumed) -> list:
    """The micro-batches of the epoch's plan that this run trains (data.sampler.run_part): train.steps less the
    steps resumed, grad_accum_steps micro-batches a step on each rank, from the sampler's cursor (a resumed later
    epoch's plan is drawn alike: the whole of this one stands for it)."""
    from ..data.sampler import run_part

    done = resumed.step if resumed else 0
    state = resumed.state.get("loader", {}) if resumed else {}
    if state.get("epoch", 0):
        return epoch_plan
    return run_part(epoch_plan, int(state.get("cursor", 0)),
                    max(cfg.train.steps - done, 1) * cfg.train.grad_accum_steps * world)


def check_tune_first(cfg: Config, device: torch.device, ranks: int) -> None:
    """engine.tune_first: on needs one process and compiled layers."""
    if cfg.engine.tune_first != "on":
        return
    if ranks > 1:
        raise MegatrainError("engine.tune_first: one process only (each rank would build its own copy of the model); "
                             "unset it under torchrun")
    if not compiles_layers(cfg.engine, device.type):
        raise MegatrainError(f"engine.tune_first: the layers are not compiled on {device.type} (engine.compile: "
                             f"{cfg.engine.compile}): there is nothing to tune; unset it, or set engine.compile: on")


class StartupClock:
    """Seconds spent in each phase before the first step, in order (the start summary prints them, the first step
    record of metrics.jsonl keeps them): where a large model's minutes of start-up go."""

    def __init__(self, since_process_start: bool = False, ranks: int = 1, config_read_at: float | None = None):
        """since_process_start: the first phases are the process's life before `prepare` (the command line's runs):
        from its start to the config read and checked (config_read_at, time.time(); the interpreter, the config's
        own modules), then the imports (torch, transformers, the run's modules) and a distributed run's process
        groups. ranks: the run's processes (one waits for nobody)."""
        self._t = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.ranks = ranks
        if since_process_start:
            import psutil

            now, born = time.time(), psutil.Process().create_time()
            read = now if config_read_at is None else min(now, max(born, config_read_at))
            self.phases["process start to config read"] = max(0.0, read - born)
            if config_read_at is not None:
                self.phases["imports (torch, transformers)" + (" and process groups" if ranks > 1 else "")] = \
                    now - read

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._t
        self._t = now

    def overlapped(self, phases: dict[str, float]) -> None:
        """Phases that ran at once (run/startup.py's overlapped_phases: each one's seconds, and their wall time);
        the next lap starts now."""
        self.phases.update(phases)
        self._t = time.perf_counter()

    def waited(self) -> None:
        """After waiting for the other ranks (a run of one process has none: no phase)."""
        if self.ranks > 1:
            self.lap("waiting for the other ranks")


def prepare(cfg: Config, ranks: Ranks | None = None, since_process_start: bool = False,
            config_read_at: float | None = None) -> Run:
    """Check every input, then allocate and fill the store and build the runtime. Writes nothing.
    ranks: the run's processes (default: one process on train.device). since_process_start, config_read_at:
    StartupClock's."""
    ranks = ranks or OneProcess(cfg.train.device)
    world = ranks.world
    clock = StartupClock(since_process_start, world.size, config_read_at)
    inp = check_inputs(cfg, ranks)
    clock.lap("inputs checked and planned")
    ranks.phase("checked")  # nobody allocates, or writes to output.dir, before every rank has checked
    clock.waited()

    adapter, plan = inp.adapter, inp.plan
    options = runtime_options(cfg, inp.device, plan, world.local_size)
    stream_dtype, compute_dtype = store_dtypes(cfg.train.precision, options.engine.placement.stream_dtype)
    disk_states = disk_states_of(cfg, plan)
    tuned = ""
    tuning = tunes_first(cfg.engine, inp.device.type, world.size > 1) and cfg.train.objective != "grpo"  # (a grpo
    #                                                        step's rows come from a rollout: none before)

    def build_store(lap, threads: int | None = None) -> HostStore:
        with host_allocation("host store (fp32 master, Adam m and v, streaming copy)", plan, adapter):
            store = HostStore(adapter, stream_dtype, compute_dtype, allocate=ranks.allocate,
                              disk_path=cfg.memory.disk_path if disk_states else None, disk_states=disk_states)
            ranks.make_flags(len(store.tiles))
        lap("store allocated")
        if world.fills_store:
            fill_store(cfg, inp, store, threads)
            io = getattr(store, "load_stats", None) or {}  # bytes and seconds of a read (checkpoint or weights)
            rate = f" {io['bytes'] / 1e9:.1f} GB at {io['bytes'] / max(io['seconds'], 1e-9) / 1e9:.2f} GB/s" if io \
                else ""
            lap("store filled" + (f" (from {inp.resumed.path.name}{rate})" if inp.resumed is not None else
                                  " (random init)" if cfg.model.init == "random" else f" (weights read{rate})"))
            if fill_reference(cfg, inp, store):
                lap(f"reference copy filled ({str(store.compute_dtype).replace('torch.', '')})")
        return store

    tune_phase = "kernels compiled and tuned first (a copy of the model with one layer of each kind)"
    step = None  # compiled layers: the first training step, whose first micro-batch's shape gets the static graphs
    if tuning or options.engine.compile_layers and cfg.train.objective != "grpo":
        from .tune_first import first_step, tune_first

        step = first_step(inp.loader, inp.resumed.state["loader"] if inp.resumed is not None else None)
    if tuning and overlap_fits(plan, adapter):  # the store allocated and filled on a thread meanwhile (run/startup.py)
        t0 = time.perf_counter()
        beside = Beside(lambda lap: build_store(lap, beside_threads()))
        try:
            tuned = tune_first(adapter, inp.device, options.engine, cfg.train.precision, step, inp.eval_batches,
                               inp.resumed is not None)
            t_tuned = time.perf_counter() - t0
        except BaseException:
            beside.wait_quietly()  # (a signal or a failure: the store is dropped; nothing was written)
            raise
        store = beside.result()
        clock.overlapped(overlapped_phases((tune_phase, t_tuned), beside.laps, time.perf_counter() - t0))
    else:
        if tuning:
            tuned = tune_first(adapter, inp.device, options.engine, cfg.train.precision, step, inp.eval_batches,
                               inp.resumed is not None)
            clock.lap(tune_phase)
        store = build_store(clock.lap)
    if inp.resumed is not None:
        inp.loader.load_state_dict(inp.resumed.state["loader"])

    optimizer = CpuAdamW(cfg.train.betas, cfg.train.eps, cfg.train.weight_decay,
                         plan.profile.adamw_chunks_per_call if plan is not None else 1)
    with host_allocation("pinned buffers (gradient landing buffers, offloaded gradients)", plan, adapter):
        ranks.store_filled(store)  # the node's ranks take the store local rank 0 filled
        clock.waited()
        runtime = ranks.build_runtime(store, optimizer, options)
    if step:  # (the step-0 evaluation, run first, may have other rows)
        expect_first_shape(runtime.engine.layer, *step[0].input_ids.shape)
    clock.lap("runtime built (buffers pinned, slots allocated)")
    return Run(cfg, adapter, runtime, inp.loader, inp.eval_batches, inp.exact_match, inp.tokenizer, inp.out_dir,
               ranks, inp.resumed, plan, startup_s=clock.phases, tuned_first=tuned, reference=inp.reference)


def fill_store(cfg: Config, inp: Inputs, store: HostStore, threads: int | None = None) -> None:
    """The store's first state: the checkpoint resumed (instead of the model's weights, not after them: the
    weights are read once), a random init, or the model's weights. threads: a random init's (default all cores)."""
    if inp.resumed is not None:
        if (inp.reference.strategy == "stream" and not cfg.preference.reference_path or grpo_reference(cfg)) and \
                cfg.model.init == "random":
            store.init_random(cfg.train.seed, cfg.train.init_std or getattr(inp.hf_config, "initializer_range", 0.02),
                              threads)
            store.freeze_reference()  # the step-0 weights of the reference copy (fill_reference)
        store.load_stats = resume_lib.load_store(inp.resumed, store)
    elif cfg.model.init == "random":
        std = cfg.train.init_std or getattr(inp.hf_config, "initializer_range", 0.02)
        store.init_random(cfg.train.seed, std, threads)
    else:
        store.load_safetensors(cfg.model.path)


def fill_reference(cfg: Config, inp: Inputs, store: HostStore) -> bool:
    """The store's frozen reference copy (HostStore.freeze_reference, load_reference), when the run streams one or
    scores another model: preference.reference_path's weights, else the step-0 policy's. A resumed run's store
    holds a later step's weights, so the step-0 ones come again from their source: model.path's files, or (random
    init) the same seeded init, frozen before the checkpoint is loaded over it (fill_store). Returns whether one
    was filled."""
    ref = inp.reference
    if not (ref.strategy == "stream" or ref.strategy == "precompute" and cfg.preference.reference_path
            or grpo_reference(cfg)):
        return False
    if cfg.preference.reference_path and not grpo_reference(cfg):
        store.load_reference(cfg.preference.reference_path)
    elif inp.resumed is None:
        store.freeze_reference()  # the store holds the step-0 weights
    elif cfg.model.init != "random":  # (random: fill_store froze the seeded init before loading the checkpoint)
        store.load_reference(cfg.model.path)
    ref.frozen = True
    return True


def reference_folder(cfg: Config, ref) -> Path | None:
    """The folder whose weight files fill_reference loads a frozen reference copy from on a resume; None where there
    is none: no copy, the seeded random init (rebuilt from the seed), or a table that holds the log-probs."""
    if grpo_reference(cfg):
        return None if cfg.model.init == "random" else Path(cfg.model.path)
    if ref.strategy != "stream":
        return None
    if cfg.preference.reference_path:
        return Path(cfg.preference.reference_path)
    return None if cfg.model.init == "random" else Path(cfg.model.path)


def grpo_reference(cfg: Config) -> bool:
    """A grpo run with a KL term (grpo.beta > 0): the step-0 policy's frozen copy in the store is its reference."""
    return cfg.train.objective == "grpo" and cfg.grpo.beta > 0


def disk_states_of(cfg: Config, plan: Plan | None = None) -> tuple[str, ...]:
    """The states the run keeps on the SSD tier: the plan's choice (memory.disk_states when set; without a plan,
    those)."""
    if plan is not None:
        return tuple(plan.workload.disk_states)
    return tuple(k for k in ("v", "m", "master") if k in (cfg.memory.disk_states or ()))


def runtime_options(cfg: Config, device: torch.device, plan: Plan | None = None, ranks_per_node: int = 1) \
        -> RuntimeOptions:
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
                                               compile_layers=compile_layers, placement=placement,
                                               objective=objective_of(cfg)),
                          adam_threads=threads)


def objective_of(cfg: Config):
    """The engine's objective: train.objective with its preference or grpo settings."""
    from ..runtime.objective import Objective

    if cfg.train.objective == "grpo":
        return Objective.from_config(cfg.train, cfg.preference, cfg.grpo)
    return Objective.from_config(cfg.train, cfg.preference)
