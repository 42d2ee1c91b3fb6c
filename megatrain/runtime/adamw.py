"""CPU AdamW per tile, the pieces a tile is updated in, global-norm clipping and learning-rate schedules.

Each tile is laid out decayed tensors first (matrices, embeddings), then the rest (norms, biases), so one tile
is two contiguous segments: AdamW with weight decay on the first, without on the second. The update runs in
cache-sized chunks and writes the streaming copy of each chunk right after updating it, while it is hot in
cache: one pass over the tile, not an update pass plus a cast pass.
"""

from __future__ import annotations

import math

import torch

from .tile import LayerTile

# Elements per fused call: 16 MiB of fp32 state per array stays in the last-level cache. Calls always cover
# absolute CHUNK-aligned blocks of a tile: the kernel's rounding depends on how its range is split (vector body
# vs scalar tail), so an update in pieces whose boundaries are multiples of CHUNK is bit-identical to one call
# per tile.
CHUNK = 1 << 20
PIECE_MAX = 64 << 20  # elements per landing buffer


def landing_piece(max_unit_numel: int) -> int:
    """Elements per landing buffer: the largest unit rounded down to CHUNK (pieces on CHUNK boundaries keep
    a piecewise update bit-identical to a whole-tile one), at least one CHUNK, at most PIECE_MAX (256 MiB: copies
    that large run at full PCIe bandwidth, and two buffers cost 0.5 GiB of host memory however large the layers).
    The optimizer pipeline lands and updates gradients in pieces of this size; the SSD tier reads and writes them."""
    return min(PIECE_MAX, max(CHUNK, max_unit_numel // CHUNK * CHUNK))


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then constant, linear or cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = lr * min_lr_ratio
    if schedule == "linear":
        return floor + (lr - floor) * (1.0 - progress)
    if schedule == "cosine":
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}")


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """As torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below one."""
    if not max_norm or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class CpuAdamW:
    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 chunks_per_call: int = 1):
        """chunks_per_call: CHUNK blocks per kernel call (a list of them, each its own tensor, so the same ranges and
        the same numbers), then their streaming copies in one call. More is fewer returns to Python, each of which
        must take the GIL back from the engine's launch thread; one is each block's copy written while it is hot in
        cache (profile.adamw_chunks_per_call)."""
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.chunks_per_call = max(1, int(chunks_per_call))

    def update(self, tile: LayerTile, grad: torch.Tensor, *, lr: float, clip_coef: float = 1.0,
               offset: int = 0, new_step: bool = True, states: dict[str, torch.Tensor] | None = None) -> None:
        """One exact AdamW step of `tile[offset : offset + len(grad)]` from its fp32 host gradient `grad`.

        A tile may be updated in pieces (large embeddings pass through bounded landing buffers): the first
        piece of a step has new_step=True and advances the tile's step count. The gradient is read as
        grad * clip_coef (folded into the kernel's grad_scale, no extra pass). The streaming copy is rewritten
        chunk by chunk in the same pass.
        states: the piece's states kept elsewhere than the tile (the SSD tier's cache: 'master', 'exp_avg',
        'exp_avg_sq' -> fp32 tensors of len(grad) elements), used instead of the tile's own. The kernel's calls
        cover the same ranges either way, so the result is bit-identical.
        """
        assert grad.dtype == torch.float32 and grad.device.type == "cpu"
        assert 0 <= offset and offset + grad.numel() <= tile.numel
        if new_step:
            tile.step += 1
        # _fused_adamw_ divides the gradient by grad_scale: clipping is multiplying by clip_coef.
        grad_scale = None if clip_coef == 1.0 else torch.tensor(1.0 / clip_coef, dtype=torch.float32)
        split = tile.unit.decay_numel
        n = offset + grad.numel()
        states = states or {}
        # each state as a flat tensor of this piece, indexed from `offset`
        master, exp_avg, exp_avg_sq = (states[k] if k in states else getattr(tile, k)[offset:n]
                                       for k in ("master", "exp_avg", "exp_avg_sq"))
        separate_copy = tile.master is None or tile.stream.data_ptr() != tile.master.data_ptr()
        start = offset
        while start < n:
            blocks = []  # this call's CHUNK-aligned blocks: (start, end)
            while start < n and len(blocks) < self.chunks_per_call:
                end = min(n, (start // CHUNK + 1) * CHUNK)
                blocks.append((start, end))
                start = end
            for wd, ranges in ((self.weight_decay, [(a, min(b, split)) for a, b in blocks]),
                               (0.0, [(max(a, split), b) for a, b in blocks])):
                ranges = [(a - offset, b - offset) for a, b in ranges if a < b]
                if not ranges:
                    continue
                torch._fused_adamw_(
                    [master[p:q] for p, q in ranges], [grad[p:q] for p, q in ranges],
                    [exp_avg[p:q] for p, q in ranges], [exp_avg_sq[p:q] for p, q in ranges], [],
                    [tile.step] * len(ranges), lr=lr, beta1=self.beta1, beta2=self.beta2, weight_decay=wd,
                    eps=self.eps, amsgrad=False, maximize=False, grad_scale=grad_scale, found_inf=None,
                )
            if separate_copy and len(blocks) == 1:
                (a, b), = blocks
                tile.stream[a:b].copy_(master[a - offset:b - offset])
            elif separate_copy:
                torch._foreach_copy_([tile.stream[a:b] for a, b in blocks],
                                     [master[a - offset:b - offset] for a, b in blocks])
