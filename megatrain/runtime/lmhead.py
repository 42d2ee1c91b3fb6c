"""The LM head: final norm + LM head + cross-entropy with its backward, over chunks of target tokens, so full
logits never exist (docs/design.md, rule 7). `head_loss` is a plain function: the engine runs it in every step, the
probe times it and the planner measures its memory with it on the meta device.

On CUDA the cross-entropy is one Triton kernel (ce_triton.py) that writes the gradient over the logits, and the
LM head's fp32 weight gradient is accumulated inside its GEMM; elsewhere one fp32 copy of the chunk is made and
turned into the gradient in place (n·V·(2 + 4 + 2) bytes), and the product is added to the accumulator. Which
kernels run is the caller's explicit `HeadKernels`. Rows whose target is -100 contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# Logits per chunk: 1 GiB in bf16 (2 GiB as the eager version's fp32 copy). The Llama-3.1-8B head with the eager
# cross-entropy on an H200 (bench/head_attn_variants.py): 4096 rows 463 TFLOP/s, 2048 rows 447, 512 rows 357.
CHUNK_LOGITS = 1 << 29
CHUNK_ALIGN = 256  # rows per chunk a multiple of the GEMM tile: no ragged last tile in every chunk


def default_chunk(vocab: int) -> int:
    """Target tokens per LM-head chunk: CHUNK_LOGITS logits, rounded down to a multiple of 256 rows."""
    return max(CHUNK_ALIGN, CHUNK_LOGITS // vocab // CHUNK_ALIGN * CHUNK_ALIGN)


def fusable_dtypes(acc: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `accumulate_matmul` can fold the fp32 accumulation into the GEMM (addmm with out_dtype, a CUDA
    kernel; its meta kernel lets the planner simulate it)."""
    return acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)


_fused_failed: list[str] = []  # set once when this torch build refuses the fused form; then the plain form is used


def accumulate_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fused: bool) -> None:
    """acc += a @ b, acc in fp32 and a, b in the compute dtype. Fused: one GEMM that reads and writes acc with
    fp32 accumulation (no bf16 product of acc's size, no separate add); else the product, then an add."""
    if fused and not _fused_failed:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError) as e:  # an older torch without addmm(out_dtype=...) on this device
            _fused_failed.append(str(e).splitlines()[0])
    acc.add_(a @ b)


_triton_failed: list[str] = []  # set once if the kernel cannot be built here; then the eager version is used


def ce_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, kernel: bool = True):
    """(sum of token losses, d(loss * scale)/d logits in logits.dtype) for logits [n, V] and targets [n]; `scale` a
    0-d tensor, or [n]: a weight per row (the gradient of a preference loss, head_objective.py).
    kernel: use the fused CUDA kernel where it can run (it writes the gradient over `logits`); on the meta device
    (the planner's memory simulation) its allocations are mimicked."""
    if kernel and not _triton_failed:
        if logits.is_meta:  # what the kernel allocates: one fp32 loss per row; the gradient reuses the logits
            return torch.empty(logits.shape[0], dtype=torch.float32, device="meta").sum(), logits
        from . import ce_triton  # (imports triton: not for the planner's meta runs)

        if ce_triton.available(logits):
            try:
                return ce_triton.ce_loss_and_grad_(logits, targets, scale)
            except Exception as e:  # a Triton build failure happens before anything is written
                _triton_failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                import warnings

                warnings.warn(f"megatrain: the fused cross-entropy kernel failed ({_triton_failed[0]}); "
                              "using the eager version")
    return _ce_eager(logits, targets, scale)


def ce_token_losses(logits: torch.Tensor, targets: torch.Tensor, kernel: bool = True) -> torch.Tensor:
    """Each row's token loss (logsumexp - the target's logit, fp32 [n]; 0 where the target is -100), forward only:
    the logits are left as they are (the fused kernel's first pass alone on CUDA; eager elsewhere)."""
    if kernel and not _triton_failed and not logits.is_meta:
        from . import ce_triton

        if ce_triton.available(logits):
            try:
                return ce_triton.ce_token_losses(logits, targets)
            except Exception as e:  # a Triton build failure: the eager version, as for ce_loss_and_grad
                _triton_failed.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    lf = logits.float()
    valid = targets >= 0
    picked = lf.gather(1, targets.clamp_min(0)[:, None]).squeeze(1)
    return torch.where(valid, torch.logsumexp(lf, dim=-1) - picked, 0.0)


def _ce_eager(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor):
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


def softcap_logits(z: torch.Tensor, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(softcap·tanh(z/softcap), the tanh) in z's dtype as transformers computes gemma2's capped logits; (z, None)
    without a cap."""
    if softcap is None:
        return z, None
    t = torch.tanh(z / softcap)
    return t * softcap, t


@dataclass(frozen=True)
class HeadKernels:
    """Which LM-head kernels run: the fused cross-entropy (Triton, CUDA) and the in-GEMM fp32 accumulation of the
    weight gradient (addmm with out_dtype). Both on CUDA by default, neither elsewhere."""

    fused_ce: bool
    fused_accumulate: bool

    @classmethod
    def for_device(cls, device: torch.device | str) -> "HeadKernels":
        cuda = torch.device(device).type == "cuda"
        return cls(fused_ce=cuda, fused_accumulate=cuda)


def head_loss(final_norm: Callable, h: torch.Tensor, target_index: torch.Tensor, targets: torch.Tensor,
              norm_w: torch.Tensor, lm_w: torch.Tensor, norm_grad: torch.Tensor, lm_grad: torch.Tensor,
              scale: float | torch.Tensor, chunk: int, kernels: HeadKernels, softcap: float | None = None,
              temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Final norm + LM head + cross-entropy over one micro-batch's target positions (`target_index` into the
    flattened [B*T] hidden states `h`, predicting `targets`), never holding more than `chunk` rows of logits.
    Returns (sum of token losses * scale, d(loss * scale)/d h) and accumulates the norm's and the LM head's
    fp32 gradients into `norm_grad` and `lm_grad`. With `softcap` (gemma2's final_logit_softcapping) the logits
    are capped as softcap·tanh(logits/softcap) before the loss, and the gradient goes back through the tanh.
    `scale` may be a per-target fp32 tensor [n] (each token's weight in a preference loss): the gradient is then
    d(Σ scale·token loss)/d h and the returned loss the plain sum of token losses. `temperature` (grpo: the
    sampling temperature, as TRL's GRPOTrainer divides the logits by it) divides the (capped) logits before the loss."""
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    per_target = isinstance(scale, torch.Tensor)
    scale_t = scale if per_target else torch.full((), scale, dtype=torch.float32, device=h.device)  # no host sync

    def chunk_grad(a: int, logits: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            logits = logits / temperature
        chunk_loss, dlogits = ce_loss_and_grad(logits, targets[a: a + chunk],
                                               scale_t[a: a + chunk] if per_target else scale_t,
                                               kernel=kernels.fused_ce)
        loss.add_(chunk_loss)
        return dlogits / temperature if temperature != 1.0 else dlogits  # d(z/T)/dz = 1/T

    chunks = [(target_index[a: a + chunk], a) for a in range(0, target_index.shape[0], chunk)]
    dh = head_backward(final_norm, h, chunks, norm_w, lm_w, norm_grad, lm_grad, kernels, softcap, chunk_grad)
    return (loss if per_target else loss * scale), dh


def head_backward(final_norm: Callable, h: torch.Tensor, chunks: list, norm_w: torch.Tensor, lm_w: torch.Tensor,
                  norm_grad: torch.Tensor, lm_grad: torch.Tensor, kernels: HeadKernels, softcap: float | None,
                  chunk_grad: Callable) -> torch.Tensor:
    """The final norm and LM head over `chunks` ((rows of the flattened [B*T] hidden states `h`, a key) each), one
    chunk's logits at a time: `chunk_grad(key, logits)` turns the chunk's (capped) logits into d(loss)/d(logits),
    which goes back through the cap, the head and the norm. Accumulates the fp32 gradients into `norm_grad` and
    `lm_grad`; returns d(loss)/d h. The norm runs chunk by chunk too: nothing of [targets, H] beyond d(hidden)
    is ever held, and a chunk's logits are freed before its backward's matmuls."""
    H = h.shape[-1]
    rows = h.reshape(-1, H)
    nw = norm_w.detach().requires_grad_(True)
    dh = torch.zeros_like(h)
    d_rows = dh.view(-1, H)
    fused = kernels.fused_accumulate and fusable_dtypes(lm_grad, h)
    for index, key in chunks:
        x = rows.index_select(0, index).detach().requires_grad_(True)
        with torch.enable_grad():
            xn = final_norm(nw, x)
        xc = xn.detach()
        logits, tanh = softcap_logits(xc @ lm_w.t(), softcap)
        dlogits = chunk_grad(key, logits)
        if tanh is not None:  # d(c·tanh(z/c))/dz = 1 - tanh²
            dlogits = dlogits * (1 - tanh * tanh)
        del logits, tanh
        d_xn = dlogits @ lm_w
        accumulate_matmul(lm_grad, dlogits.t(), xc, fused)
        del dlogits, xc
        dx, dnw = torch.autograd.grad(xn, [x, nw], d_xn)
        del xn, x, d_xn
        norm_grad.add_(dnw)
        d_rows.index_copy_(0, index, dx)
        del dx, dnw
    return dh
