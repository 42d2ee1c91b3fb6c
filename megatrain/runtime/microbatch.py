"""What the engine is given and what it returns: a micro-batch's host tensors, a step's loss and norm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    """Host tensors of one micro-batch, validated and prepared for the device."""

    input_ids: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64; restarts at 0 at each packed document
    target_index: torch.Tensor  # [n] int64: flat positions (into B*T) that predict a token
    targets: torch.Tensor  # [n] int64: the token each of those positions predicts
    packed: bool  # some row holds more than one document
    token_mask: torch.Tensor | None = None  # bool [B, T]: real tokens, False on padding (None: all real)
    # A preference objective (objective.py): rows 2i / 2i+1 are pair i's chosen / rejected sequence, not packed.
    ref_logps: torch.Tensor | None = None  # float32 [B]: the reference model's completion log-prob per row (dpo, ipo)
    pair_ids: torch.Tensor | None = None  # int64 [B // 2]: each pair's example index (the key of stored ref_logps)
    # grpo (objective.grpo_token_loss): each row a prompt + its completion, the completion's tokens the targets
    advantages: torch.Tensor | None = None  # float32 [B]: each row's advantage
    row_weight: torch.Tensor | None = None  # float32 [B]: each row's w_r (objective.grpo_row_weights)
    old_logps: torch.Tensor | None = None  # float32 [num_targets]: log-probs at the rollout's weights (None: on-policy)
    ref_token_logps: torch.Tensor | None = None  # float32 [num_targets]: the reference's log-probs (kl_beta > 0)

    @property
    def num_targets(self) -> int:
        return int(self.targets.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def from_labels(cls, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                    pair_ids: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                    row_weight: torch.Tensor | None = None, old_logps: torch.Tensor | None = None,
                    ref_token_logps: torch.Tensor | None = None):
        """From Hugging Face style (input_ids, labels): labels are unshifted, -100 where no loss is taken;
        attention_mask (1 on real tokens, 0 on padding) only matters to MoE router statistics. ref_logps, pair_ids:
        a preference micro-batch's; advantages, row_weight, old_logps, ref_token_logps: a grpo micro-batch's (passed
        through as float32)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T).repeat(B, 1)
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        flat = shifted.reshape(-1)
        index = torch.nonzero(flat != IGNORE_INDEX).squeeze(1)
        packed = bool((position_ids != torch.arange(T)).any())
        mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool().contiguous()
        return cls(input_ids.long().contiguous(), position_ids.long().contiguous(), index, flat[index].long(), packed,
                   mask, _float(ref_logps), None if pair_ids is None else pair_ids.long().contiguous(),
                   *(_float(t) for t in (advantages, row_weight, old_logps, ref_token_logps)))

    @property
    def real_tokens(self) -> int:
        return self.num_tokens if self.token_mask is None else int(self.token_mask.sum())

    def pin(self) -> "MicroBatch":
        """The same tensors in page-locked memory, so `to(cuda)` is an asynchronous DMA (done ahead of the step
        by the run's data prefetch; idempotent)."""
        if self.input_ids.is_pinned():
            return self
        return MicroBatch(*(_map(t, torch.Tensor.pin_memory) for t in self._tensors()[:4]), self.packed,
                          *(_map(t, torch.Tensor.pin_memory) for t in self._tensors()[4:]))

    def to(self, device: torch.device) -> "MicroBatch":
        if device.type == "cpu":
            return self
        src = self.pin()
        moved = [_map(t, lambda x: x.to(device=device, non_blocking=True)) for t in src._tensors()]
        return MicroBatch(*moved[:4], self.packed, *moved[4:])

    def _tensors(self) -> list[torch.Tensor | None]:
        """The tensor fields in order, `packed` left out."""
        return [self.input_ids, self.position_ids, self.target_index, self.targets, self.token_mask, self.ref_logps,
                self.pair_ids, self.advantages, self.row_weight, self.old_logps, self.ref_token_logps]


def _float(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float().contiguous()


def _map(t: torch.Tensor | None, fn):
    """fn(t) for a host tensor, t itself for None or one already on a device (reference log-probs scored there)."""
    return t if t is None or t.device.type != "cpu" else fn(t)


@dataclass
class StepOutput:
    loss_sum: torch.Tensor  # device scalar: sum of token losses (already divided by num_targets => the loss)
    grad_sq_norm: torch.Tensor  # device scalar: squared global gradient norm
    num_targets: int
    num_tokens: int
    aux_loss: torch.Tensor | None = None  # MoE: the router loss included in loss_sum (coefficient applied)
    expert_counts: torch.Tensor | None = None  # MoE: [MoE layers, E] top-k assignments of the step's real tokens
    # A preference objective: device scalars, each metric's sum over these micro-batches' pairs (objective.py:
    # rewards/..., logps/...; orpo's nll_loss summed so that / pairs is the step's token mean) and "pairs", their
    # count; the run divides each by the step's pairs (summed over ranks first)
    metrics: dict[str, torch.Tensor] | None = None
