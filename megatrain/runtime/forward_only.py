"""The engine's forward-only uses: evaluation loss, sequence log-probs (a preference objective's reference pass and
evaluation; of the policy's weights or of the store's frozen reference copy), token log-probs (grpo's old and
reference log-probs) and next-token logits for decoding.

`ForwardOnly` is a base of `Engine` (engine.py): each method runs the engine's forward wave alone
(`Engine._forward_only`: embed and layers, no autograd, no checkpoints) and then the head's forward with the
head's weights fetched like any unit's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .head_objective import row_logps, token_logps
from .lmhead import softcap_logits
from .microbatch import MicroBatch
from .schedule import group_sizes


class ForwardOnly:
    @torch.no_grad()
    def eval_loss(self, microbatches: list[MicroBatch]) -> tuple[float, int]:
        """(mean token loss, target count) with the same streaming forward and no gradients."""
        hidden, mbs = self._forward_only(microbatches)
        loaded = self._fetch(self.head_units)
        norm_w, lm_w = self._head_weights(self._acquire(loaded))
        total, n = torch.zeros((), device=self.device), 0
        for mb, h in zip(mbs, hidden):
            x = self.adapter.final_norm(norm_w, h.reshape(-1, h.shape[-1]).index_select(0, mb.target_index))
            for a in range(0, x.shape[0], self.loss_chunk):
                logits = softcap_logits(x[a: a + self.loss_chunk] @ lm_w.t(), self.adapter.logit_softcap)[0].float()
                total += F.cross_entropy(logits, mb.targets[a: a + self.loss_chunk], reduction="sum")
            n += mb.num_targets
        self._release(loaded)
        return (total / max(n, 1)).item(), n

    @torch.no_grad()
    def sequence_logps(self, microbatches: list[MicroBatch], weights: str = "policy"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logp [sum of rows] float32, n [sum of rows] int64) on the device: each row's summed log-prob of its
        target tokens and their count, by the streaming forward alone. weights: 'policy' (the trained weights) or
        'reference' (the store's frozen copy, HostStore.freeze_reference / load_reference). The micro-batches go
        through in the placement's wave groups, one wave each: no more of them on the device at once than a step
        holds."""
        out = self._head_forward(microbatches, weights, lambda h, mb, norm_w, lm_w: row_logps(
            self.adapter.final_norm, h, mb, norm_w, lm_w, self.loss_chunk, self.head_kernels,
            self.adapter.logit_softcap))
        return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])

    @torch.no_grad()
    def token_logps(self, microbatches: list[MicroBatch], weights: str = "policy") -> list[torch.Tensor]:
        """Each micro-batch's log-prob of each of its targets (float32 [num_targets] on the device, in target
        order): grpo's old log-probs (weights 'policy') and reference log-probs ('reference'), as sequence_logps
        runs them; the logits divided by the objective's temperature (grpo's sampling temperature, as TRL)."""
        return self._head_forward(microbatches, weights, lambda h, mb, norm_w, lm_w: token_logps(
            self.adapter.final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, self.loss_chunk,
            self.head_kernels, self.adapter.logit_softcap, self.options.objective.temperature))

    def _head_forward(self, microbatches: list[MicroBatch], weights: str, fn) -> list:
        """fn(h, mb, norm_w, lm_w) of each micro-batch after the forward wave of `weights`, in wave groups."""
        if weights not in ("policy", "reference") or (weights == "reference" and self.store.reference is None):
            raise ValueError(f"weights={weights!r}: 'policy', or 'reference' once the store holds a reference copy")
        reference = weights == "reference"
        if reference and self.pinned is not None:
            self.pinned.register(self.store.reference, "reference weights")
        out = []
        for group in group_sizes(len(microbatches), self.placement.wave_groups):
            hidden, mbs = self._forward_only([microbatches[m] for m in group], reference)
            loaded = self._fetch(self.head_units, reference)
            norm_w, lm_w = self._head_weights(self._acquire(loaded))
            out += [fn(h, mb, norm_w, lm_w) for mb, h in zip(mbs, hidden)]
            del hidden, mbs
            self._release(loaded)
        return out

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] at position lengths-1 of each right-padded row (for greedy decoding and checks)."""
        B = input_ids.shape[0]
        mb = MicroBatch.from_labels(input_ids, torch.full_like(input_ids, -100))
        hidden, _ = self._forward_only([mb])
        loaded = self._fetch(self.head_units)
        norm_w, lm_w = self._head_weights(self._acquire(loaded))
        last = hidden[0][torch.arange(B, device=self.device), (lengths - 1).to(self.device)]
        logits = softcap_logits(self.adapter.final_norm(norm_w, last) @ lm_w.t(), self.adapter.logit_softcap)[0].float()
        self._release(loaded)
        return logits
