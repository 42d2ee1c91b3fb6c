"""TensorBoard holds what metrics.jsonl holds: a resumed run's redone steps once, a run started over none of the
earlier run's."""

from __future__ import annotations

import io

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatrain.run.metrics import MetricsLogger


def _run(out, steps, start=0, loss=lambda s: float(s)):
    log = MetricsLogger(out, total_steps=max(steps), start_step=start, tensorboard=True, stream=io.StringIO())
    for s in steps:
        log.log({"step": s, "loss": loss(s), "grad_norm": 1.0, "lr": 1e-5, "tokens_per_s": 100.0})
    log.close()


def _losses(out):
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def test_a_resumed_run_shows_each_step_once(tmp_path):
    _run(tmp_path, range(1, 8))  # killed after step 7; its last checkpoint is step 4
    _run(tmp_path, range(5, 10), start=4, loss=lambda s: s + 0.5)
    assert _losses(tmp_path) == [(s, float(s)) for s in range(1, 5)] + [(s, s + 0.5) for s in range(5, 10)]


def test_a_run_started_over_shows_none_of_the_earlier_one(tmp_path):
    _run(tmp_path, range(1, 5))
    _run(tmp_path, range(1, 3), loss=lambda s: s + 0.25)
    assert _losses(tmp_path) == [(1, 1.25), (2, 2.25)]
