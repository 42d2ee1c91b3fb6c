"""Phi-3: the Llama-style decoder with fused projections and partial rotary, as transformers' modeling_phi3 computes it.

- `self_attn.qkv_proj.weight` [q + 2·kv, H] (q rows, then k, then v) and `mlp.gate_up_proj.weight` [2·I, H] (gate
  rows, then up: Phi3MLP's `gate, up = gate_up_proj(x).chunk(2, dim=-1)`) stay fused as the checkpoint stores them,
  so loading and export are plain; layer_forward splits row views of them;
- rope on the first head_dim · partial_rotary_factor dimensions of each head (Phi3RotaryEmbedding computes inv_freq
  over that many dimensions; apply_rotary_pos_emb rotates them and passes the rest through);
- RMSNorm as Llama's (fp32 normalise, cast back, scale in the input dtype); a sliding window over every layer when
  config.json sets sliding_window (create_sliding_window_causal_mask), as DecoderAdapter reads it.

Refused, by config.json key: rope types other than decoder.STATIC_ROPE_TYPES (longrope: its factors switch with the
sequence length), dropout (resid_pdrop, embd_pdrop, attention_dropout: megatrain has none), biases (Phi-3 has none),
activations other than silu.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import TensorSpec, Unit
from .decoder import STATIC_ROPE_TYPES, DecoderAdapter, rms_norm, rotate_half, static_rope

DROPOUT_KEYS = ("resid_pdrop", "embd_pdrop", "attention_dropout")
BIAS_KEYS = ("attention_bias", "mlp_bias")


class Phi3Adapter(DecoderAdapter):
    def __init__(self, hf_config):
        c = hf_config
        for key in DROPOUT_KEYS:
            if float(getattr(c, key, 0.0) or 0.0) > 0:
                raise MegatrainError(f"config.json: {key} {getattr(c, key)} is not supported for phi3 "
                                     "(megatrain has no dropout; set it to 0.0)")
        for key in BIAS_KEYS:
            if getattr(c, key, None):
                raise MegatrainError(f"config.json: {key} is set, but phi3 has no biases (transformers' Phi3 "
                                     "builds its projections without them)")
        super().__init__(c)  # hidden_act (silu only), sizes, sliding_window, rope (via _init_rope below)
        self.qkv_bias = self.o_bias = self.mlp_bias = False
        self.qk_norm = None

    def _init_rope(self, c) -> None:
        """inv_freq and attention scaling as transformers' Phi3RotaryEmbedding (partial_rotary_factor applied)."""
        params = getattr(c, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise MegatrainError(f"config.json: rope_parameters.rope_type '{rope_type}' is not supported for phi3; "
                                 f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        factor = float(params.get("partial_rotary_factor", 1.0) or 1.0)
        inv, scaling = static_rope(c, params, partial=True)
        self.inv_freq = inv.detach().float().clone()
        self.rope_scaling = float(scaling)
        self.rotary_dim = 2 * self.inv_freq.numel()
        if self.rotary_dim > self.head_dim:
            raise MegatrainError(f"config.json: rope_parameters.partial_rotary_factor {factor} gives "
                                 f"{self.rotary_dim} rotary dimensions for head_dim {self.head_dim}")

    # ---- tensor layout -------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        H, I = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        units = super().units()
        out = [units[0]]
        for u in units[1:-1]:
            p = f"model.layers.{u.index}."
            mats = [("self_attn.qkv_proj.weight", (q + 2 * kv, H)), ("self_attn.o_proj.weight", (H, q)),
                    ("mlp.gate_up_proj.weight", (2 * I, H)), ("mlp.down_proj.weight", (H, I))]
            norms = ("input_layernorm.weight", "post_attention_layernorm.weight")
            specs = [TensorSpec(n, p + n, s, decay=True, init="normal") for n, s in mats]
            specs += [TensorSpec(n, p + n, (H,), decay=False, init="ones") for n in norms]
            out.append(Unit("layer", u.index, tuple(specs)))
        out.append(units[-1])
        return out

    # ---- computation ---------------------------------------------------------------------------
    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """transformers' Phi3 apply_rotary_pos_emb: rotate the first rotary_dim dimensions, pass the rest."""
        if self.rotary_dim == self.head_dim:
            return x * cos + rotate_half(x) * sin
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def qkv(self, w: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        x = rms_norm(h, w["input_layernorm.weight"], self.eps)
        qkv = F.linear(x, w["self_attn.qkv_proj.weight"])
        q = qkv[..., :q_rows]
        k = qkv[..., q_rows: q_rows + kv_rows]
        v = qkv[..., q_rows + kv_rows:]
        lead = h.shape[:-1]
        q, k, v = (t.reshape(*lead, -1, self.head_dim) for t in (q, k, v))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin), v

    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        x = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
        gate, up = F.linear(x, w["mlp.gate_up_proj.weight"]).chunk(2, dim=-1)
        return h + F.linear(up * F.silu(gate), w["mlp.down_proj.weight"])
