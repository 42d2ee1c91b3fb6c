"""Cross-entropy of one chunk of LM-head logits, with its gradient, in one pass over the logits.

Written as a plain function so the engine can torch.compile it: the compiled version reads the bf16 logits twice
(the log-sum-exp, then the softmax) and writes the bf16 gradient once, where the eager version makes fp32 copies
and several passes. Rows whose target is -100 (padding of a fixed-size chunk) contribute nothing.
"""

from __future__ import annotations

import torch


def ce_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """(sum of token losses, d(loss * scale)/d logits in logits.dtype) for logits [n, V] and targets [n]."""
    lf = logits.float()
    valid = targets >= 0
    safe = targets.clamp_min(0)
    lse = torch.logsumexp(lf, dim=-1)
    loss = torch.where(valid, lse - lf.gather(1, safe[:, None]).squeeze(1), 0.0).sum()
    # softmax - onehot, scaled, in place on the fp32 copy: eager holds one fp32 chunk, as before compiling
    grad = lf.sub_(lse[:, None]).exp_()
    grad.scatter_add_(1, safe[:, None], torch.full_like(lse, -1.0)[:, None])
    grad.mul_((valid.float() * scale)[:, None])
    return loss, grad.to(logits.dtype)
