"""Gemma 2 and Gemma 3 (text): the Llama-style decoder with Gemma's differences, as transformers computes them.

- RMSNorm scales by (1 + weight), in fp32 before the cast back (weights start at zero);
- sandwich norms: the attention and MLP outputs are normalised before their residual adds (post_attention_layernorm,
  post_feedforward_layernorm), the MLP input by pre_feedforward_layernorm;
- GELU (tanh approximation) gating, attention scaled by query_pre_attn_scalar**-0.5;
- the embedding's output times sqrt(hidden_size), rounded to the weight's dtype;
- layer_types: sliding-window and full-attention layers; Gemma 3 gives each kind its own RoPE (rope_parameters per
  layer type) and q/k RMSNorms per head; Gemma 2 caps attention scores (attn_logit_softcapping) and the final
  logits (final_logit_softcapping) with c·tanh(x/c).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import AttnContext, TensorSpec, Unit
from .attention import META_AS_CUDA, attention_context, causal_attention, flex_kernel_options, softcap_score
from .decoder import STATIC_ROPE_TYPES, DecoderAdapter, rotate_half, static_rope
from .window import sliding_window

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


def gemma_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Gemma*RMSNorm: normalise in fp32, scale by (1 + w) in fp32, then cast back."""
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


class GemmaAdapter(DecoderAdapter):
    def __init__(self, hf_config):  # noqa: D107 - DecoderAdapter.__init__ is not called: its checks are Llama's
        c = hf_config
        self.hf_config = c
        self.model_type = c.model_type
        self.gemma3 = c.model_type == "gemma3_text"
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
        if act not in ACTIVATIONS:
            raise MegatrainError(f"config.json: hidden_activation '{act}' is not supported for {c.model_type} "
                                 f"(supported: {', '.join(ACTIVATIONS)})")
        if getattr(c, "use_bidirectional_attention", False):
            raise MegatrainError("config.json: use_bidirectional_attention is not supported (causal LM training)")
        if getattr(c, "attention_dropout", 0.0):
            raise MegatrainError("config.json: attention_dropout must be 0 (megatrain has no dropout)")
        self.num_layers = c.num_hidden_layers
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.intermediate_size = c.intermediate_size
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.tied = bool(getattr(c, "tie_word_embeddings", True))
        self.qkv_bias = self.o_bias = bool(getattr(c, "attention_bias", False))
        self.mlp_bias = False
        self.qk_norm = "head" if self.gemma3 else None
        self.scale = float(c.query_pre_attn_scalar) ** -0.5
        self.attn_softcap = getattr(c, "attn_logit_softcapping", None)
        self.attention_score = "plain" if self.attn_softcap is None else "softcap"
        self.score_mod = None if self.attn_softcap is None else softcap_score(float(self.attn_softcap))
        self.logit_softcap = getattr(c, "final_logit_softcapping", None)
        self.embed_scale = c.hidden_size**0.5
        self.sliding_window = sliding_window(c)
        self._init_gemma_rope(c)

    def _init_gemma_rope(self, c) -> None:
        """inv_freq and attention scaling per layer kind, as transformers' Gemma2/Gemma3RotaryEmbedding compute them
        (decoder.static_rope: Gemma 3 has parameters per layer type)."""
        params = getattr(c, "rope_parameters", None) or {}
        per_kind = self.gemma3 and isinstance(params.get("full_attention"), dict)
        for name, p in (params.items() if per_kind else [("rope_parameters", params)]):
            rope_type = (p or {}).get("rope_type", "default")
            if rope_type not in STATIC_ROPE_TYPES:
                raise MegatrainError(f"config.json: rope_parameters {name}: rope_type '{rope_type}' is not supported; "
                                     f"supported: {', '.join(STATIC_ROPE_TYPES)}")
        self.ropes: dict[str, tuple[torch.Tensor, float]] = {}
        for kind, layer_type in (("full", "full_attention"), ("sliding", "sliding_attention")):
            p = params.get(layer_type) if per_kind else params
            if per_kind and p is None:  # (a layer type without its own parameters: as transformers, none)
                continue
            inv, scaling = static_rope(c, p, layer_type=layer_type if per_kind else None)
            self.ropes[kind] = (inv.detach().float().clone(), float(scaling))
        self.inv_freq, self.rope_scaling = self.ropes["full"]

    # ---- tensor layout -------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        units = super().units()
        H = self.hidden_size
        for u in units[1:-1]:
            p = f"model.layers.{u.index}."
            extra = [TensorSpec(n, p + n, (H,), decay=False, init="zeros")
                     for n in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")]
            # Gemma's norm weights are offsets from 1: they start at zero
            specs = [TensorSpec(s.name, s.hf_name, s.shape, s.decay, "zeros") if "norm" in s.name else s
                     for s in u.specs] + extra
            units[u.index + 1] = Unit("layer", u.index, tuple(specs))
        head = units[-1]
        units[-1] = Unit("head", -1, tuple(TensorSpec(s.name, s.hf_name, s.shape, s.decay, "zeros")
                                           if s.name == "norm.weight" else s for s in head.specs))
        return units

    # ---- computation ---------------------------------------------------------------------------
    def make_context(self, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> AttnContext:
        """A context per layer kind: its RoPE (Gemma 3: another base for sliding layers) and its mask. With
        attention soft-capping on CUDA every kind carries a FlexAttention block mask (the score cap needs it)."""
        kinds = set(self.layer_kinds)
        need_mask = self.attn_softcap is not None and position_ids.is_cuda
        options = flex_kernel_options("softcap", self.head_dim, position_ids.device) if need_mask else None
        ctxs = {}
        for kind in kinds:
            inv, scaling = self.ropes[kind]
            cos, sin = self.rope(position_ids, dtype, inv, scaling)
            window = self.sliding_window if kind == "sliding" else None
            ctxs[kind] = attention_context(position_ids, cos, sin, packed, window, force_mask=need_mask,
                                           head_dim=self.head_dim, flex_options=options)
        base = ctxs.pop("full", None)
        if base is None:  # every layer slides: a base context no layer uses, holding the sliding one
            base = dataclasses.replace(ctxs["sliding"], variants={})
        base.variants.update(ctxs)
        return base

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        if self.attn_softcap is None:
            return causal_attention(q, k, v, ctx, self.scale)
        cap = float(self.attn_softcap)
        if ctx.block_mask is not None:
            return causal_attention(q, k, v, ctx, self.scale, score_mod=self.score_mod)
        if q.is_meta and META_AS_CUDA[0]:  # the planner's stand-in for FlexAttention on CUDA: what the
            return causal_attention(q, k, v, ctx, self.scale)  # fused kernels allocate, not the T x T scores below
        # explicit, as transformers' eager attention: scores, cap, mask, softmax in fp32, cast back
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scale
        scores = torch.tanh(scores / cap) * cap
        T = q.shape[2]
        mask = ctx.mask if ctx.mask is not None else torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)

    def qkv(self, w: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        x = gemma_norm(h, w["input_layernorm.weight"], self.eps)
        q = F.linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = F.linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = F.linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        lead = h.shape[:-1]
        q, k, v = (t.view(*lead, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm:
            q = gemma_norm(q, w["self_attn.q_norm.weight"], self.eps)
            k = gemma_norm(k, w["self_attn.k_norm.weight"], self.eps)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attn_output(self, w: dict[str, torch.Tensor], o: torch.Tensor) -> torch.Tensor:
        """o_proj, then the sandwich norm of the attention's output (post_attention_layernorm)."""
        o = F.linear(o, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))
        return gemma_norm(o, w["post_attention_layernorm.weight"], self.eps)

    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
        x = gemma_norm(h, w["pre_feedforward_layernorm.weight"], self.eps)
        m = F.gelu(F.linear(x, w["mlp.gate_proj.weight"]), approximate="tanh") * F.linear(x, w["mlp.up_proj.weight"])
        return h + gemma_norm(F.linear(m, w["mlp.down_proj.weight"]), w["post_feedforward_layernorm.weight"], self.eps)

    def final_norm(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return gemma_norm(h, w, self.eps)
