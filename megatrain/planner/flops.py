"""FLOP counting for throughput reports."""

from __future__ import annotations


def flops_per_token(adapter, seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token: (6·N with N all parameters, as the MegaTrain paper counts; model FLOPs for MFU).

    Model FLOPs = 6 per parameter that multiplies (all but an untied input embedding, a lookup; in a MoE layer
    only the top-k experts) plus causal attention, 6·layers·heads·head_dim·seq (12·L·d·seq halved by the causal mask). Recompute is not counted.
    """
    units = adapter.units()
    n = sum(u.numel for u in units)
    active = sum(adapter.active_numel(u) for u in units)  # a MoE layer: its top-k experts only
    lookup = 0 if adapter.tied else sum(u.numel for u in units if u.kind == "embed")
    attn = 6 * adapter.num_layers * adapter.num_heads * adapter.head_dim * attention_span(adapter, seq_len)
    return 6.0 * n, 6.0 * (active - lookup) + attn


def active_params(adapter) -> int:
    """Parameters that multiply each token (all of them in a dense model; a MoE's top-k experts of E)."""
    return sum(adapter.active_numel(u) for u in adapter.units())


def kind_span(adapter, kind: str, seq_len: int) -> float:
    """Twice the keys a query of a layer of `kind` attends to on average over positions: `seq_len` for causal
    attention (T/2 keys per query), 2W - W²/T for a sliding window W < T (W keys once the window is full)."""
    window = getattr(adapter, "sliding_window", None)
    if kind != "sliding" or window is None or seq_len <= window:
        return float(seq_len)
    return 2.0 * window - window * window / seq_len


def attention_span(adapter, seq_len: int) -> float:
    """`kind_span` averaged over the layers. Attention FLOPs per token scale with it."""
    kinds = adapter.layer_kinds
    return sum(kind_span(adapter, k, seq_len) for k in kinds) / len(kinds)
