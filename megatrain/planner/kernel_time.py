"""What a layer's attention kernel other than SDPA's causal one (FlexAttention, the variable-length flash kernel)
costs beyond SDPA's over the same FLOPs: each kernel's measured rate per executed FLOP as a share of SDPA's, by the
span its rows attend over (calibration.KERNEL_RATE), and SDPA's own kernel rates (SDPA_RATE). The planner's attention
rate (profile.attention_rate) is SDPA's whole attention in a layer, fitted to runs; timing.step_time adds this on
top."""

from __future__ import annotations

import math

from .calibration import KERNEL_RATE, SDPA_RATE
from .flops import kind_span
from .workload import Workload


def kernel_share(kernel: str, score: str, head_dim: int, span: float) -> tuple[float, float]:
    """The rate of `kernel` ("flex" or "varlen") with `score` per FLOP it executes, as a share of SDPA's causal rate,
    in a forward and in a forward + backward, over rows attending `span` tokens per token (KERNEL_RATE: the nearest
    head_dim measured, log-linear in the span between its points, flat beyond; a score measured only at another
    head_dim: plain's share at this one times the score's over plain's there)."""
    def nearest(sc: str):
        dims = [d for k, s, d in KERNEL_RATE if k == kernel and s == sc]
        return min(dims, key=lambda d: abs(math.log2(d / head_dim))) if dims else None

    def at(sc: str, d: int) -> tuple[float, float]:
        return _log_linear(KERNEL_RATE[(kernel, sc, d)], span)

    plain = at("plain", nearest("plain"))
    there = nearest(score)
    if score == "plain" or there is None:
        return plain
    scored, base = at(score, there), at("plain", there)
    return plain[0] * scored[0] / base[0], plain[1] * scored[1] / base[1]


def _log_linear(pts, x: float) -> tuple[float, ...]:
    """The values of points (x, v1, v2, ...) sorted by x at x: log-linear between points, flat beyond."""
    if x <= pts[0][0]:
        return tuple(pts[0][1:])
    for p0, p1 in zip(pts, pts[1:]):
        if x <= p1[0]:
            f = math.log(x / p0[0]) / math.log(p1[0] / p0[0])
            return tuple(a + f * (b - a) for a, b in zip(p0[1:], p1[1:]))
    return tuple(pts[-1][1:])


def sdpa_rate(head_dim: int, seq: float) -> tuple[float, float]:
    """SDPA's causal kernel's forward and forward + backward FLOP/s over rows of `seq` tokens (SDPA_RATE: the
    nearest head_dim measured)."""
    return _log_linear(SDPA_RATE[min(SDPA_RATE, key=lambda d: abs(math.log2(d / head_dim)))], seq)


def kernel_extra(adapter, w: Workload) -> tuple[float, float]:
    """Seconds per token and layer (averaged over the layers) that the layers' FlexAttention or varlen kernel takes
    beyond SDPA's over the same FLOPs, in a forward and in a forward + backward: each such layer's attention FLOPs at
    its span (the rows' documents' for packed rows once known, a window's) at kernel_share of SDPA_RATE
    (ModelAdapter.cuda_attention picks the kernel by the row's length: 0 where every layer runs SDPA's)."""
    f = fb = 0.0
    for kind in adapter.layer_kinds:
        kernel, score = adapter.cuda_attention(kind, w.seq_len, w.packed)
        if kernel == "flash":
            continue
        span = kind_span(adapter, kind, w.span_len)
        share_f, share_fb = kernel_share(kernel, score, adapter.head_dim, span)
        rate_f, rate_fb = sdpa_rate(adapter.head_dim, span)
        flops = 2.0 * span * adapter.num_heads * adapter.head_dim  # a token's forward
        f, fb = f + flops * (1.0 / share_f - 1.0) / rate_f, fb + 3.5 * flops * (1.0 / share_fb - 1.0) / rate_fb
    n = len(adapter.layer_kinds)
    return f / n, fb / n
