"""Cross-entropy of one chunk of LM-head logits and its gradient in one Triton kernel (CUDA).

One program per row: a first pass over the row's logits computes the log-sum-exp online (fp32), a second pass
writes (softmax - onehot) * scale over the logits in place, in their own dtype. The logits are read twice and
written once (6 bytes per bf16 logit) where the eager version makes an fp32 copy and runs several passes over it
(~10 ms of a ~29 ms chunk of 4096 x 128,256 on the H200). Rows whose target is negative contribute zero loss and a
zero gradient. `lmhead.ce_loss_and_grad` calls this on CUDA and the eager version elsewhere; the two are compared
on the GPU by bench/head_attn_variants.py.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: lmhead never calls in here
    triton = None

BLOCK = 4096

if triton is not None:

    @triton.jit
    def _ce_rows(logits, row_stride, targets, losses, scale, V, BLOCK: tl.constexpr, PER_ROW: tl.constexpr = False,
                 GRAD: tl.constexpr = True):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        t = tl.load(targets + row)
        valid = t >= 0
        t_safe = tl.where(valid, t, 0)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for off in range(0, V, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
        x_t = tl.load(base + t_safe).to(tl.float32)
        tl.store(losses + row, tl.where(valid, lse - x_t, 0.0))
        if GRAD:
            if PER_ROW:
                coef = tl.where(valid, tl.load(scale + row), 0.0)
            else:
                coef = tl.where(valid, tl.load(scale), 0.0)
            for off in range(0, V, BLOCK):
                cols = off + tl.arange(0, BLOCK)
                inside = cols < V
                x = tl.load(base + cols, mask=inside, other=0.0).to(tl.float32)
                g = tl.exp(x - lse) - tl.where(cols == t_safe, 1.0, 0.0)
                tl.store(base + cols, (g * coef).to(base.dtype.element_ty), mask=inside)


def available(logits: torch.Tensor) -> bool:
    return (triton is not None and logits.is_cuda and logits.dim() == 2 and logits.stride(1) == 1
            and logits.dtype in (torch.bfloat16, torch.float16, torch.float32))


def ce_loss_and_grad_(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
    """(sum of token losses in fp32, the gradient written over `logits`) for logits [n, V] and targets [n]; scale:
    0-d (every row's), or [n] (a weight per row: PER_ROW, a preference loss's gradient)."""
    n, V = logits.shape
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    if scale.dim() == 0:
        scale = scale.to(device=logits.device, dtype=torch.float32).reshape(1)
        _ce_rows[(n,)](logits, logits.stride(0), targets.contiguous(), losses, scale, V, BLOCK=BLOCK, num_warps=16)
    else:
        scale = scale.to(device=logits.device, dtype=torch.float32).contiguous()
        _ce_rows[(n,)](logits, logits.stride(0), targets.contiguous(), losses, scale, V, BLOCK=BLOCK, PER_ROW=True,
                       num_warps=16)
    return losses.sum(), logits


def ce_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's token loss (fp32 [n], 0 where the target is negative): the kernel's first pass alone, the logits
    left untouched."""
    n, V = logits.shape
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    _ce_rows[(n,)](logits, logits.stride(0), targets.contiguous(), losses, losses, V, BLOCK=BLOCK, GRAD=False,
                   num_warps=16)
    return losses
