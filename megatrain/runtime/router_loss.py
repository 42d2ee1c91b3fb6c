"""The router load-balancing loss of mixture-of-experts layers, across the streamed layers of one micro-batch.

transformers (load_balancing_loss_func, with output_router_logits) computes, for one forward over a micro-batch,
aux = E · Σ_e F_e · P_e, where over every MoE layer and every real (not padding) token F_e is the fraction of
(token, layer) rows whose top-k includes expert e (top-k counts / rows) and P_e the mean softmax probability of
expert e; the loss adds router_aux_loss_coef · aux. F has no gradient (a top-k), so
d aux / d(layer l's probability sum over tokens)_e = E · F_e / (layers · tokens), the same for every layer: each
layer's backward adds that constant times its probability sum, which gives exactly the gradient of the loss.

A step's router loss is the mean over its micro-batches of each one's aux (as transformers computes it for one
forward), so the objective does not grow with the number of micro-batches (transformers' Trainer with
num_items_in_batch adds one aux per micro-batch; megatrain divides by their number).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RouterStats:
    """One micro-batch's router statistics from the forward wave: per MoE layer, in layer order."""

    prob_sums: list[torch.Tensor] = field(default_factory=list)  # [E] fp32, sum over real tokens
    counts: list[torch.Tensor] = field(default_factory=list)  # [E] fp32, top-k assignments over real tokens

    def add(self, prob_sum: torch.Tensor, counts: torch.Tensor) -> None:
        self.prob_sums.append(prob_sum.detach())
        self.counts.append(counts)


def aux_loss_and_grad(stats: RouterStats, real_tokens: torch.Tensor, num_experts: int, weight: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight · aux, d(weight · aux)/d(each layer's probability sum) [E]) for one micro-batch; `weight` is the
    coefficient over the number of the step's micro-batches. real_tokens: device scalar (no host sync)."""
    layers = len(stats.prob_sums)
    rows = real_tokens.to(torch.float32).clamp_min(1.0) * layers
    frac = torch.stack(stats.counts).sum(0) / rows  # F_e
    prob = torch.stack(stats.prob_sums).sum(0) / rows  # P_e
    aux = num_experts * (frac * prob).sum()
    return weight * aux, (weight * num_experts / rows) * frac


def group_router_loss(mbs, stats: list[RouterStats], adapter, num_microbatches: int, loss_sum: torch.Tensor,
                      router: dict) -> list[torch.Tensor | None]:
    """A wave group's router losses, after its forward wave: each micro-batch's (`aux_loss_and_grad`, the
    adapter's coefficient over the step's micro-batches) added to `loss_sum` and `router["aux"]`, its expert counts
    to `router["counts"]`; returns each micro-batch's gradient with respect to every layer's probability sum for
    the backward (None with a coefficient of 0). No host synchronisation."""
    weight = adapter.router_aux_coef / num_microbatches
    grads = []
    for mb, st in zip(mbs, stats):
        real = mb.token_mask.sum() if mb.token_mask is not None else \
            torch.full((), mb.num_tokens, dtype=torch.float32, device=loss_sum.device)
        aux, grad = aux_loss_and_grad(st, real, adapter.num_experts, weight)
        loss_sum += aux
        router["aux"] += aux
        grads.append(grad if weight else None)
        counts = torch.stack(st.counts)
        router["counts"] = counts if router["counts"] is None else router["counts"] + counts
    return grads


def expert_load(counts: torch.Tensor) -> dict[str, float]:
    """Tokens per expert (top-k assignments summed over a step's micro-batches), per layer [L, E]: the least and
    most loaded expert's share relative to a uniform load (1.0 = balanced), and the mean routing entropy over
    layers relative to its maximum log(E) (1.0 = uniform)."""
    share = counts / counts.sum(-1, keepdim=True).clamp_min(1.0)
    E = counts.shape[-1]
    entropy = -(share * share.clamp_min(1e-30).log()).sum(-1) / torch.log(torch.tensor(float(E)))
    return {"expert_load_min": float(share.min() * E), "expert_load_max": float(share.max() * E),
            "expert_entropy": float(entropy.mean())}
