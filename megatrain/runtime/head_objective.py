"""The LM head of a preference objective (objective.py), one micro-batch at a time, in two passes over its chunks:

    pass 1   forward only: final norm + LM head + each target's log p (the cross-entropy kernel's first pass), summed
             per row (row of a target = target_index // T): logp[r] and its token count n[r]
    loss     pair_loss on the [B] vector, and d(loss)/d(logp[r]) by autograd on it (a few hundred numbers)
    pass 2   the SFT head (lmhead.head_loss) with a per-target scale: a token's loss is -log p, so its weight is
             -d(step loss)/d(logp[row]); orpo's SFT term adds 1/(the step's chosen tokens) on chosen rows

The result is the exact gradient of the written-out loss (logp is a sum of token log-probs, so the chain rule
through it is a weighted cross-entropy gradient), for any chunk size, with the logits never held beyond a chunk.
The extra cost is pass 1: one more forward of the head (its GEMM and one read of the logits). Gemma-2's logit
soft-capping is in both passes (lmhead.softcap_logits).

GRPO (`GRPOStep`) is the same two passes with a loss per token instead of per row: pass 1 keeps each target's
log p, objective.grpo_token_loss runs on that [num_targets] vector, and pass 2 scales each token's cross-entropy
gradient by -d(step loss)/d(logp_t). Each row's advantage and weight w_r are given (MicroBatch), so a micro-batch's
share of the step's loss needs nothing of the other micro-batches.
"""

from __future__ import annotations

import torch

from .lmhead import HeadKernels, ce_token_losses, head_loss, softcap_logits
from .microbatch import MicroBatch
from .objective import GRPO_METRICS, Objective, grpo_token_loss, pair_loss


def token_logps(final_norm, h: torch.Tensor, target_index: torch.Tensor, targets: torch.Tensor,
                norm_w: torch.Tensor, lm_w: torch.Tensor, chunk: int, kernels: HeadKernels,
                softcap: float | None = None, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) at each target position (fp32 [n]), forward only, `chunk` rows of logits at a time; the
    logits divided by `temperature` (grpo's sampling temperature, as TRL's per-token log-probs)."""
    rows = h.reshape(-1, h.shape[-1])
    out = torch.empty(target_index.shape[0], dtype=torch.float32, device=h.device)
    with torch.no_grad():
        for a in range(0, target_index.shape[0], chunk):
            x = final_norm(norm_w, rows.index_select(0, target_index[a: a + chunk]))
            logits, _ = softcap_logits(x @ lm_w.t(), softcap)
            if temperature != 1.0:
                logits = logits / temperature
            out[a: a + chunk] = -ce_token_losses(logits, targets[a: a + chunk], kernel=kernels.fused_ce)
    return out


def target_rows(mb: MicroBatch) -> torch.Tensor:
    """The row of each target position (rows are not packed)."""
    return torch.div(mb.target_index, mb.input_ids.shape[1], rounding_mode="floor")


def row_logps(final_norm, h: torch.Tensor, mb: MicroBatch, norm_w: torch.Tensor, lm_w: torch.Tensor, chunk: int,
              kernels: HeadKernels, softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp [B] fp32: each row's sum of its targets' log-probs, n [B] int64: its target count), on h's device."""
    B, rows = mb.input_ids.shape[0], target_rows(mb)
    tok = token_logps(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, chunk, kernels, softcap)
    logp = torch.zeros(B, dtype=torch.float32, device=h.device).index_add_(0, rows, tok)
    n = torch.zeros(B, dtype=torch.int64, device=h.device).index_add_(0, rows, torch.ones_like(rows))
    return logp, n


def chosen_targets(mb: MicroBatch) -> int:
    """Target tokens on the chosen rows (even rows) of a host micro-batch (orpo's SFT term)."""
    return int((target_rows(mb) % 2 == 0).sum())


def check_pairs(obj: Objective, mbs: list[MicroBatch]) -> None:
    for m, mb in enumerate(mbs):
        B = mb.input_ids.shape[0]
        if B % 2 or mb.packed:
            raise ValueError(f"micro-batch {m}: a {obj.name} micro-batch holds (chosen, rejected) rows in pairs, "
                             f"unpacked ({B} rows{', packed' if mb.packed else ''})")
        if obj.needs_reference and (mb.ref_logps is None or mb.ref_logps.shape != (B,)):
            raise ValueError(f"micro-batch {m}: objective {obj.name} needs ref_logps, the reference model's "
                             f"log-prob of each of its {B} rows")


class PreferenceStep:
    """One train_step's preference head: its micro-batches' losses into the step's loss, their metric sums, the
    gradient of every micro-batch's head. pairs, chosen: the step's (all micro-batches, all ranks)."""

    def __init__(self, obj: Objective, pairs: int, chosen: int, device: torch.device):
        self.obj, self.inv_pairs = obj, 1.0 / pairs
        self.nll_scale = 1.0 / max(chosen, 1) if obj.name == "orpo" else 0.0
        self.pairs_step = pairs
        self.metrics: dict[str, torch.Tensor] = {"pairs": torch.zeros((), dtype=torch.float32, device=device)}

    def head(self, final_norm, h: torch.Tensor, mb: MicroBatch, norm_w, lm_w, norm_grad, lm_grad, chunk: int,
             kernels: HeadKernels, softcap: float | None, loss_sum: torch.Tensor) -> torch.Tensor:
        """Adds the micro-batch's share of the step's loss to `loss_sum`; returns d(loss)/d h."""
        logp, n = row_logps(final_norm, h, mb, norm_w, lm_w, chunk, kernels, softcap)
        leaf = logp.detach().requires_grad_(True)
        with torch.enable_grad():
            loss, metrics = pair_loss(self.obj, leaf, n, mb.ref_logps)
            (dlogp,) = torch.autograd.grad(loss, leaf)
        weight = dlogp * -self.inv_pairs  # d(step loss)/d(a token's loss) on each row
        loss_sum += loss.detach() * self.inv_pairs
        if self.nll_scale:  # orpo's SFT term: the chosen rows' token NLL, a mean over the step's chosen tokens
            weight[0::2] += self.nll_scale
            nll = -logp[0::2].sum() * self.nll_scale
            loss_sum += nll
            metrics["nll_loss"] = nll * self.pairs_step  # / pairs: the step's token mean
        for k, v in metrics.items():
            self.metrics[k] = self.metrics[k] + v if k in self.metrics else v
        self.metrics["pairs"] += mb.input_ids.shape[0] // 2
        _, dh = head_loss(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, norm_grad, lm_grad,
                          weight.index_select(0, target_rows(mb)), chunk, kernels, softcap)
        return dh


def check_grpo(obj: Objective, mbs: list[MicroBatch]) -> None:
    """A grpo micro-batch: unpacked rows, each row's advantage and weight, the targets' old (optional) and reference
    (kl_beta > 0) log-probs."""
    for m, mb in enumerate(mbs):
        B, n = mb.input_ids.shape[0], mb.num_targets
        if mb.packed:
            raise ValueError(f"micro-batch {m}: a grpo micro-batch holds one completion per row, unpacked")
        need = {"advantages": (mb.advantages, (B,), f"each of its {B} rows' advantage"),
                "row_weight": (mb.row_weight, (B,), f"each of its {B} rows' loss weight w_r")}
        if obj.kl_beta > 0:
            need["ref_token_logps"] = (mb.ref_token_logps, (n,), f"the reference's log-prob of each of its {n} "
                                                                  "target tokens (beta > 0)")
        if mb.old_logps is not None:
            need["old_logps"] = (mb.old_logps, (n,), f"the rollout weights' log-prob of each of its {n} target tokens")
        for name, (t, shape, what) in need.items():
            if t is None or tuple(t.shape) != shape:
                got = "none" if t is None else f"shape {tuple(t.shape)}"
                raise ValueError(f"micro-batch {m}: objective grpo needs {name}, {what} (got {got})")


class GRPOStep:
    """One train_step's grpo head: each micro-batch's Σ w_r·l_t into the step's loss, the metric sums (objective.
    GRPO_METRICS, kl with kl_beta > 0, and "tokens": the completion tokens they are sums over), the gradient of every
    micro-batch's head."""

    def __init__(self, obj: Objective, device: torch.device):
        self.obj = obj
        keys = ("tokens", *GRPO_METRICS, *(("kl",) if obj.kl_beta > 0 else ()))
        self.metrics: dict[str, torch.Tensor] = {k: torch.zeros((), dtype=torch.float32, device=device) for k in keys}

    def head(self, final_norm, h: torch.Tensor, mb: MicroBatch, norm_w, lm_w, norm_grad, lm_grad, chunk: int,
             kernels: HeadKernels, softcap: float | None, loss_sum: torch.Tensor) -> torch.Tensor:
        """Adds the micro-batch's share of the step's loss to `loss_sum`; returns d(loss)/d h."""
        T = self.obj.temperature
        logp = token_logps(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, chunk, kernels, softcap, T)
        rows = target_rows(mb)
        leaf = logp.detach().requires_grad_(True)
        with torch.enable_grad():
            loss, metrics = grpo_token_loss(self.obj, leaf, mb.old_logps, mb.ref_token_logps,
                                            mb.advantages.index_select(0, rows), mb.row_weight.index_select(0, rows))
            (dlogp,) = torch.autograd.grad(loss, leaf)
        loss_sum += loss.detach()
        for k, v in metrics.items():
            self.metrics[k] += v
        self.metrics["tokens"] += mb.num_targets
        _, dh = head_loss(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, norm_grad, lm_grad, -dlogp,
                          chunk, kernels, softcap, T)  # a token's loss is -logp_t
        return dh
