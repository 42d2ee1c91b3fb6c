"""The run: check every input and build the runtime (prepare.py), then the step loop.

    train(cfg)   start -> for each step: train_step, evaluate when due, the saver's turn, stop on a signal
                 -> finish (last evaluation, final checkpoint, export)
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.signals import Stopped, StopOnSignal
from ..checkpoint import resume as resume_lib
from ..checkpoint.folder_lock import FolderLock, check_run_files, write_own
from ..checkpoint.state import model_files_writer, restore_rng, run_state
from ..config import Config
from ..errors import MegatrainError
from ..runtime.adamw import clip_coefficient, lr_at
from ..runtime.pinned import release_torch_pinned_cache
from ..runtime.router_loss import expert_load
from .collector import StepCollector
from .evaluate import evaluate
from .grpo import grpo_fields, step_split
from .metrics import MetricsLogger, eval_logged, optimizer_fields, preference_fields
from .oom import raise_if_out_of_memory
from .plancheck import PlanCheck
from .prefetch import PreparedStep, StepPrefetcher
from .prepare import Run, prepare
from .roles import open_log, open_saver
from .stepstats import StepStats, attach

if TYPE_CHECKING:
    from ..checkpoint.saver import CheckpointSaver
    from ..distributed import Ranks


def train(cfg: Config, ranks: Ranks | None = None, since_process_start: bool = False,
          config_read_at: float | None = None) -> dict:
    """ranks: the run's processes (run/launch.py; default: one process). since_process_start: the start-up's timing
    begins at the process's start (the command line; config_read_at: when it had read the config). SIGTERM and
    SIGINT stop it cleanly in every phase (checkpoint/signals.py): each stop is said on one line."""
    with StopOnSignal() as stop:
        try:
            with stop.interruptible("start-up"):
                # every input checked, the store filled, the runtime built: nothing written yet
                run = prepare(cfg, ranks, since_process_start, config_read_at)
        except Stopped as e:
            print(f"megatrain: stopped by {e.name} during start-up, before anything was written", file=sys.stderr)
            return {"stopped_at": 0, "stopped_during": "start-up", "stopped_by": e.name}
        return _train(run, stop)


def _train(run: Run, stop: StopOnSignal) -> dict:
    cfg = run.cfg
    lock = None
    try:
        # the model's config files as they are now, before anything is written: every checkpoint records these
        # bytes, whatever happens to model.path during the run
        model_files = model_files_writer(cfg.model.path, run.tokenizer)
        if run.writes:  # the run's first write: output.dir's lock, held until the run ends (two runs on one
            #            folder would replace each other's checkpoints and metrics); first, no file of the run's
            #            is a link to a file elsewhere and checkpoints/ can be written
            check_run_files(run.out_dir)
            lock = FolderLock(run.out_dir, "output.dir").acquire()
        s = start(run, model_files, stop)
    except Stopped as e:  # during the reference pass (run/reference.py): what it scored is kept for the next run
        if lock is not None:
            lock.release()
        run.runtime.close()
        print(f"megatrain: stopped by {e.name} during {e.phase}, before step 1; its scored pairs are kept: "
              f"resume=auto goes on from them", file=sys.stderr)
        return {"stopped_at": 0, "stopped_during": e.phase}
    except BaseException as e:
        if lock is not None:
            lock.release()
        run.runtime.close()
        if stop.forced or isinstance(e, KeyboardInterrupt):
            raise KeyboardInterrupt(f"stopped at once by a second {stop.requested or 'signal'} during start-up; "
                                    f"no step was trained") from None
        raise
    collector = StepCollector()  # Python's cyclic garbage collected between steps, never inside one
    gc_start = collector.before_first_step()  # start-up's objects: walked now, not behind step 1's updates
    if run.startup_s:
        run.startup_s["garbage collected and frozen before step 1"] = gc_start
    try:
        if requested := run.agree_stop(stop.requested):  # during the step-0 evaluation: nothing to save
            return stopped(s, s.first_step, requested)
        for step in range(s.first_step, cfg.train.steps):
            record = train_step(run, step, s.data.next(), s.stats)
            record["gc_s"] = collector.between_steps()
            if step == s.first_step and run.startup_s:  # this process's start-up, with its first step
                record["startup_s"] = run.startup_s
            s.log.log(record)
            s.summary.setdefault("first_loss", record["loss"])
            s.summary["last_loss"] = record["loss"]
            done = step + 1
            if cfg.train.eval_every and done % cfg.train.eval_every == 0 and done < cfg.train.steps:
                evaluate(run, done, s.log, stop)
            requested = run.agree_stop(stop.requested)  # distributed: any rank's signal stops every rank
            s.saver.step_done(done, lambda: state_at(run, s, done, record["lr"]), s.model_files,
                              stopping=requested is not None)
            if requested:
                return stopped(s, done, requested)
        return finish(run, s, stop)
    except BaseException as e:
        run.failing(e)  # distributed: the other ranks stop now, not after this one's cleanup
        if isinstance(e, KeyboardInterrupt) or stop.forced:  # a second signal, whatever it interrupted
            s.saver.abandon()  # leave at once; the partial save never becomes a checkpoint
            last = s.saver.last or (run.resumed.path if run.resumed else None)
            raise KeyboardInterrupt(f"stopped at once by a second {stop.requested or 'signal'}: a save in progress "
                                    f"was abandoned; " + (f"the last checkpoint, {last}, stays (resume=auto "
                                                          f"continues from it)" if last else "no checkpoint yet")) \
                from None
        raise
    finally:
        collector.close()
        try:
            close(run, s, quiet=stop.forced)
        finally:
            if lock is not None:
                lock.release()


@dataclass
class Session:
    """What the loop carries between steps."""

    first_step: int
    log: MetricsLogger
    stats: StepStats
    saver: CheckpointSaver
    data: StepPrefetcher
    model_files: Callable[[Path], None]  # writes config.json, tokenizer files into a checkpoint
    summary: dict = field(default_factory=dict)


def start(run: Run, model_files: Callable[[Path], None], stop: StopOnSignal | None = None) -> Session:
    """Open output.dir (the run's files, after its lock), the metrics and the saver; resume, or evaluate step 0 (cut
    short by a signal: see evaluate). model_files: checkpoint/state.model_files_writer's, made before the lock."""
    cfg, t = run.cfg, run.cfg.train
    first = run.resumed.step if run.resumed else 0
    if run.writes:  # one process, or rank 0 of several; never through a link (folder_lock.write_own)
        run.out_dir.mkdir(parents=True, exist_ok=True)
        write_own(run.out_dir / "config.json", json.dumps(cfg.model_dump(), indent=2))
        if run.plan is not None:  # what the run planned at its start (placement, predicted time and memory), to
            #                      hold against metrics.jsonl: `megatrain plan --json`'s object
            write_own(run.out_dir / "plan.json", json.dumps(run.plan.as_json(), indent=1))
        resume_lib.trim_metrics(run.out_dir, first if run.resumed else -1)  # continue without duplicate steps
    log = open_log(run, t.steps, first, cfg.output.tensorboard)
    log.info(f"megatrain: {run.adapter.model_type} {run.store.num_params / 1e6:.2f}M params, "
             f"{run.adapter.num_layers} layers, {t.precision} on {run.engine.device}; host store "
             f"{run.store.host_bytes() / 2**30:.2f} GiB; data: {run.loader.summary()}")
    if getattr(run.eval_batches, "summary", None):  # the held-out set's own rows: skipped, truncated, dropped
        log.info(f"evaluation data: {run.eval_batches.summary}")
    if run.startup_s:
        log.info("start-up: " + ", ".join(f"{k} {v:.1f} s" for k, v in run.startup_s.items())
                 + (f"; the layers' kernels compiled and tuned first: {run.tuned_first}" if run.tuned_first else
                    "; the first step compiles the layers" if run.engine.options.compile_layers else ""))
    stats = attach(run, log)  # the plan's figures in the start summary; per-step throughput, memory, streams
    from ..planner.estimate import packed_step_time

    # a GPU run's steady step off its plan is said, with where and why (packed rows: at their own documents' span)
    log.check = PlanCheck(run.plan, first, packed_step_time(run.plan, run.adapter) if run.plan else None)
    if run.reference.strategy == "precompute":  # before the data thread, which looks its pairs up in the table
        try:
            run.reference.precompute(run, log, stop)
        except BaseException:
            log.close()
            raise
    elif run.reference.strategy:
        log.info(f"reference log-probs: {run.reference.strategy} ({run.reference.why})")
    final = t.steps if cfg.checkpoint.at_end or cfg.export.at_end else None
    saver = open_saver(run, keep=cfg.checkpoint.keep, every=cfg.checkpoint.every, final_step=final)
    grpo = t.objective == "grpo"
    if grpo:
        run.loader.attach(run)  # its rollouts read the store and run on the engine's device
    data = StepPrefetcher(run.loader, pin=run.engine.cuda, steps=t.steps - first, lookup=run.reference.lookup,
                          ahead=0 if grpo else 1)  # (a rollout needs the weights of the step just trained)
    s = Session(first, log, stats, saver, data, model_files)
    if run.resumed:
        notes = resume_lib.config_notes(run.resumed, cfg.model_dump(), run.world_info)
        log.info(f"resuming from {run.resumed.path} (step {first})" + "".join(f"\n  changed: {n}" for n in notes))
        restore_rng(run.resumed.state["rng"])
        s.summary.update(run.resumed.state.get("summary", {}))
        every = cfg.train.eval_every
        if every and first % every == 0 and first < cfg.train.steps and eval_missing(run, first):
            evaluate(run, first, log, stop)  # (the weights are the step's: the numbers it would have logged)
    else:
        if cfg.resume == "auto":
            log.info(f"resume=auto: no checkpoint in {run.out_dir / 'checkpoints'} yet; starting from step 0")
        if removed := saver.clear():  # an earlier run's checkpoints (output.overwrite): resume=auto must not pick them
            log.info(f"removed {removed} checkpoint(s) of an earlier run from {saver.root}")
        s.summary["first_eval"] = evaluate(run, 0, log, stop)
    return s


def train_step(run: Run, step: int, data: PreparedStep, stats: StepStats | None = None) -> dict:
    """One optimizer step: the engine's waves and the CPU updates of the pipeline. With clipping the updates are
    handed over after the step's global norm and overlap the next step's forward; without (train.max_grad_norm:
    null) each unit's update starts as soon as its gradient is complete, during this step's backward, and the norm
    is only reported. Returns the step's metrics record."""
    t = run.cfg.train
    clipping = t.clipping
    lr = lr_at(step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, schedule=t.lr_schedule,
               min_lr_ratio=t.min_lr_ratio)
    t0 = time.perf_counter()
    if stats is not None:
        stats.begin()
    try:
        run.reference.score(run.engine, data.microbatches)  # stream: the reference's log-probs of these pairs
        run.pipeline.begin_step(lr=None if clipping else lr)
        out = run.engine.train_step(data.microbatches)
        if stats is not None:
            stats.end()  # the step's GPU work is queued: the end marker follows it
        t_queued = time.perf_counter()
        grad_norm = math.sqrt(out.grad_sq_norm.item())  # waits for the step's GPU work, all queued
    except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
        raise_if_out_of_memory(e, phase=run.engine.phase, plan=run.plan, adapter=run.adapter, step=step + 1)
        raise
    loss = out.loss_sum.item()
    t_done = time.perf_counter()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        applied = "the update was not applied" if clipping else \
            "without clipping (train.max_grad_norm: null) updates start during backward, so it was already " \
            "applied; resume from the last checkpoint"
        raise MegatrainError(f"step {step + 1}: loss {loss}, grad norm {grad_norm}; {applied}. Lower train.lr or "
                             f"check the data.")
    coef = clip_coefficient(grad_norm, t.max_grad_norm)
    run.pipeline.finish_step(lr=lr, clip_coef=coef)
    dt = time.perf_counter() - t0 + data.wait_s
    released = release_torch_pinned_cache() if run.engine.device.type == "cuda" else 0  # (outside the step's time)
    tokens = run.tokens_of(data)  # every rank's
    # where the host thread's time went: waiting for data, queueing the step (waits for the optimizer's updates
    # included), waiting for the GPU to finish it
    record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "clipping": clipping,
              "tokens": tokens, "tokens_per_s": tokens / dt, "step_time_s": dt, "data_wait_s": data.wait_s,
              "attn_len": data.attn_len,
              "queue_s": t_queued - t0, "gpu_wait_s": t_done - t_queued}
    if clipping:
        record["clip_coef"] = coef
    record.update(optimizer_fields(run.pipeline.take_stats()))
    if released:  # page-locked memory torch's allocator kept (a compiled step's autotuning copies)
        record["host_pinned_released_gib"] = released / 2**30
    if data.fields is not None:  # grpo: the rollout batch's rewards and lengths, the step's time split
        record.update(step_split(data.fields, dt))
        if out.metrics is not None:  # clip ratios and kl, as TRL logs them: token means
            record.update(grpo_fields(out.metrics))
    elif out.metrics is not None:  # a preference objective's, as TRL logs them: means over the step's pairs
        record.update(preference_fields(out.metrics))
    if out.aux_loss is not None:  # MoE: the router loss (inside `loss`) and how evenly tokens went to experts
        record["router_loss"] = out.aux_loss.item()
        record.update(expert_load(out.expert_counts.cpu()))
    return record


def state_at(run: Run, s: Session, step: int, lr: float) -> dict:
    """The run state at this step boundary (data position, RNG, schedule) for a checkpoint."""
    kept = {k: s.summary[k] for k in ("first_eval", "first_loss") if k in s.summary}
    return run_state(step=step, lr=lr, config=run.cfg.model_dump(), loader_state=s.data.state_dict(), summary=kept,
                     reference=run.reference.state())


def stopped(s: Session, step: int, signal_name: str) -> dict:
    path = s.saver.wait()
    if step == s.first_step:  # during the first evaluation, before a step: nothing new to save
        s.log.info(f"stopped by {signal_name} before step {step + 1}: no step trained, nothing saved"
                   + (f"; {path} stays the last checkpoint" if path else ""))
    else:
        s.log.info(f"stopped by {signal_name} after step {step}: checkpoint saved to {path}; continue with "
                   f"resume=auto")
    s.summary.update(stopped_at=step, checkpoint=str(path) if path else None)
    return s.summary


def finish(run: Run, s: Session, stop: StopOnSignal | None = None) -> dict:
    """After the last step: the last evaluation (overlapping the final save), the checkpoint, the export. A signal
    cuts the evaluation short and stops the export (the checkpoint is complete: nothing is lost)."""
    cfg = run.cfg
    if s.first_step < cfg.train.steps or eval_missing(run, cfg.train.steps):
        s.summary["last_eval"] = evaluate(run, cfg.train.steps, s.log, stop)
    if (final := s.saver.wait()) is not None:
        s.log.info(f"checkpoint: {final} (saved in {s.saver.last_seconds:.1f}s)")
        s.summary["checkpoint"] = str(final)
    final = final or (run.resumed.path if run.resumed else None)
    run.pipeline.drain()
    if cfg.export.at_end and run.writes:
        from ..checkpoint.export import export_store

        target = cfg.export.dir or run.out_dir / "export"
        try:
            with stop.interruptible("the export") if stop is not None else nullcontext():
                # the store holds the final checkpoint's state: its weights are exported from RAM, its files from
                # `final`
                res = export_store(run.store, final, target, dtype=cfg.export.dtype,
                                   max_shard_mb=cfg.export.max_shard_mb, replace_export=True)
        except Stopped as e:
            s.log.info(f"export stopped by {e.name}: the checkpoint {final} is complete; `megatrain export {final} "
                       f"{target}` writes the model")
            s.summary.update(stopped_during="export", checkpoint=str(final))
            return s.summary
        s.log.info(f"exported a Hugging Face model to {res['path']} ({res['seconds']:.1f}s, "
                   f"{res['bytes'] / max(res['seconds'], 1e-9) / 1e9:.2f} GB/s)")
        s.summary["export"] = str(res["path"])
    if "last_loss" in s.summary:
        s.log.info(f"done: loss {s.summary['first_loss']:.4f} -> {s.summary['last_loss']:.4f}; metrics in "
                   f"{run.out_dir / 'metrics.jsonl'}")
    else:
        s.log.info(f"nothing to train: {run.resumed.path} is at step {s.first_step}, train.steps is "
                   f"{cfg.train.steps}")
    return s.summary


def eval_missing(run: Run, step: int) -> bool:
    """A run resumed at `step` whose evaluation there was not logged: a stop during an evaluation cuts it short and
    saves the step's checkpoint, and the final checkpoint is written while the last evaluation runs, so a run
    stopped there has the one and not the other. Rank 0 reads metrics.jsonl; every rank takes its answer (they
    evaluate together)."""
    if not (run.eval_batches or run.exact_match):
        return False
    missing = float(run.writes and not eval_logged(run.out_dir / "metrics.jsonl", step))
    (missing,) = run.ranks.all_sum([missing])
    return missing > 0


def close(run: Run, s: Session, quiet: bool = False) -> None:
    """Whatever happened: a save in progress completes (it is a good step's state), then everything stops.
    quiet: a second signal stopped the run: what the interrupted threads raise is that stop, not a failure."""
    try:
        s.saver.wait()
    except MegatrainError as e:
        s.log.info(str(e))
    except BaseException:
        if not quiet:
            raise
    s.data.close()
    try:
        run.runtime.close()  # may raise again what stopped the run (the SSD tier's disk failed)
    except BaseException:
        if not quiet:
            raise
    finally:
        s.log.close()
