"""The variable-length kernel's call from a layer, outside any compiled graph (models/attention.causal_attention).

Its own module so that `torch.compiler.disable`, which imports torch._dynamo (seconds), runs when packed rows first
reach the kernel, not whenever the layer templates are imported (`megatrain plan` builds them, compiles nothing).
Imported inside a compiled layer's trace, dynamo imports it for real and sees the disabled function: a graph break.
"""

from __future__ import annotations

import torch

from .base import AttnContext
from .varlen import varlen_attention


@torch.compiler.disable
def varlen_call(q, k, v, ctx: AttnContext, scale: float) -> torch.Tensor:
    """The variable-length kernel, outside a compiled layer's graph: the segments' count and the longest differ
    from micro-batch to micro-batch, and a compiled graph would be rebuilt for each. Blocked for its backward
    (ctx.attn_block) like plain rows, the d(q) written over d(output) as blockwise_causal's."""
    return varlen_attention(q, k, v, ctx.cu_seqlens, ctx.max_seqlen, scale, ctx.window, block=ctx.attn_block,
                            grad_in_place=True)
