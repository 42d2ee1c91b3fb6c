"""Cross-entropy of one chunk of LM-head logits, with its gradient, in one pass over the logits.

One fp32 copy of the chunk is made and turned into the gradient in place, so a chunk costs n·V·(2 + 4 + 2) bytes.
Rows whose target is -100 contribute nothing. (A torch.compile'd version, with chunks padded to one shape, was
measured on the H200 and was no faster: the head's time is its three matmuls.)
"""

from __future__ import annotations

import torch

CHUNK_LOGITS = 1 << 29  # logits per chunk: 2 GiB in fp32 (H200, Llama-3.1-8B head: 2048 rows 433 TFLOP/s, 512 286)
CHUNK_ALIGN = 256  # rows per chunk a multiple of the GEMM tile: no ragged last tile in every chunk


def default_chunk(vocab: int) -> int:
    """Target tokens per LM-head chunk: ~2 GiB of fp32 logits, rounded down to a multiple of 256 rows."""
    return max(CHUNK_ALIGN, CHUNK_LOGITS // vocab // CHUNK_ALIGN * CHUNK_ALIGN)


def fused_accumulate_available(acc: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether `accumulate_matmul` can fold the fp32 accumulation into the GEMM (CUDA: addmm with out_dtype)."""
    return acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16)


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
