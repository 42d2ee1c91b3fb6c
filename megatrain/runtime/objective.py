"""The training objective: next-token loss (`SFT`) or a preference loss over (chosen, rejected) pairs, named and
computed as TRL computes them (DPOTrainer's sigmoid and ipo losses, CPOTrainer's simpo, ORPOTrainer's orpo).

A preference micro-batch holds pairs: rows 2i and 2i+1 are the chosen and the rejected sequence of pair i. Per row
r, logp[r] is the sum of log p(token) over its completion tokens and n[r] their count; ref[r] the same sum under
the reference model (dpo, ipo). `pair_loss` turns those [2P] vectors into the SUM over the P pairs of the pair
losses (differentiable in logp: the engine's LM head takes d loss / d logp[r] by autograd on this small vector and
scales each token's cross-entropy gradient by it, head_objective.py) and the metric sums TRL logs. The step's loss
is the mean over its pairs; orpo adds its SFT term, the chosen rows' token NLL over the step's chosen tokens, which
the engine adds (it needs the step's token count).

GRPO (`grpo_token_loss`) is a loss per completion token instead: TRL's clipped ratio against the rollout's log-probs
and its k3 estimate of the KL to the reference, each row's tokens weighted by w_r (`grpo_row_weights`: the
aggregation of its loss_type), on the [num_targets] vectors of one micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

PREFERENCE = ("dpo", "ipo", "simpo", "orpo")
NAMES = ("sft", *PREFERENCE, "grpo")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")  # TRL's GRPO aggregations (grpo_row_weights)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


@dataclass(frozen=True)
class Objective:
    name: str = "sft"
    beta: float = 0.1  # dpo, ipo, simpo
    label_smoothing: float = 0.0  # dpo, simpo
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1
    epsilon: float = 0.2  # grpo: the ratio's clip low (TRL epsilon)
    epsilon_high: float | None = None  # grpo: clip high (None: epsilon)
    kl_beta: float = 0.0  # grpo: the KL term's coefficient (TRL beta)
    loss_type: str = "dapo"  # grpo: the aggregation (LOSS_TYPES)
    temperature: float = 1.0  # grpo: the sampling temperature; the loss's log-probs are of logits / temperature (TRL)

    def __post_init__(self):
        if self.name not in NAMES:
            raise ValueError(f"objective {self.name!r}: one of {', '.join(NAMES)}")
        if not (self.beta > 0 and 0 <= self.label_smoothing < 0.5 and self.orpo_lambda >= 0):
            raise ValueError(f"objective {self.name}: beta > 0, label_smoothing in [0, 0.5), orpo_lambda >= 0 "
                             f"(got {self.beta}, {self.label_smoothing}, {self.orpo_lambda})")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon)
        if not (0 <= self.epsilon < 1 and self.epsilon_high >= 0 and self.kl_beta >= 0
                and self.loss_type in LOSS_TYPES and self.temperature > 0):
            raise ValueError(f"objective {self.name}: epsilon in [0, 1), epsilon_high >= 0, kl beta >= 0, loss_type "
                             f"one of {', '.join(LOSS_TYPES)}, temperature > 0 (got {self.epsilon}, "
                             f"{self.epsilon_high}, {self.kl_beta}, {self.loss_type!r}, {self.temperature})")

    @property
    def preference(self) -> bool:
        """A loss over (chosen, rejected) pairs (dpo, ipo, simpo, orpo)."""
        return self.name in PREFERENCE

    @property
    def grpo(self) -> bool:
        return self.name == "grpo"

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares with a reference model's log-probs (dpo, ipo; simpo and orpo have none)."""
        return self.name in ("dpo", "ipo")

    @property
    def needs_reference_tokens(self) -> bool:
        """grpo with a KL term: each completion token's reference log-prob (MicroBatch.ref_token_logps)."""
        return self.grpo and self.kl_beta > 0

    @classmethod
    def from_config(cls, train_cfg, pref_cfg=None, grpo_cfg=None) -> "Objective":
        """From the config's `train` section (its `objective`), its `preference` section (read for a preference
        objective) and its `grpo` section (read for grpo: epsilon, epsilon_high, beta, loss_type, temperature)."""
        name = getattr(train_cfg, "objective", "sft") or "sft"
        if name == "grpo":
            g = grpo_cfg
            high = getattr(g, "epsilon_high", None)
            return cls(name, epsilon=float(getattr(g, "epsilon", 0.2)),
                       epsilon_high=None if high is None else float(high), kl_beta=float(getattr(g, "beta", 0.0)),
                       loss_type=str(getattr(g, "loss_type", "dapo")),
                       temperature=float(getattr(g, "temperature", 1.0)))
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


GRPO_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


def grpo_row_weights(loss_type: str, n: torch.Tensor, rows: int, tokens: int, max_new_tokens: int) -> torch.Tensor:
    """w_r of each row (float64, n's shape; a MicroBatch keeps it as float32) from its completion token count n: the
    factor of its tokens' losses in the step's loss, as TRL's aggregations weigh them over a step of `rows`
    completions holding `tokens` completion tokens (all micro-batches and ranks): grpo 1/(n_r·rows) (each row's token
    mean, the mean over rows), dr_grpo 1/(rows·max_new_tokens), dapo 1/tokens (the step's token mean)."""
    if loss_type == "grpo":
        w = 1.0 / (n.double().clamp_min(1.0) * rows)
    elif loss_type == "dr_grpo":
        w = torch.full(n.shape, 1.0 / (rows * max_new_tokens), dtype=torch.float64)
    elif loss_type == "dapo":
        w = torch.full(n.shape, 1.0 / max(tokens, 1), dtype=torch.float64)
    else:
        raise ValueError(f"loss_type {loss_type!r}: one of {', '.join(LOSS_TYPES)}")
    return w


def grpo_token_loss(obj: Objective, logp: torch.Tensor, old: torch.Tensor | None, ref: torch.Tensor | None,
                    adv_t: torch.Tensor, w_t: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(Σ_t w_t·l_t, {metric: sum over the tokens}) for [n] vectors over completion tokens: logp (float32, may
    require grad), old (the log-probs at the rollout's weights; None: logp itself, detached), ref (the reference's;
    kl_beta > 0), adv_t and w_t (each token's row's advantage and weight). As TRL writes it:
        ratio_t = exp(logp_t - old_t)
        l_t = -min(ratio_t·A, clamp(ratio_t, 1 - epsilon, 1 + epsilon_high)·A) + kl_beta·(exp(ref_t - logp_t)
              - (ref_t - logp_t) - 1)
    Metrics (divided by the step's tokens, TRL's token means): clip_ratio/low_mean (ratio below 1 - epsilon with
    A < 0), clip_ratio/high_mean (above 1 + epsilon_high with A > 0), clip_ratio/region_mean (either), kl (kl_beta
    > 0: the k3 estimate)."""
    if not obj.grpo:
        raise ValueError("grpo_token_loss needs the grpo objective")
    if obj.kl_beta > 0 and ref is None:
        raise ValueError("grpo with beta > 0 needs the reference model's log-prob of every completion token")
    old = logp.detach() if old is None else old.to(logp.dtype)
    adv = adv_t.to(logp.dtype)
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - obj.epsilon, 1 + obj.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    metrics = {}
    if obj.kl_beta > 0:
        d = ref.to(logp.dtype) - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + obj.kl_beta * kl
        metrics["kl"] = kl.detach().sum()
    r = ratio.detach()
    low, high = (r < 1 - obj.epsilon) & (adv < 0), (r > 1 + obj.epsilon_high) & (adv > 0)
    metrics.update({"clip_ratio/low_mean": low.float().sum(), "clip_ratio/high_mean": high.float().sum(),
                    "clip_ratio/region_mean": (low | high).float().sum()})
    return (per_token * w_t.to(logp.dtype)).sum(), metrics
