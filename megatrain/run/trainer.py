"""The run: validate every input, then wire store, engine, optimizer, data and metrics; the step loop.

Nothing is written to output.dir until the model directory, the data and the tokenizer have been checked.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import data as data_lib
from ..checkpoint import CheckpointSaver, StopOnSignal
from ..checkpoint import resume as resume_lib
from ..checkpoint.state import model_files_writer, restore_rng, run_state
from ..config import Config
from ..runtime.engine import Engine, MicroBatch
from ..errors import MegatrainError
from ..planner.flops import flops_per_token
from .metrics import MetricsLogger
from ..models import get_adapter, load_hf_config
from ..runtime.optimizer_pipeline import OptimizerPipeline
from ..runtime.adamw import CpuAdamW, clip_coefficient, lr_at
from ..runtime.store import HostStore


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise MegatrainError("train.device: 'cuda' was asked for but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


@dataclass
class Run:
    cfg: Config
    adapter: object
    store: HostStore
    engine: Engine
    pipeline: OptimizerPipeline
    loader: object
    eval_batches: list | None
    exact_match: list | None
    tokenizer: object
    out_dir: Path
    resumed: resume_lib.Resumed | None = None  # the checkpoint this run continues, loaded into the store
    plan: object = None  # megatrain.planner.plan.Plan of this run (None: it could not be computed)
    stats: object = None  # megatrain.run.stepstats.StepStats, set when the run starts


def to_microbatches(batches) -> list[MicroBatch]:
    return [MicroBatch.from_labels(b["input_ids"], b["labels"], b.get("position_ids")) for b in batches]


def real_tokens(batches) -> int:
    return sum(int(b["num_real_tokens"]) if "num_real_tokens" in b else b["input_ids"].numel() for b in batches)


def prepare(cfg: Config) -> Run:
    """Every check that can fail on the user's input, then the allocations. Writes nothing."""
    device = resolve_device(cfg.train.device)
    hf_config = load_hf_config(cfg.model.path)
    adapter = get_adapter(hf_config)
    if cfg.data.max_seq_len > getattr(hf_config, "max_position_embeddings", cfg.data.max_seq_len):
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's max_position_embeddings "
                             f"({hf_config.max_position_embeddings})")
    if adapter.sliding_window and cfg.data.max_seq_len > adapter.sliding_window:
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's sliding_window "
                             f"({adapter.sliding_window}), which megatrain does not implement; use at most that")
    from ..planner.plan import check_before_run

    plan = check_before_run(cfg, adapter, device.type)  # refuses a run that cannot fit, before any weight is read
    data_lib.validate_inputs(cfg.data)
    out_dir = Path(cfg.output.dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not cfg.output.overwrite and not cfg.resume:
        raise MegatrainError(f"output.dir: {out_dir} is not empty; choose another, set output.overwrite=true, "
                             f"or resume=auto to continue its run")
    resumed = None
    if (resume_path := resume_lib.resolve(cfg.resume, out_dir)) is not None:
        resumed = resume_lib.open_checkpoint(resume_path)
        resume_lib.check_model_config(resumed, hf_config, cfg.model.path)
        resume_lib.check_no_newer(resumed, out_dir)
    if cfg.export.at_end:
        from ..checkpoint.export import check_export_target

        check_export_target(Path(cfg.export.dir or out_dir / "export"), replace_export=True)
    tokenizer = _load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    if len(tokenizer) > adapter.vocab_size:
        raise MegatrainError(f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"vocab_size is {adapter.vocab_size}")
    loader = data_lib.build_train_loader(cfg.data, tokenizer, seed=cfg.train.seed,
                                         micro_batch_size=cfg.train.micro_batch_size,
                                         grad_accum_steps=cfg.train.grad_accum_steps)
    eval_batches = data_lib.build_eval_batches(cfg.data, tokenizer, micro_batch_size=cfg.train.micro_batch_size)
    exact = _load_exact_match(cfg.train.exact_match_path) if cfg.train.exact_match_path else None

    stream_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    try:
        store = HostStore(adapter, stream_dtype)
    except (RuntimeError, MemoryError) as e:
        _raise_if_out_of_memory(e, run=None, plan=plan, adapter=adapter, step=None)
        raise
    if resumed is not None:  # instead of the model's weights, not after them: the weights are read once
        resume_lib.load_store(resumed, store)
        loader.load_state_dict(resumed.state["loader"])
    elif cfg.model.init == "random":
        std = cfg.train.init_std or getattr(hf_config, "initializer_range", 0.02)
        store.init_random(cfg.train.seed, std)
    else:
        store.load_safetensors(cfg.model.path)
    if device.type == "cuda":
        store.pin()
    compile_layers = cfg.engine.compile == "on" or (cfg.engine.compile == "auto" and device.type == "cuda")
    engine = Engine(store, adapter, device, cfg.engine.loss_chunk_tokens, cfg.engine.num_slots, compile_layers,
                    spill_layers=cfg.engine.spill_layers)
    optimizer = CpuAdamW(betas=cfg.train.betas, eps=cfg.train.eps, weight_decay=cfg.train.weight_decay)
    pipeline = OptimizerPipeline(store, optimizer, device, offload_units=cfg.engine.offload_grad_units)
    engine.wait_for_update = pipeline.wait_for_update
    return Run(cfg, adapter, store, engine, pipeline, loader, eval_batches, exact, tokenizer, out_dir, resumed,
               plan=plan)


def _load_tokenizer(path: str):
    loader = getattr(data_lib, "load_tokenizer", None)  # the data pipeline's, once it has one
    if loader is not None:
        return loader(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise MegatrainError(f"model.tokenizer: no usable tokenizer in {path} ({e})") from None


def _load_exact_match(path: str) -> list[tuple[str, str]]:
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
            pairs.append((prompt, row["output"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MegatrainError(f"train.exact_match_path: {path}:{n}: expected an alpaca row ({e})") from None
    return pairs


def _raise_if_out_of_memory(e: BaseException, *, run, plan, adapter, step) -> None:
    """A GPU out-of-memory error or a failed host allocation becomes one message naming the component and
    what the plan suggests (instead of a wall of traceback); anything else is left alone."""
    from .stepstats import is_host_allocation_failure, oom_message

    if isinstance(e, torch.OutOfMemoryError):
        raise MegatrainError(oom_message(e, plan, adapter, step)) from None
    if is_host_allocation_failure(e):
        raise MegatrainError(oom_message(e, plan, adapter, step, host=True)) from None


def train_step(run: Run, step: int, batches) -> tuple[float, float, float]:
    """One optimizer step: the engine's waves, then the CPU update handed to the pipeline, which overlaps it
    with the next step's forward. Returns (loss, grad norm, lr)."""
    t = run.cfg.train
    if run.stats is not None:
        run.stats.begin()
    try:
        out = run.engine.train_step(to_microbatches(batches), run.pipeline)
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        _raise_if_out_of_memory(e, run=run, plan=run.plan, adapter=run.adapter, step=step + 1)
        raise
    if run.stats is not None:
        run.stats.end()  # the step's GPU work is queued: the end marker follows it
    grad_norm = math.sqrt(out.grad_sq_norm.item())  # the step's GPU work is all queued: this wait costs nothing
    loss = out.loss_sum.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise MegatrainError(f"step {step + 1}: loss {loss}, grad norm {grad_norm}; the update was not applied. "
                             f"Lower train.lr or check the data.")
    lr = lr_at(step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, schedule=t.lr_schedule,
               min_lr_ratio=t.min_lr_ratio)
    run.pipeline.finish_step(lr=lr, clip_coef=clip_coefficient(grad_norm, t.max_grad_norm))
    return loss, grad_norm, lr


def evaluate(run: Run, step: int, log: MetricsLogger) -> dict:
    record = {"step": step}
    if run.eval_batches:
        total, count = 0.0, 0
        for b in run.eval_batches:
            loss, n = run.engine.eval_loss(to_microbatches([b]))
            total, count = total + loss * n, count + n
        record["eval_loss"] = total / max(count, 1)
    if run.exact_match:
        from .evaluate import exact_match

        record["eval_exact_match"] = exact_match(run.engine, run.tokenizer, run.exact_match)
    if len(record) > 1:
        log.log(record)
    return record


def train(cfg: Config) -> dict:
    run = prepare(cfg)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    t = cfg.train
    start = run.resumed.step if run.resumed else 0
    resume_lib.trim_metrics(run.out_dir, start if run.resumed else -1)  # continue without duplicate steps
    log = MetricsLogger(run.out_dir, t.steps, start_step=start, tensorboard=cfg.output.tensorboard)
    n_params = run.store.num_params
    fpt6, fpt_attn = flops_per_token(run.adapter, cfg.data.max_seq_len)
    log.info(f"megatrain: {run.adapter.model_type} {n_params / 1e6:.2f}M params, {run.adapter.num_layers} layers, "
             f"{cfg.train.precision} on {run.engine.device}; host store {run.store.host_bytes() / 2**30:.2f} GiB; "
             f"data: {run.loader.summary()}")
    from .stepstats import attach

    attach(run, log)  # the plan's figures in the start summary; per-step throughput, memory, stream shares
    saver = CheckpointSaver(run.out_dir / "checkpoints", run.store, run.pipeline, keep=cfg.checkpoint.keep)
    if run.resumed:
        notes = resume_lib.config_notes(run.resumed, cfg.model_dump())
        log.info(f"resuming from {run.resumed.path} (step {start})" + "".join(f"\n  changed: {n}" for n in notes))
        restore_rng(run.resumed.state["rng"])
        summary = dict(run.resumed.state.get("summary", {}))
    else:
        if cfg.resume == "auto":
            log.info(f"resume=auto: no checkpoint in {run.out_dir / 'checkpoints'} yet; starting from step 0")
        if removed := saver.clear():  # an earlier run's checkpoints (output.overwrite): resume=auto must not pick them
            log.info(f"removed {removed} checkpoint(s) of an earlier run from {saver.root}")
        summary = {"first_eval": evaluate(run, 0, log)}
    losses, lr = [], None
    every = cfg.checkpoint.every
    try:
        with StopOnSignal() as stop:
            for step in range(start, t.steps):
                t0 = time.perf_counter()
                batches = run.loader.next_step()
                loss, grad_norm, lr = train_step(run, step, batches)
                dt = time.perf_counter() - t0
                tokens = real_tokens(batches)
                losses.append(loss)
                summary.setdefault("first_loss", loss)
                done = step + 1
                log.log({"step": done, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                         "tokens_per_s": tokens / dt, "step_time_s": dt,
                         "tflops_6n": fpt6 * tokens / dt / 1e12, "tflops_attn": fpt_attn * tokens / dt / 1e12})
                if t.eval_every and done % t.eval_every == 0 and done < t.steps:
                    evaluate(run, done, log)
                at_end = done == t.steps and (cfg.checkpoint.at_end or cfg.export.at_end)
                if stop.requested or (every and done % every == 0) or at_end:
                    save_checkpoint(run, saver, done, lr, summary)  # in the background: the next step starts now
                if stop.requested:
                    path = saver.wait()
                    log.info(f"stopped by {stop.requested} after step {done}: checkpoint saved to {path}; "
                             f"continue with resume=auto")
                    summary.update(stopped_at=done, checkpoint=str(path))
                    return summary
            if start < t.steps:
                summary["last_eval"] = evaluate(run, t.steps, log)  # overlaps the final save
            if (final := saver.wait()) is not None:
                log.info(f"checkpoint: {final} (saved in {saver.last_seconds:.1f}s)")
                summary["checkpoint"] = str(final)
            final = final or (run.resumed.path if run.resumed else None)
            run.pipeline.drain()
            if cfg.export.at_end:
                from ..checkpoint.export import export_checkpoint

                res = export_checkpoint(final, cfg.export.dir or run.out_dir / "export", dtype=cfg.export.dtype,
                                        max_shard_mb=cfg.export.max_shard_mb, replace_export=True)
                log.info(f"exported a Hugging Face model to {res['path']} ({res['seconds']:.1f}s)")
                summary["export"] = str(res["path"])
    except KeyboardInterrupt:
        saver.abandon()  # a second signal: leave at once; the partial save never becomes a checkpoint
        raise
    finally:
        try:
            saver.wait()  # when training failed, a save in progress still completes: it is a good step's state
        except MegatrainError as e:
            log.info(str(e))
        run.pipeline.close()
        log.close()
        run.store.unpin()
    if losses:
        summary["last_loss"] = losses[-1]
        log.info(f"done: loss {summary['first_loss']:.4f} -> {losses[-1]:.4f}; metrics in "
                 f"{run.out_dir / 'metrics.jsonl'}")
    else:
        log.info(f"nothing to train: {run.resumed.path} is at step {start}, train.steps is {t.steps}")
    return summary


def save_checkpoint(run: Run, saver: CheckpointSaver, step: int, lr: float | None, summary: dict) -> None:
    """Start saving step `step` (the loop is at that step boundary): the store in the background, the run state
    (data position, RNG, schedule) captured now."""
    kept = {k: summary[k] for k in ("first_eval", "first_loss") if k in summary}
    state = run_state(step=step, lr=lr, config=run.cfg.model_dump(), loader_state=run.loader.state_dict(),
                      summary=kept)
    saver.save(step, state, model_files_writer(run.cfg.model.path, run.tokenizer))
