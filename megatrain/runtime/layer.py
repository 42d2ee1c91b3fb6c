"""One decoder layer's backward for one micro-batch, as the engine runs it: recompute from the layer's input
checkpoint, local autograd, fp32 gradient accumulation. A plain function, so the engine, the probe (which times
it) and the planner (which measures its memory on the meta device) all run the same code."""

from __future__ import annotations

from typing import Callable

import torch


def layer_backward(layer_fn: Callable, w: dict[str, torch.Tensor], checkpoint: torch.Tensor, ctx,
                   dh: torch.Tensor, grad_views: list[torch.Tensor], extra_grad: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Recompute `layer_fn(w, checkpoint, ctx)` with autograd and backpropagate `dh` through it: each weight's
    gradient is added to its fp32 view in `grad_views` (spec order); returns d(checkpoint). A MoE layer returns
    (h, router probability sum, counts): `extra_grad` (the router loss's gradient with respect to that sum, or None
    without one) flows back through the sum as well."""
    params = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    x = checkpoint.detach().requires_grad_(True)
    with torch.enable_grad():
        out = layer_fn(params, x, ctx)
        outs, douts = (out, dh) if not isinstance(out, tuple) else \
            ((out[0], out[1]), (dh, extra_grad)) if extra_grad is not None else (out[0], dh)
        grads = torch.autograd.grad(outs, [x, *params.values()], douts)
    for acc, g in zip(grad_views, grads[1:]):
        acc.add_(g)
    return grads[0]
