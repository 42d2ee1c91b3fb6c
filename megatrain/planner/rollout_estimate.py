"""What a rollout phase costs, from config.json and the machine profile alone: the KV cache, the device bytes of the
mode, a decode step's time and what binds it, the prefill, tokens/s.

resident: a decode step reads every weight once from HBM plus the live rows' KV cache, and runs 2 x active
parameters FLOPs per row plus the attention over the cache: max(bytes / ROLLOUT_HBM_BPS, FLOPs / (peak x
ROLLOUT_DECODE_EFFICIENCY)); the prefill's matmuls run at ROLLOUT_MATMUL_EFFICIENCY of the peak. streamed: the
decoder layers' bf16 bytes cross the bus once per step, so max(layer bytes / the profile's H2D rate, the same
compute); with kv_on_host the cache crosses it too. Each step adds ROLLOUT_STEP_OVERHEAD_S, except a streamed step
bound by the bus, whose host work runs while the layers cross it. Every row is assumed to run max_new tokens (rows
that end early make the real rollout faster)."""

from __future__ import annotations

from ..models import get_adapter
from .calibration import (ROLLOUT_DECODE_EFFICIENCY, ROLLOUT_HBM_BPS, ROLLOUT_MATMUL_EFFICIENCY,
                          ROLLOUT_STEP_OVERHEAD_S)

BF16 = 2


def hbm_bps(gpu_name: str) -> float:
    for key in sorted(ROLLOUT_HBM_BPS, key=len, reverse=True):
        if key != "default" and key.lower() in gpu_name.lower():
            return ROLLOUT_HBM_BPS[key]
    return ROLLOUT_HBM_BPS["default"]


def kv_bytes_per_row(hf_config, tokens: int) -> int:
    """bf16 keys and values of one row of `tokens` positions over every layer (sliding layers: their window)."""
    c = hf_config.get_text_config(decoder=True)
    heads = c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    hd = getattr(c, "head_dim", None) or c.hidden_size // heads
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers
    per_pos = 2 * kv * hd * BF16
    return sum(per_pos * (min(tokens, window) if t == "sliding_attention" and window else tokens) for t in types)


def rollout_estimate(hf_config, seqs: int, prompt_len: int, max_new: int, mode: str, profile,
                     kv_on_host: bool = False) -> dict:
    """The rollout of `seqs` rows (prompts x n) of `prompt_len` prompt tokens and `max_new` new ones in `mode`
    ("resident" | "streamed") on the machine `profile` describes (planner/profile.Profile)."""
    if mode not in ("resident", "streamed"):
        raise ValueError(f"rollout mode: {mode!r} is not resident or streamed")
    adapter = get_adapter(hf_config)
    units = adapter.units()
    weights = sum(u.numel for u in units) * BF16
    layers = sum(u.numel for u in units if u.kind == "layer") * BF16
    active = sum(adapter.active_numel(u) for u in units if u.kind != "embed")
    c = hf_config.get_text_config(decoder=True)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    attn_width = c.num_attention_heads * hd * c.num_hidden_layers
    total = prompt_len + max_new
    kv_bytes = seqs * kv_bytes_per_row(hf_config, total)
    kv_mean = seqs * kv_bytes_per_row(hf_config, prompt_len + max_new // 2)  # what an average step reads
    peak_bf16 = profile.peak_bf16 or profile.matmul_flops
    peak = peak_bf16 * ROLLOUT_MATMUL_EFFICIENCY
    ctx = prompt_len + max_new / 2
    step_flops = seqs * (2 * active + 4 * ctx * attn_width)
    compute_s = step_flops / (peak_bf16 * ROLLOUT_DECODE_EFFICIENCY)
    hbm = hbm_bps(profile.gpu_name)
    if mode == "resident":
        resident = weights + (0 if kv_on_host else kv_bytes)
        memory_s = (weights + (0 if kv_on_host else kv_mean)) / hbm
        bus_s = kv_mean / profile.h2d_bps if kv_on_host else 0.0
        parts = {"hbm": memory_s, "compute": compute_s, "bus": bus_s}
    else:
        biggest = max(u.numel for u in units if u.kind == "layer") * BF16
        resident = weights - layers + 2 * biggest + (0 if kv_on_host else kv_bytes)
        bus_s = (layers + (kv_mean if kv_on_host else 0)) / profile.h2d_bps
        parts = {"bus": bus_s, "compute": compute_s, "hbm": (0 if kv_on_host else kv_mean) / hbm}
    bound = max(parts, key=parts.get)
    decode_step_s = parts[bound] + ROLLOUT_STEP_OVERHEAD_S
    if mode == "streamed" and bound == "bus":  # the host's work of a step runs while the layers cross the bus
        decode_step_s = max(parts["bus"], max(parts["compute"], parts["hbm"]) + ROLLOUT_STEP_OVERHEAD_S)
    prefill_s = seqs * prompt_len * (2 * active + 2 * prompt_len * attn_width) / peak
    if mode == "streamed":
        prefill_s = max(prefill_s, layers / profile.h2d_bps)
    seconds = prefill_s + max_new * decode_step_s
    return dict(kv_bytes=int(kv_bytes), resident_bytes=int(resident), decode_step_s=decode_step_s,
                prefill_s=prefill_s, tokens_per_s=seqs * max_new / seconds, bound=bound, seconds=seconds,
                weight_bytes=int(weights), layer_bytes=int(layers))
