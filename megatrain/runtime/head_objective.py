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

A pair's loss needs only its own two rows, so when every pair's targets fit in one chunk (`pair_chunks`: from the
host micro-batch, no device sync) the head takes one pass instead: chunks of whole pairs, each chunk's logits
computed once, its pairs' log-probs, loss and row weights from them, then the weighted gradient over the same
logits. That saves pass 1's GEMM (a third of the head's GEMMs). Pairs longer than a chunk take the two passes.

GRPO (`GRPOStep`) is the same two passes with a loss per token instead of per row: pass 1 keeps each target's
log p, objective.grpo_token_loss runs on that [num_targets] vector, and pass 2 scales each token's cross-entropy
gradient by -d(step loss)/d(logp_t). Each row's advantage and weight w_r are given (MicroBatch), so a micro-batch's
share of the step's loss needs nothing of the other micro-batches.
"""

from __future__ import annotations

import torch

from .lmhead import HeadKernels, ce_loss_and_grad, ce_token_losses, head_backward, head_loss, softcap_logits
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
    (B, T), rows = mb.input_ids.shape, target_rows(mb)
    tok = token_logps(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, chunk, kernels, softcap)
    return row_sums(tok, mb.target_index, B, T), torch.bincount(rows, minlength=B)


def row_sums(values: torch.Tensor, index: torch.Tensor, rows: int, T: int) -> torch.Tensor:
    """Each row's sum of `values`, which sit at the distinct flat positions `index` of a [rows, T] batch, always
    added in the same order: placed in a dense [rows, T] and summed along T. (index_add_ adds with atomics on CUDA,
    in whatever order they land, so a row's sum changed in its last bits from one run to the next.)"""
    dense = torch.zeros(rows * T, dtype=values.dtype, device=values.device)
    dense[index] = values
    return dense.view(rows, T).sum(1)


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


def pair_chunks(mb: MicroBatch, chunk: int) -> list[tuple[int, int, int, int]] | None:
    """The one-pass head's chunks of a host micro-batch: (first target, end target, first row, end row) of
    consecutive whole pairs holding at most `chunk` targets together; None when a pair alone holds more, or none
    (the two-pass head then)."""
    B = mb.input_ids.shape[0]
    per_row = torch.bincount(target_rows(mb), minlength=B).tolist()
    out, a, r0, n = [], 0, 0, 0
    for r in range(0, B, 2):
        k = per_row[r] + per_row[r + 1]
        if k > chunk or k == 0:
            return None
        if n + k > chunk:
            out.append((a, a + n, r0, r))
            a, r0, n = a + n, r, 0
        n += k
    out.append((a, a + n, r0, B))
    return out


class PreferenceStep:
    """One train_step's preference head: its micro-batches' losses into the step's loss, their metric sums, the
    gradient of every micro-batch's head. pairs, chosen: the step's (all micro-batches, all ranks). host: the
    step's micro-batches as given (host tensors), in the order the engine runs their heads: where the pairs fit a
    chunk, the head takes one pass (pair_chunks)."""

    def __init__(self, obj: Objective, pairs: int, chosen: int, device: torch.device,
                 host: list[MicroBatch] | None = None):
        self.obj, self.inv_pairs = obj, 1.0 / pairs
        self.nll_scale = 1.0 / max(chosen, 1) if obj.name == "orpo" else 0.0
        self.pairs_step = pairs
        self.metrics: dict[str, torch.Tensor] = {"pairs": torch.zeros((), dtype=torch.float32, device=device)}
        self.host, self.calls = host or [], 0

    def head(self, final_norm, h: torch.Tensor, mb: MicroBatch, norm_w, lm_w, norm_grad, lm_grad, chunk: int,
             kernels: HeadKernels, softcap: float | None, loss_sum: torch.Tensor) -> torch.Tensor:
        """Adds the micro-batch's share of the step's loss to `loss_sum`; returns d(loss)/d h."""
        host = self.host[self.calls] if self.calls < len(self.host) else None
        self.calls += 1
        spans = pair_chunks(host, chunk) if host is not None and host.input_ids.shape == mb.input_ids.shape \
            and host.num_targets == mb.num_targets else None
        self.metrics["pairs"] += mb.input_ids.shape[0] // 2
        if spans is not None:
            return self._one_pass(final_norm, h, mb, spans, norm_w, lm_w, norm_grad, lm_grad, kernels, softcap,
                                  loss_sum)
        logp, n = row_logps(final_norm, h, mb, norm_w, lm_w, chunk, kernels, softcap)
        weight = self._row_weights(logp, n, mb.ref_logps, loss_sum)
        _, dh = head_loss(final_norm, h, mb.target_index, mb.targets, norm_w, lm_w, norm_grad, lm_grad,
                          weight.index_select(0, target_rows(mb)), chunk, kernels, softcap)
        return dh

    def _row_weights(self, logp: torch.Tensor, n: torch.Tensor, ref: torch.Tensor | None,
                     loss_sum: torch.Tensor) -> torch.Tensor:
        """The pairs of these rows (logp, n, ref: [2P]): their losses into `loss_sum`, their metric sums; each row's
        weight, -d(step loss)/d(logp[row]) (a token's loss is -log p)."""
        leaf = logp.detach().requires_grad_(True)
        with torch.enable_grad():
            loss, metrics = pair_loss(self.obj, leaf, n, ref)
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
        return weight

    def _one_pass(self, final_norm, h: torch.Tensor, mb: MicroBatch, spans, norm_w, lm_w, norm_grad, lm_grad,
                  kernels: HeadKernels, softcap: float | None, loss_sum: torch.Tensor) -> torch.Tensor:
        """The head over chunks of whole pairs (pair_chunks), each chunk's logits computed once (lmhead.head_backward):
        the pairs' row weights come from the chunk's own log-probs, then weight its tokens' gradients."""
        row_of, T = target_rows(mb), mb.input_ids.shape[1]

        def chunk_grad(span: tuple[int, int, int, int], logits: torch.Tensor) -> torch.Tensor:
            a, b, r0, r1 = span
            y, local = mb.targets[a:b], row_of[a:b] - r0
            tok = -ce_token_losses(logits, y, kernel=kernels.fused_ce)  # the logits left as they are
            logp = row_sums(tok, mb.target_index[a:b] - r0 * T, r1 - r0, T)
            n = torch.bincount(local, minlength=r1 - r0)
            ref = None if mb.ref_logps is None else mb.ref_logps[r0:r1]
            weight = self._row_weights(logp, n, ref, loss_sum)
            return ce_loss_and_grad(logits, y, weight.index_select(0, local), kernel=kernels.fused_ce)[1]

        chunks = [(mb.target_index[span[0]:span[1]], span) for span in spans]
        return head_backward(final_norm, h, chunks, norm_w, lm_w, norm_grad, lm_grad, kernels, softcap, chunk_grad)


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
