"""The training objective: next-token loss (`SFT`) or a preference loss over (chosen, rejected) pairs, named and
computed as TRL computes them (DPOTrainer's sigmoid and ipo losses, CPOTrainer's simpo, ORPOTrainer's orpo).

A preference micro-batch holds pairs: rows 2i and 2i+1 are the chosen and the rejected sequence of pair i. Per row
r, logp[r] is the sum of log p(token) over its completion tokens and n[r] their count; ref[r] the same sum under
the reference model (dpo, ipo). `pair_loss` turns those [2P] vectors into the SUM over the P pairs of the pair
losses (differentiable in logp: the engine's LM head takes d loss / d logp[r] by autograd on this small vector and
scales each token's cross-entropy gradient by it, head_objective.py) and the metric sums TRL logs. The step's loss
is the mean over its pairs; orpo adds its SFT term, the chosen rows' token NLL over the step's chosen tokens, which
the engine adds (it needs the step's token count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAMES = ("sft", "dpo", "ipo", "simpo", "orpo")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class Objective:
    name: str = "sft"
    beta: float = 0.1  # dpo, ipo, simpo
    label_smoothing: float = 0.0  # dpo, simpo
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"objective {self.name!r}: one of {', '.join(NAMES)}")
        if not (self.beta > 0 and 0 <= self.label_smoothing < 0.5 and self.orpo_lambda >= 0):
            raise ValueError(f"objective {self.name}: beta > 0, label_smoothing in [0, 0.5), orpo_lambda >= 0 "
                             f"(got {self.beta}, {self.label_smoothing}, {self.orpo_lambda})")

    @property
    def preference(self) -> bool:
        return self.name != "sft"

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model's log-probs (dpo, ipo; simpo and orpo have none)."""
        return self.name in ("dpo", "ipo")

    @classmethod
    def from_config(cls, train_cfg, pref_cfg=None) -> "Objective":
        """From the config's `train` section (its `objective`) and `preference` section (read when not sft)."""
        name = getattr(train_cfg, "objective", "sft") or "sft"
        if name == "sft" or pref_cfg is None:
            return cls(name)
        return cls(name, float(pref_cfg.beta), float(pref_cfg.label_smoothing), float(pref_cfg.simpo_gamma),
                   float(pref_cfg.orpo_lambda))


SFT = Objective("sft")


def _smoothed_sigmoid(z: torch.Tensor, ls: float) -> torch.Tensor:
    """TRL's sigmoid loss with conservative label smoothing: -(1-ls)·logσ(z) - ls·logσ(-z)."""
    return -(1 - ls) * F.logsigmoid(z) - ls * F.logsigmoid(-z)


def pair_loss(obj: Objective, logp: torch.Tensor, n: torch.Tensor, ref: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(sum over the P pairs of the pair losses, {metric: sum over the pairs}) for [2P] vectors logp (float32, may
    require grad), n (completion tokens per row) and ref (the reference's logp per row; dpo and ipo). Metrics as TRL
    logs them once divided by P: rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies (chosen reward
    above rejected), logps/chosen, logps/rejected (dpo: sums; ipo, simpo, orpo: per-token averages); orpo also
    log_odds_ratio (logσ of the log odds ratio) and log_odds_chosen (the log odds ratio)."""
    if not obj.preference:
        raise ValueError("pair_loss needs a preference objective (dpo, ipo, simpo, orpo)")
    if obj.needs_reference and ref is None:
        raise ValueError(f"objective {obj.name} needs the reference model's log-probs of every row")
    nf = n.to(logp.dtype).clamp_min(1.0)
    avg = logp / nf
    b, ls = obj.beta, obj.label_smoothing
    extra = {}
    if obj.name == "dpo":
        ratio = logp - ref.to(logp.dtype)
        losses = _smoothed_sigmoid(b * (ratio[0::2] - ratio[1::2]), ls)
        rewards, shown = b * ratio, logp
    elif obj.name == "ipo":
        ratio = avg - ref.to(logp.dtype) / nf
        losses = (ratio[0::2] - ratio[1::2] - 1 / (2 * b)) ** 2
        rewards, shown = b * ratio, avg
    elif obj.name == "simpo":
        losses = _smoothed_sigmoid(b * (avg[0::2] - avg[1::2]) - obj.simpo_gamma, ls)
        rewards, shown = b * avg, avg
    else:  # orpo: the odds ratio of the per-token average probabilities
        c, r = avg[0::2], avg[1::2]
        log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
        ratio = F.logsigmoid(log_odds)
        losses = -obj.orpo_lambda * ratio
        rewards, shown = obj.orpo_lambda * avg, avg
        extra = {"log_odds_ratio": ratio.detach().sum(), "log_odds_chosen": log_odds.detach().sum()}
    rewards, shown = rewards.detach(), shown.detach()
    rc, rr = rewards[0::2], rewards[1::2]
    metrics = {"rewards/chosen": rc.sum(), "rewards/rejected": rr.sum(), "rewards/margins": (rc - rr).sum(),
               "rewards/accuracies": (rc > rr).float().sum(), "logps/chosen": shown[0::2].sum(),
               "logps/rejected": shown[1::2].sum(), **extra}
    return losses.sum(), metrics
