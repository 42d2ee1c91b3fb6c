"""OLMo 2: the Llama-style decoder with post-norms and full-width q/k norms, as transformers' modeling_olmo2 does.

- no input norm: attention and MLP read the residual stream itself; their outputs are normalised before the residual
  adds (post_attention_layernorm, post_feedforward_layernorm);
- q_norm / k_norm: RMSNorms over the whole projected q (heads · head_dim) and k (kv_heads · head_dim), before the
  head split and rope;
- Olmo2RMSNorm scales in fp32 and casts after (`(weight * x32).to(dtype)`), unlike Llama's `weight * x32.to(dtype)`;
- Olmo2RotaryEmbedding returns cos/sin in fp32 (no cast) and apply_rotary_pos_emb casts the rotated q, k back to
  their dtype: in bf16 the rotation is computed in fp32, so the contexts here carry fp32 cos/sin;
- attention_bias: q/k/v/o biases (before the q/k norms), as Olmo2Attention; the MLP has none.

Refused, by config.json key: rope types other than decoder.STATIC_ROPE_TYPES, a partial_rotary_factor other than 1
(transformers' OLMo 2 rotates whole heads), attention_dropout > 0 (megatrain has no dropout), clip_qkv (OLMo 1's
option; transformers' OLMo 2 does not clip), activations other than silu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import AttnContext, TensorSpec, Unit
from .decoder import STATIC_ROPE_TYPES, DecoderAdapter, rotate_half, static_rope


def olmo2_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Olmo2RMSNorm: normalise in fp32, scale by the weight in fp32, then cast back."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x32).to(dtype)


class Olmo2Adapter(DecoderAdapter):
    def __init__(self, hf_config):
        c = hf_config
        if float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0:
            raise MegatrainError(f"config.json: attention_dropout {c.attention_dropout} is not supported for olmo2 "
                                 "(megatrain has no dropout; set it to 0.0)")
        if getattr(c, "clip_qkv", None) is not None:
            raise MegatrainError("config.json: clip_qkv is not supported for olmo2 (transformers' OLMo 2 does not "
                                 "clip q/k/v)")
        super().__init__(c)  # hidden_act (silu only), sizes, attention_bias, rope (via _init_rope below)
        self.qk_norm = "full"
        self.mlp_bias = False  # Olmo2MLP has none, whatever config.json says

    def _init_rope(self, c) -> None:
        params = getattr(c, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise MegatrainError(f"config.json: rope_parameters.rope_type '{rope_type}' is not supported for olmo2; "
                                 f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        factor = params.get("partial_rotary_factor", 1.0)
        if factor is not None and float(factor) != 1.0:
            raise MegatrainError(f"config.json: rope_parameters.partial_rotary_factor {factor} is not supported for "
                                 "olmo2 (only 1.0: transformers' OLMo 2 rotates whole heads)")
        inv, scaling = static_rope(c, params)  # as transformers' Olmo2RotaryEmbedding
        self.inv_freq = inv.detach().float().clone()
        self.rope_scaling = float(scaling)

    # ---- tensor layout -------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        H = self.hidden_size
        units = super().units()
        out = [units[0]]
        for u in units[1:-1]:
            p = f"model.layers.{u.index}."
            specs = [s for s in u.specs if s.name != "input_layernorm.weight"]
            specs.append(TensorSpec("post_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight",
                                    (H,), decay=False, init="ones"))
            out.append(Unit("layer", u.index, tuple(specs)))
        out.append(units[-1])
        return out

    # ---- computation ---------------------------------------------------------------------------
    def make_context(self, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> AttnContext:
        """cos/sin stay fp32, as Olmo2RotaryEmbedding returns them (the rotation casts back to q's dtype)."""
        return super().make_context(position_ids, torch.float32, packed)

    def qkv(self, w: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """No input norm: q, k, v of the residual stream itself, q/k normalised over all heads, rotated in fp32
        (the fp32 cos/sin) and cast back."""
        q = F.linear(h, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = F.linear(h, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = F.linear(h, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        q = olmo2_norm(q, w["self_attn.q_norm.weight"], self.eps)
        k = olmo2_norm(k, w["self_attn.k_norm.weight"], self.eps)
        lead = h.shape[:-1]
        q, k, v = (t.view(*lead, -1, self.head_dim) for t in (q, k, v))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return (q * cos + rotate_half(q) * sin).to(v.dtype), (k * cos + rotate_half(k) * sin).to(v.dtype), v

    def attn_output(self, w: dict[str, torch.Tensor], o: torch.Tensor) -> torch.Tensor:
        """o_proj, then the post-norm of the attention's output (post_attention_layernorm)."""
        o = F.linear(o, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
        return olmo2_norm(o, w["post_attention_layernorm.weight"], self.eps)

    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        x = F.silu(F.linear(h, w["mlp.gate_proj.weight"])) * F.linear(h, w["mlp.up_proj.weight"])
        m = F.linear(x, w["mlp.down_proj.weight"])
        return h + olmo2_norm(m, w["post_feedforward_layernorm.weight"], self.eps)

    def final_norm(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return olmo2_norm(h, w, self.eps)
