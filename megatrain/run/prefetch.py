"""The next step's data, prepared while this step trains.

Reading a step's rows from the Arrow files, collating them, building the engine's micro-batches (label shift,
target positions) and pinning them for the device take host time between two steps, while the GPU would wait:
one worker thread does it for step t+1 during step t. The order is the loader's own (one worker, sequential), and
each prepared step carries the loader's state after it, so a checkpoint records the position of the steps
actually trained, not of the one prepared ahead. A preference step's micro-batches carry their pairs' ids and,
when the reference log-probs were precomputed, those log-probs (`lookup`: run/reference.py); a grpo step's,
their advantages, row weights and old and reference log-probs (run/grpo.py).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from ..runtime import MicroBatch


@dataclass
class PreparedStep:
    batches: list[dict]  # the loader's batches (input_ids, labels, position_ids, num_real_tokens)
    microbatches: list[MicroBatch]
    loader_state: dict  # the loader's state once this step has been drawn
    wait_s: float = 0.0  # how long the training thread waited for it (0 when it was ready)
    fields: dict | None = None  # a grpo step's log fields (its rollout batch's rewards, lengths, times: run/grpo.py)

    @property
    def attn_len(self) -> float:
        """The step's attention span per real token, mean(2·position + 1): a document of d tokens attends over d
        on average, so this is sum(d²)/sum(d) over its documents (or rows); the model FLOPs behind MFU scale with
        it (planner.flops_per_token), and full plain rows give max_seq_len."""
        num = den = 0
        for mb in self.microbatches:
            span = 2 * mb.position_ids + 1
            if mb.token_mask is not None:
                span = span[mb.token_mask]
            num, den = num + int(span.sum()), den + span.numel()
        return num / den if den else 0.0

    @property
    def tokens(self) -> int:
        """Real (non-padding) tokens of the step."""
        return sum(int(b["num_real_tokens"]) if "num_real_tokens" in b else int(b["attention_mask"].sum())
                   if "attention_mask" in b else b["input_ids"].numel() for b in self.batches)


GRPO_KEYS = ("advantages", "row_weight", "old_logps", "ref_token_logps")  # a grpo micro-batch's (run/grpo.py)


def prepare_step(batches: list[dict], pin: bool, lookup=None) -> list[MicroBatch]:
    """lookup(batch): the reference log-probs of a preference batch's rows (None: none)."""
    extra = [{k: b[k] for k in GRPO_KEYS if k in b} if "advantages" in b else {} if "pair_ids" not in b else
             {"pair_ids": b["pair_ids"], "ref_logps": lookup(b) if lookup else None} for b in batches]
    mbs = [MicroBatch.from_labels(b["input_ids"], b["labels"], b.get("position_ids"), b.get("attention_mask"), **x)
           for b, x in zip(batches, extra)]
    return [mb.pin() for mb in mbs] if pin else mbs


class StepPrefetcher:
    """`next()` returns the next PreparedStep, drawing up to `ahead` steps in advance on a worker thread
    (ahead=0: drawn when asked, on the caller's thread). Stops at `last_step` steps drawn in all. lookup: a
    preference batch's reference log-probs (prepare_step). A grpo run's loader (run/grpo.Rollouts) is drawn with
    ahead=0: its rollouts need the weights of the step just trained."""

    def __init__(self, loader, *, pin: bool, steps: int, ahead: int = 1, lookup=None):
        self.loader, self.pin, self.ahead, self.lookup = loader, pin, ahead, lookup
        self._left = steps
        self._state = loader.state_dict()  # position of the steps handed out so far
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self._stop = threading.Event()
        self._worker = None
        if ahead > 0 and steps > 0:
            self._worker = threading.Thread(target=self._run, name="megatrain-data", daemon=True)
            self._worker.start()

    def _draw(self) -> PreparedStep:
        batches = self.loader.next_step()
        fields = dict(self.loader.last) if hasattr(self.loader, "last") else None  # (grpo: run/grpo.Rollouts)
        return PreparedStep(batches, prepare_step(batches, self.pin, self.lookup), self.loader.state_dict(),
                            fields=fields)

    def _run(self) -> None:
        try:
            for _ in range(self._left):
                item = self._draw()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the training thread by next()
            self._queue.put(e)

    def next(self) -> PreparedStep:
        t0 = time.perf_counter()
        if self._worker is None:
            item = self._draw()
        else:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        item.wait_s = time.perf_counter() - t0
        self._state = item.loader_state
        return item

    def state_dict(self) -> dict:
        """The loader's state after the last step handed out by next()."""
        return self._state

    def close(self) -> None:
        self._stop.set()
        if self._worker is not None:
            self._worker.join(timeout=10)
            self._worker = None
