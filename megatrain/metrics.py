"""What the user sees of a run: a live progress bar on a terminal (plain lines otherwise), metrics.jsonl,
and TensorBoard when enabled."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class MetricsLogger:
    def __init__(self, out_dir: Path, total_steps: int, start_step: int = 0, tensorboard: bool = False,
                 stream=None):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.file = self.path.open("a")
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
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def info(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, file=self.stream, flush=True)

    def log(self, record: dict) -> None:
        """One JSON object per line; the progress display shows the headline numbers."""
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        step = record["step"]
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)
        if "loss" not in record:  # an evaluation record
            self.info(" ".join(f"{k}={_fmt(v)}" for k, v in record.items()))
            return
        headline = {"loss": record["loss"], "gnorm": record["grad_norm"], "lr": record["lr"],
                    "tok/s": record["tokens_per_s"]}
        if self.bar is not None:
            self.bar.set_postfix({k: _fmt(v) for k, v in headline.items()}, refresh=False)
            self.bar.update(1)
        elif step % self.plain_every == 0 or step == self.total:
            done = step - self.start_step
            elapsed = time.perf_counter() - self.t0
            eta = elapsed / max(done, 1) * (self.total - step)
            self.info(f"step {step}/{self.total} " + " ".join(f"{k}={_fmt(v)}" for k, v in headline.items())
                      + f" eta={eta:.0f}s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        self.file.close()


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)
