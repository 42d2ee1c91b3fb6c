"""What the user sees of a run: a live progress bar on a terminal (plain lines otherwise), metrics.jsonl,
TensorBoard and wandb when enabled.

Each step's record carries what the trainer measured (loss, grad norm, `clipping` and, when on, `clip_coef`, lr,
tokens/s) and what `stats`, when set (megatrain.run.stepstats.StepStats), adds: TFLOP/s, MFU, GPU and host memory,
the busy shares of the compute, H2D and D2H streams; the logger adds the ETA, and with an SSD tier (`disk`, set to
the store's runtime.disk_tier.DiskTier) the disk's traffic since the last record: `disk_fields`; once torch.compile has
run in the process, the graphs Dynamo compiled since the last step record and the functions it gave up compiling
(its recompile limit hit): `CompileCounts`. `check`, when set (run/plancheck.PlanCheck), may add a line about a
record: the plan held against the steady steps."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ..checkpoint.folder_lock import open_own
from ..checkpoint.resume import metrics_records


class MetricsLogger:
    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = False,
                 stream=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        # appended, never through a symbolic link (a file elsewhere would grow with the run's records)
        self.file = os.fdopen(open_own(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a")
        self.total = total_steps
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self.start_step = start_step
        self.plain_every = max(1, total_steps // 100)
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, file=self.stream, unit="step", dynamic_ncols=True)
        self.stats = None  # callable(record) -> extra fields for step records
        self.disk = None  # the SSD tier (runtime/disk_tier.DiskTier) whose counters each step record reads
        self.check = None  # callable(record) -> a line to show, or None (run/plancheck.PlanCheck)
        self.compiles = CompileCounts()
        self.wandb = None
        self.tb = None
        if tensorboard:
            self.tb = tensorboard_writer(Path(out_dir) / "tensorboard", start_step)

    def info(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, file=self.stream, flush=True)

    def enable_wandb(self, config: dict | None = None, name: str | None = None) -> None:
        """Log every record to wandb too (output.wandb); imported only now, and only a warning without it."""
        try:
            import wandb
        except ImportError:
            self.info("output.wandb: the wandb package is not installed (pip install wandb); not logging to wandb")
            return
        self.wandb = wandb.init(project="megatrain", name=name or self.path.parent.name, dir=str(self.path.parent),
                                config=config, resume="allow")

    def log(self, record: dict) -> None:
        """One JSON object per line; the progress display shows the headline numbers."""
        step = record["step"]
        if "loss" in record:
            if self.stats is not None:
                record = {**record, **self.stats(record)}
            if self.disk is not None:
                record = {**record, **disk_fields(self.disk.take_stats(), record.get("step_time_s"))}
            record = {**record, **self.compiles.take()}
            done = step - self.start_step
            elapsed = time.perf_counter() - self.t0
            record["elapsed_s"] = elapsed  # since the logger opened: steps' wall time, evaluations and saves
            record["eta_s"] = elapsed / max(done, 1) * (self.total - step)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))},
                           step=step)
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if "loss" not in record:  # an evaluation record
            self.info(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))
            return
        if self.check is not None and (notice := self.check(record)):
            self.info(notice)
        headline = _headline(record)
        if self.bar is not None:
            self.bar.set_postfix(headline, refresh=False)
            self.bar.update(1)
        elif step % self.plain_every == 0 or step == self.total:
            self.info(f"step {step}/{self.total} " + " ".join(f"{k}={v}" for k, v in headline.items())
                      + f" eta={_duration(record['eta_s'])}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
        self.file.close()


class CompileCounts:
    """Dynamo's counters since the last `take`, as a step record's fields: `compiled_graphs` (graphs compiled: a step
    that compiles again has rows of a shape the compiled layers had not run) and `compile_limit_hits` (functions
    Dynamo stopped compiling at its recompile limit: they run uncompiled from then on). Nothing while torch._dynamo
    is not loaded (an uncompiled run does not import it for this)."""

    def __init__(self):
        self.last = self._now() or (0, 0)  # what compiled before the logger opened (engine.tune_first) is not a step's

    @staticmethod
    def _now() -> tuple[int, int] | None:
        dynamo = sys.modules.get("torch._dynamo.utils")
        if dynamo is None:
            return None
        c = dynamo.counters
        hits = sum(n for k, n in c["unimplemented"].items() if "limit exceeded" in k.lower())
        return int(c["stats"]["unique_graphs"]), int(hits)

    def take(self) -> dict:
        now = self._now()
        if now is None:
            return {}
        before, self.last = self.last, now
        return {"compiled_graphs": max(now[0] - before[0], 0), "compile_limit_hits": max(now[1] - before[1], 0)}


def preference_fields(metrics: dict) -> dict:
    """StepOutput.metrics (the sums over the step's pairs, and `pairs`) as a record's fields: each a mean over the
    pairs, named as TRL logs it (rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
    logps/chosen, logps/rejected; orpo's nll_loss and log_odds_ratio), and `pairs`."""
    pairs = float(metrics["pairs"])
    out = {k: float(v) / max(pairs, 1.0) for k, v in metrics.items() if k != "pairs"}
    out["pairs"] = int(pairs)
    return out


def disk_fields(stats: dict, step_s: float | None) -> dict:
    """The SSD tier's counters (DiskTier.take_stats) as a record's fields: GB (1e9 bytes) read and written, each
    kind's rate while one of its requests was in flight, the seconds any request was in flight (`disk_busy_s`) and
    the rate of both kinds together over them (`disk_gbps`: what the disk did while it worked; reads and writes
    overlap in time, so each kind's own rate understates it), the share of the step the disk worked
    (`disk_busy`), and the traffic's average rate over the step."""
    r, w = stats["read_bytes"] / 1e9, stats["write_bytes"] / 1e9
    rs, ws, busy = stats["read_busy_s"], stats["write_busy_s"], stats.get("any_busy_s", 0.0)
    out = {"disk_read_gb": r, "disk_write_gb": w, "disk_read_busy_s": rs, "disk_write_busy_s": ws,
           "disk_read_gbps": r / rs if rs else 0.0, "disk_write_gbps": w / ws if ws else 0.0,
           "disk_busy_s": busy, "disk_gbps": (r + w) / busy if busy else 0.0}
    if step_s:
        out["disk_gbps_step"] = (r + w) / step_s
        out["disk_busy"] = busy / step_s
    return out


def eval_logged(path: Path, step: int) -> bool:
    """Whether metrics.jsonl holds an evaluation record (one without a training loss) of `step`."""
    return any(r.get("step") == step and "loss" not in r for r in metrics_records(path))


def tensorboard_writer(folder: Path, start_step: int):
    """A SummaryWriter that holds what metrics.jsonl holds (resume.trim_metrics): a run started over removes the
    event files an earlier run left (regular files only, as `events.out.tfevents.*`); a resumed one marks the steps
    after its checkpoint purged (`purge_step`: TensorBoard hides the earlier run's records of the steps redone)."""
    from torch.utils.tensorboard import SummaryWriter

    if start_step == 0 and folder.is_dir():
        for f in folder.glob("events.out.tfevents.*"):
            if f.is_file() and not f.is_symlink():
                f.unlink()
    return SummaryWriter(str(folder), purge_step=start_step + 1 if start_step else None)


def _headline(r: dict) -> dict[str, str]:
    """The numbers shown each step: training, throughput, memory, where the time goes."""
    gnorm = _fmt(r["grad_norm"]) + (" (no clip)" if r.get("clipping") is False else "")
    out = {"loss": _fmt(r["loss"]), "gnorm": gnorm, "lr": f"{r['lr']:.3g}",
           "tok/s": _fmt(r["tokens_per_s"])}
    if "rewards/accuracies" in r:  # a preference objective: how often chosen wins, and by how much
        out["acc"] = f"{r['rewards/accuracies']:.2f}"
        out["margin"] = _fmt(r["rewards/margins"])
    if "reward" in r:  # grpo: the rollout batch's mean reward, completion length and the rollout's rate
        out["reward"] = f"{r['reward']:.3f}"
        out["len"] = f"{r['completions/mean_length']:.1f}"
        if r.get("rollout_s"):
            out["rollout"] = f"{r['rollout_s']:.1f}s {_fmt(r['rollout_tokens_per_s'])} tok/s"
    if "tflops_6n" in r:
        out["TFLOP/s"] = f"{r['tflops_6n']:.0f}" if r["tflops_6n"] >= 10 else f"{r['tflops_6n']:.3g}"
    if "mfu" in r:
        out["MFU"] = f"{100 * r['mfu']:.1f}%"
    if "gpu_peak_gib" in r:
        out["gpu"] = f"{r['gpu_peak_gib']:.1f}G"
    if "host_rss_gib" in r:
        out["host"] = f"{r['host_rss_gib']:.1f}G"
    if "busy_compute" in r:
        out["busy c/h2d/d2h"] = f"{r['busy_compute']:.2f}/{r['busy_h2d']:.2f}/{r['busy_d2h']:.2f}"
    if "disk_read_gb" in r:
        out["ssd r/w GB/s"] = f"{r['disk_read_gbps']:.2f}/{r['disk_write_gbps']:.2f}"
        if "disk_busy" in r:
            out["ssd busy"] = f"{100 * r['disk_busy']:.0f}%"
    return out


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def optimizer_fields(stats: dict) -> dict:
    """The CPU AdamW's work since the last record (OptimizerPipeline.take_stats: the updates it finished, which
    overlap the step boundary) as a record's fields: seconds in the update, seconds waiting for gradient copies,
    and its rate in Gparam/s. A slow step whose rate fell shows the host's memory or CPU slowed the optimizer; one at
    the usual rate points elsewhere. And its longest single piece of work against what that piece takes at the
    record's rate: a worker held (not slowed) shows there."""
    if not stats.get("update_s"):
        return {}
    rate = stats["params"] / stats["update_s"]
    out = {"optimizer_update_s": stats["update_s"], "optimizer_copy_wait_s": stats["copy_wait_s"],
           "optimizer_gparams_per_s": rate / 1e9}
    if stats.get("longest_params"):  # its longest piece of work, and what that piece takes at the record's rate
        out.update(optimizer_longest_s=stats["longest_s"], optimizer_longest_usual_s=stats["longest_params"] / rate)
    return out
