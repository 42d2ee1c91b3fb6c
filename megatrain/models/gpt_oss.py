"""gpt_oss (gpt-oss-20b, gpt-oss-120b): a mixture-of-experts decoder, as transformers' modeling_gpt_oss computes it.

- attention with q/k/v/o biases and a learned sink logit per head that joins every softmax denominator
  (models/attention.py: explicit on CPU, from FlexAttention's log-sum-exp on CUDA: o · σ(lse − sink));
- sliding-window and full-attention layers as config.json's layer_types says; rope (yarn for the published models)
  with inv_freq and attention scaling from transformers' GptOssRotaryEmbedding;
- RMSNorm scaling in fp32 before the cast back (GptOssRMSNorm: `(weight * x32).to(dtype)`);
- router: logits = x·Wᵀ + b, top-k of the logits, softmax over those k (in the model dtype); load-balancing loss from
  softmax of all logits (moe.router_statistics, runtime/router_loss.py), as load_balancing_loss_func;
- experts with biases, stored as transformers' parameters are: gate_up_proj [E, H, 2I] with gate and up columns
  interleaved (gate = [..., ::2], up = [..., 1::2]), down_proj [E, I, H], used as x @ W + b; clamped SwiGLU:
  gate ≤ limit, |up| ≤ limit, out = (up + 1) · gate · σ(alpha · gate). On CUDA in bf16 (and on the meta device, for
  the planner) two grouped GEMMs over the tokens sorted by expert (moe.sort_by_expert, moe.grouped_mm); on CPU and in
  fp32 the loop over the experts that were hit, in order, as transformers' eager experts.

Published checkpoints store the experts in MXFP4 (`*_blocks` uint8 [E, rows, cols/32, 16], two 4-bit values a
byte, and `*_scales` uint8 [E, rows, cols/32], a power-of-two exponent + 127 per 32 values): `packed_source` tells
the loader to dequantize them, layer by layer and expert by expert, with transformers' own
`convert_moe_packed_tensors`. Exports hold the dequantized weights (bf16 or fp32).

Refused, by config.json key: a quantization_config other than mxfp4, rope types whose frequencies change with the
sequence length, attention_dropout, layer_types other than full/sliding attention.
"""

from __future__ import annotations

from typing import Container

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .attention import attention_context, sink_attention
from .base import AttnContext, PackedTensor, TensorSpec, Unit
from .decoder import STATIC_ROPE_TYPES, DecoderAdapter, rotate_half
from .moe import MoEAdapter, combine, dispatch, grouped_mm, router_statistics, sort_by_expert

EXPERT_MATRICES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MXFP4_GROUP = 32  # values per scale (16 bytes of two 4-bit values)


def gpt_oss_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' GptOssRMSNorm: normalise in fp32, scale by the weight in fp32, then cast back."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (w * x32).to(x.dtype)


def clamped_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GptOssExperts._apply_gate on interleaved gate/up columns h [..., 2I] -> [..., I]."""
    gate, up = h[..., ::2], h[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def clamped_expert_ffn(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, w: dict[str, torch.Tensor],
                       alpha: float, limit: float) -> torch.Tensor:
    """Σ_k top_w[:, k] · expert_e(x) with e = top_i[:, k], expert_e(x) = swiglu(x @ gate_up[e] + b) @ down[e] + b,
    for x [N, H]. Grouped GEMMs on CUDA in bf16 (and on meta); the exact loop elsewhere."""
    args = (x, top_i, top_w, w["mlp.experts.gate_up_proj"], w["mlp.experts.gate_up_proj_bias"],
            w["mlp.experts.down_proj"], w["mlp.experts.down_proj_bias"], alpha, limit)
    if (x.is_cuda and x.dtype == torch.bfloat16) or x.is_meta:
        return _grouped_clamped_ffn(*args)
    return _looped_clamped_ffn(*args)


def _looped_clamped_ffn(x, top_i, top_w, gate_up, gate_up_b, down, down_b, alpha, limit):
    """transformers' eager GptOssExperts: the experts that were hit, in order, each over its tokens (host sync:
    CPU and fp32 only)."""
    out = torch.zeros_like(x)
    hit = torch.zeros(gate_up.shape[0], dtype=torch.bool, device=x.device)
    hit[top_i.reshape(-1)] = True
    for e in torch.nonzero(hit).flatten().tolist():
        token, slot = torch.where(top_i == e)
        h = x[token] @ gate_up[e] + gate_up_b[e]
        y = clamped_swiglu(h, alpha, limit) @ down[e] + down_b[e]
        out.index_add_(0, token, (y * top_w[token, slot, None]).to(out.dtype))
    return out


def _grouped_clamped_ffn(x, top_i, top_w, gate_up, gate_up_b, down, down_b, alpha, limit):
    """Two grouped GEMMs over the (token, slot) pairs sorted by expert, biases gathered per row (advanced indexing:
    its backward accumulates each expert's bias gradient in fp32 on CUDA), no host synchronisation."""
    order, inverse, offs = sort_by_expert(top_i, gate_up.shape[0])
    expert = top_i.reshape(-1)[order]
    h = grouped_mm(dispatch(x, top_i.shape[1], order, inverse), gate_up, offs) + gate_up_b[expert]  # [N·k, 2I]
    y = grouped_mm(clamped_swiglu(h, alpha, limit), down, offs) + down_b[expert]  # [N·k, H]
    return combine(y, top_w, order, inverse)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8 -> [..., G·32, rows] in `dtype`, as
    transformers dequantizes gpt_oss's experts (integrations.mxfp4.convert_moe_packed_tensors: low nibble first,
    value · 2^(scale − 127), then the last two dimensions swapped to the parameter's layout)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def _mxfp4_into(dest: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """PackedTensor.build for one expert matrix: dequantize expert by expert into dest [E, cols, rows]."""
    blocks, scales = tensors
    E, cols, rows = dest.shape
    want_b, want_s = (E, rows, cols // MXFP4_GROUP, 16), (E, rows, cols // MXFP4_GROUP)
    if cols % MXFP4_GROUP or tuple(blocks.shape) != want_b or tuple(scales.shape) != want_s:
        raise ValueError(f"shapes {list(blocks.shape)} and {list(scales.shape)}; config.json implies {list(want_b)} "
                         f"and {list(want_s)} (MXFP4 of a [{E}, {cols}, {rows}] tensor)")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"dtypes {blocks.dtype} and {scales.dtype}; MXFP4 blocks and scales are uint8")
    for e in range(E):  # one expert at a time: the transient is one expert's matrix, not the layer's
        dest[e].copy_(dequantize_mxfp4(blocks[e: e + 1], scales[e: e + 1], torch.float32)[0])


class GptOssAdapter(MoEAdapter):
    attention_score = "sinks"  # on CUDA every layer runs FlexAttention for its log-sum-exp (make_context)

    def __init__(self, hf_config):  # noqa: D107 - MoEAdapter.__init__ is not called: its family table is not gpt_oss's
        c = hf_config
        _refuse_unsupported(c)
        DecoderAdapter.__init__(self, c)  # sizes, q/k/v/o biases (attention_bias), sliding window, rope (below)
        self.qk_norm = None
        self.mlp_bias = False
        self.num_experts = int(c.num_local_experts)
        self.top_k = int(c.num_experts_per_tok)
        self.expert_intermediate = int(c.intermediate_size)
        self.router_aux_coef = float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)
        # transformers before 5.2x read neither key (its experts used 1.702 and 7.0, the keys' defaults since); a
        # config that sets another limit trains with it, as later transformers does
        self.alpha, self.limit = float(getattr(c, "swiglu_alpha", 1.702)), float(getattr(c, "swiglu_limit", 7.0))
        if self.top_k > self.num_experts:
            raise MegatrainError(f"config.json: num_experts_per_tok {self.top_k} exceeds the {self.num_experts} "
                                 "experts (num_local_experts)")

    def _init_rope(self, c) -> None:
        """The rope type checked; inv_freq and the attention scaling made on first use (DecoderAdapter.__getattr__:
        GptOssRotaryEmbedding's tables are llama_rope's). Importing modeling_gpt_oss here would load torch._dynamo
        and triton on every `megatrain plan`, and triton's bindings report leaked objects at the process's exit."""
        rope_type = (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise MegatrainError(f"config.json: rope_parameters.rope_type '{rope_type}' is not supported for gpt_oss; "
                                 f"supported: {', '.join(STATIC_ROPE_TYPES)}")

    # ---- tensor layout: transformers' parameters, names and shapes ------------------------------------------------
    def units(self) -> list[Unit]:
        units = DecoderAdapter.units(self)
        E, H, I = self.num_experts, self.hidden_size, self.expert_intermediate
        out = [units[0]]
        for u in units[1:-1]:
            p = f"model.layers.{u.index}."

            def spec(name, shape, decay, init):
                return TensorSpec(name, p + name, shape, decay=decay, init=init)

            attn = [s for s in u.specs if not s.name.startswith("mlp.")]  # q, k, v, o (+ biases), the two norms
            decayed = [s for s in attn if s.decay] + [
                spec("mlp.router.weight", (E, H), True, "normal"),
                spec("mlp.experts.gate_up_proj", (E, H, 2 * I), True, "normal"),
                spec("mlp.experts.down_proj", (E, I, H), True, "normal"),
            ]
            rest = [s for s in attn if not s.decay] + [
                spec("self_attn.sinks", (self.num_heads,), False, "normal"),
                spec("mlp.router.bias", (E,), False, "normal"),
                spec("mlp.experts.gate_up_proj_bias", (E, 2 * I), False, "zeros"),
                spec("mlp.experts.down_proj_bias", (E, H), False, "zeros"),
            ]
            out.append(Unit("layer", u.index, tuple(decayed + rest)))
        out.append(units[-1])
        return out

    def packed_source(self, spec: TensorSpec, available: Container[str]) -> PackedTensor | None:
        """An MXFP4 checkpoint's experts: `<name>_blocks` and `<name>_scales` instead of `<name>`."""
        if spec.name not in EXPERT_MATRICES or spec.hf_name in available:
            return None
        names = (spec.hf_name + "_blocks", spec.hf_name + "_scales")
        return PackedTensor(names, _mxfp4_into) if all(n in available for n in names) else None

    # ---- computation ---------------------------------------------------------------------------------------------
    def make_context(self, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> AttnContext:
        """cos/sin as transformers computes them; on CUDA every layer kind carries a FlexAttention block mask (the
        sinks need the kernel's log-sum-exp), full layers plain causal, sliding layers within the window."""
        cos, sin = self.rope(position_ids, dtype)
        force = position_ids.is_cuda
        ctx = attention_context(position_ids, cos, sin, packed, None, force_mask=force)
        if "sliding" in self.layer_kinds:
            ctx.variants["sliding"] = attention_context(position_ids, cos, sin, packed, self.sliding_window,
                                                        force_mask=force)
        return ctx

    def attention_block(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        B, T, _ = h.shape
        x = gpt_oss_norm(h, w["input_layernorm.weight"], self.eps)
        q = F.linear(x, w["self_attn.q_proj.weight"], w.get("self_attn.q_proj.bias"))
        k = F.linear(x, w["self_attn.k_proj.weight"], w.get("self_attn.k_proj.bias"))
        v = F.linear(x, w["self_attn.v_proj.weight"], w.get("self_attn.v_proj.bias"))
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = ctx.cos[:, None], ctx.sin[:, None]
        q = q * cos + rotate_half(q) * sin  # = transformers' first·cos − second·sin, second·cos + first·sin
        k = k * cos + rotate_half(k) * sin
        o = sink_attention(q, k, v, w["self_attn.sinks"], ctx, self.head_dim**-0.5)
        o = o.transpose(1, 2).reshape(B, T, -1)
        return F.linear(o, w["self_attn.o_proj.weight"], w.get("self_attn.o_proj.bias"))

    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None):
        """MoEAdapter's, with gpt-oss's norm: (output, router probabilities per token [n, E] fp32, zero on padding,
        top-k counts over real tokens [E] fp32) for h [..., H]; per token, so runtime/layer.py may tile it."""
        x = gpt_oss_norm(h, w["post_attention_layernorm.weight"], self.eps)
        y, token_probs, counts = self.moe_block(w, x, token_mask)
        return h + y, token_probs, counts

    def moe_block(self, w: dict[str, torch.Tensor], x: torch.Tensor, token_mask: torch.Tensor | None):
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat, w["mlp.router.weight"], w["mlp.router.bias"])  # [N, E], the model dtype
        top_v, top_i = torch.topk(logits, self.top_k, dim=-1)  # top-k of the logits, then softmax over those k
        top_w = torch.softmax(top_v, dim=1, dtype=top_v.dtype)
        y = clamped_expert_ffn(flat, top_i, top_w, w, self.alpha, self.limit)
        token_probs, counts = router_statistics(logits, top_i, token_mask, self.num_experts)
        return y.reshape(x.shape), token_probs, counts

    def final_norm(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return gpt_oss_norm(h, w, self.eps)


def _refuse_unsupported(c) -> None:
    quant = getattr(c, "quantization_config", None)
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if str(method) != "mxfp4":
            raise MegatrainError(f"config.json: quantization_config.quant_method '{method}' is not supported for "
                                 "gpt_oss (supported: mxfp4, dequantized while loading, or none)")
    if float(getattr(c, "attention_dropout", 0.0) or 0.0) > 0:
        raise MegatrainError(f"config.json: attention_dropout {c.attention_dropout} is not supported for gpt_oss "
                             "(megatrain has no dropout; set it to 0.0)")
