"""The Llama-style decoder shared by llama, mistral, qwen2 (q/k/v bias) and qwen3 (q/k RMSNorm).

`DecoderAdapter.layer_forward` is the stateless layer template: a pure function of a dict of weight views and
the hidden states, numerically the same as transformers' `*DecoderLayer` (RMSNorm in fp32, rope, SDPA, SwiGLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .attention import attention_context, causal_attention
from .base import AttnContext, ModelAdapter, TensorSpec, Unit
from .window import layer_kinds as window_layer_kinds
from .window import sliding_window

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def static_rope(c, params: dict, partial: bool = False, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) of one set of rope parameters, as the families' rotary embeddings compute them:
    'default' and 'linear' by their formulas, here (importing transformers' rope functions loads its core: seconds,
    on every `megatrain plan`), the other types by transformers.modeling_rope_utils' functions, which those classes
    call. `partial`: the family's default type rotates head_dim x partial_rotary_factor dimensions (phi3; llama's,
    gemma's and olmo2's ignore the factor; the linear type always applies it). tests/test_rope_direct.py compares
    each family's tables with its transformers class."""
    rope_type = params.get("rope_type", "default")
    if rope_type in ("default", "linear"):
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        dim = int(head_dim * params.get("partial_rotary_factor", 1.0)) if partial or rope_type == "linear" \
            else head_dim
        inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return (inv if rope_type == "default" else inv / params["factor"]), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fn = ROPE_INIT_FUNCTIONS[rope_type]
    return fn(c, layer_type=layer_type) if layer_type is not None else fn(c)


def llama_rope(c) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention scaling) as transformers' LlamaRotaryEmbedding(c) computes them, without importing
    modeling_llama (seconds: it loads transformers' modeling_utils). tests/test_rope_direct.py compares the two."""
    return static_rope(c, c.rope_parameters)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    # As transformers' LlamaRMSNorm: normalise in fp32, cast back, then scale in the input dtype.
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DecoderAdapter(ModelAdapter):
    def __init__(self, hf_config):
        c = hf_config
        self.hf_config = c
        self.model_type = c.model_type
        if getattr(c, "hidden_act", "silu") != "silu":
            raise MegatrainError(f"config.json: hidden_act '{c.hidden_act}' is not supported (only 'silu')")
        self.num_layers = c.num_hidden_layers
        self.hidden_size = c.hidden_size
        self.vocab_size = c.vocab_size
        self.intermediate_size = c.intermediate_size
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.tied = bool(getattr(c, "tie_word_embeddings", False))
        if self.model_type == "qwen2":
            self.qkv_bias, self.o_bias = True, False
        else:
            bias = bool(getattr(c, "attention_bias", False))
            self.qkv_bias = self.o_bias = bias
        self.mlp_bias = bool(getattr(c, "mlp_bias", False))
        self.qk_norm = "head" if self.model_type == "qwen3" else None  # q/k RMSNorm: per head, or "full" (olmoe)
        self.sliding_window = sliding_window(c)  # None where the family's transformers model ignores the key
        self._init_rope(c)

    @property
    def layer_kinds(self) -> list[str]:
        """"sliding" for the layers transformers runs with the sliding window, else "full" (models/window.py: which
        families apply it, to which layers)."""
        return window_layer_kinds(self.hf_config, self.sliding_window, self.num_layers)

    def _init_rope(self, c) -> None:
        """The rope type checked; inv_freq and rope_scaling computed when first read (__getattr__): transformers'
        modeling module takes seconds to import, and the planner's meta-device runs need only their shapes."""
        params = getattr(c, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise MegatrainError(
                f"config.json: rope_type '{rope_type}' is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
            )

    def __getattr__(self, name: str):
        """inv_freq and rope_scaling of the llama-style rope, made on first use (families that compute their own in
        _init_rope set them as attributes, never reaching this)."""
        if name not in ("inv_freq", "rope_scaling") or "hf_config" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        inv_freq, scaling = llama_rope(self.hf_config)
        self.inv_freq = inv_freq.detach().float().clone()
        self.rope_scaling = float(scaling)
        return self.__dict__[name]

    # ---- tensor layout -------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        H, I = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim

        def spec(name, hf, shape, init):
            return TensorSpec(name, hf, tuple(shape), decay=(init == "normal"), init=init)

        units = [Unit("embed", -1, (spec("weight", "model.embed_tokens.weight", (self.vocab_size, H), "normal"),))]
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            mats = [
                ("self_attn.q_proj.weight", (q, H)),
                ("self_attn.k_proj.weight", (kv, H)),
                ("self_attn.v_proj.weight", (kv, H)),
                ("self_attn.o_proj.weight", (H, q)),
                ("mlp.gate_proj.weight", (I, H)),
                ("mlp.up_proj.weight", (I, H)),
                ("mlp.down_proj.weight", (H, I)),
            ]
            rest = [("input_layernorm.weight", (H,), "ones"), ("post_attention_layernorm.weight", (H,), "ones")]
            if self.qk_norm:
                qn, kn = (q, kv) if self.qk_norm == "full" else (self.head_dim, self.head_dim)
                rest += [("self_attn.q_norm.weight", (qn,), "ones"), ("self_attn.k_norm.weight", (kn,), "ones")]
            if self.qkv_bias:
                rest += [("self_attn.q_proj.bias", (q,), "zeros"), ("self_attn.k_proj.bias", (kv,), "zeros"),
                         ("self_attn.v_proj.bias", (kv,), "zeros")]
            if self.o_bias:
                rest += [("self_attn.o_proj.bias", (H,), "zeros")]
            if self.mlp_bias:
                rest += [("mlp.gate_proj.bias", (I,), "zeros"), ("mlp.up_proj.bias", (I,), "zeros"),
                         ("mlp.down_proj.bias", (H,), "zeros")]
            specs = [spec(n, p + n, s, "normal") for n, s in mats] + [spec(n, p + n, s, init) for n, s, init in rest]
            units.append(Unit("layer", i, tuple(specs)))
        head = [spec("lm_head.weight", "lm_head.weight", (self.vocab_size, H), "normal")] if not self.tied else []
        head.append(spec("norm.weight", "model.norm.weight", (H,), "ones"))
        units.append(Unit("head", -1, tuple(head)))
        return units

    # ---- computation ---------------------------------------------------------------------------
    def rope(self, position_ids: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor | None = None,
             scaling: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, rotary dims] as transformers computes them: fp32, scaled, then cast."""
        if inv_freq is None and position_ids.device.type == "meta" and "inv_freq" not in self.__dict__:
            inv_freq = torch.empty(self.head_dim // 2, device="meta")  # only shapes matter there
            scaling = 1.0 if scaling is None else scaling
        inv = (self.inv_freq if inv_freq is None else inv_freq).to(position_ids.device)
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rope_scaling if scaling is None else scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def make_context(self, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> AttnContext:
        """cos/sin as transformers computes them (fp32, then cast), a document mask when rows are packed, and for
        sliding-window layers a variant whose mask also bounds how far back a query sees."""
        cos, sin = self.rope(position_ids, dtype)
        ctx = attention_context(position_ids, cos, sin, packed, None, head_dim=self.head_dim)
        if "sliding" in self.layer_kinds:
            ctx.variants["sliding"] = attention_context(position_ids, cos, sin, packed, self.sliding_window,
                                                        head_dim=self.head_dim)
        return ctx

    def layer_forward(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx: AttnContext):
        """The layer: `attention_part`, then `mlp_part` over its output. runtime/layer.py may run both over tiles of
        tokens (memory.seq_tile): the attention part's per-token pieces (`qkv` before the attention, `attn_out` after
        it) and the MLP part. Families override those pieces, not this: one that overrides this, attention_part or
        attention_block runs them whole (`splits_layer`, `splits_attention`)."""
        return self.mlp_reduce(self.mlp_part(w, self.attention_part(w, h, ctx), ctx.token_mask))

    @property
    def splits_layer(self) -> bool:
        """Whether layer_forward is attention_part then mlp_part, so the MLP part may run over token tiles."""
        return type(self).layer_forward is DecoderAdapter.layer_forward

    @property
    def splits_attention(self) -> bool:
        """Whether attention_part is qkv, attend and attn_out, so the first and last may run over token tiles."""
        return self.splits_layer and type(self).attention_part is DecoderAdapter.attention_part and \
            type(self).attention_block is DecoderAdapter.attention_block

    def attention_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The part of the layer that mixes tokens: h plus the attention branch, [B, T, H]."""
        return h + self.attention_block(w, h, ctx)

    def attention_block(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """The attention branch of a layer (input norm through o_proj), before its residual add: `qkv` token by
        token, `attend` over the rows, `attn_output` token by token."""
        B, T, _ = h.shape
        q, k, v = self.qkv(w, h, ctx.cos, ctx.sin)
        o = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), ctx)
        return self.attn_output(w, o.transpose(1, 2).reshape(B, T, -1))

    def qkv(self, w: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [..., heads, head_dim], k and v [..., kv_heads, head_dim] of h [..., H]'s tokens (a [B, T, H] row or a
        [n, H] tile), rope applied with cos, sin [..., rotary dims] of the same tokens. Per token."""
        x = rms_norm(h, w["input_layernorm.weight"], self.eps)
        q = F.linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = F.linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = F.linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        if self.qk_norm == "full":  # olmoe: RMSNorm over all heads' q (and k) at once, before the head split
            q = rms_norm(q, w["self_attn.q_norm.weight"], self.eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], self.eps)
        lead = h.shape[:-1]
        q, k, v = (t.view(*lead, -1, self.head_dim) for t in (q, k, v))
        if self.qk_norm == "head":  # qwen3: per head
            q = rms_norm(q, w["self_attn.q_norm.weight"], self.eps)
            k = rms_norm(k, w["self_attn.k_norm.weight"], self.eps)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # shared by the heads
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def attn_output(self, w: dict[str, torch.Tensor], o: torch.Tensor) -> torch.Tensor:
        """The attention branch's output for o [..., heads · head_dim] (the heads' outputs of some tokens): o_proj.
        Per token."""
        return F.linear(o, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))

    def attn_out(self, w: dict[str, torch.Tensor], h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """attention_part's output for some tokens, from their inputs h and their heads' outputs o."""
        return h + self.attn_output(w, o)

    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None):
        """The rest of the layer, token by token: for h [..., H] (a [B, T, H] row, or a [n, H] tile of its tokens),
        the layer's output for those tokens. `token_mask` (real tokens, h's leading shape, or None) is for MoE
        router statistics. Every op is per token, so a tile's rows equal the same rows of the whole."""
        x = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
        gate = F.linear(x, w["mlp.gate_proj.weight"], w.get("mlp.gate_proj.bias"))
        up = F.linear(x, w["mlp.up_proj.weight"], w.get("mlp.up_proj.bias"))
        return h + F.linear(F.silu(gate) * up, w["mlp.down_proj.weight"], w.get("mlp.down_proj.bias"))

    def mlp_reduce(self, out):
        """layer_forward's result from mlp_part's over all tokens (MoE: the router statistics summed)."""
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        """Causal attention of q [B, heads, T, d] over k, v [B, kv_heads, T, d] (rope applied), within documents
        when rows are packed, within the window for sliding layers. Returns [B, heads, T, d]."""
        return causal_attention(q, k, v, ctx, self.head_dim**-0.5)

    def final_norm(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, w, self.eps)
