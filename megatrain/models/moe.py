"""Mixture-of-experts decoders: qwen3_moe, mixtral, olmoe. The MoE layer is one streamed unit (attention, router
and every expert in one tile), numerically as transformers computes it.

Routing: softmax of the router logits (fp32), top-k, renormalised where the family does (mixtral always,
qwen3_moe/olmoe by norm_topk_prob), cast to the model dtype. Experts: SwiGLU, weights stacked [E, 2, I, H] (gate,
up) and [E, H, I] (down) in the host store, split into the checkpoint's per-expert tensors on load and export
(TensorSpec.parts). On CUDA in bf16 the expert FFNs run as two grouped GEMMs over the tokens sorted by expert
(`torch._grouped_mm`, offsets computed on the device: no Python loop over experts, no host synchronisation); on CPU
(and fp32 on CUDA) a loop over the experts that were hit, in expert order, as transformers does.

The router load-balancing loss (transformers' load_balancing_loss_func with output_router_logits) couples layers:
aux = E · Σ_e F_e · P_e with F_e the fraction of routed (token, slot) pairs sent to expert e and P_e the mean
router probability of e, both over all MoE layers and the micro-batch's real tokens. A layer therefore returns,
besides its output, its sum of router probabilities over real tokens (differentiable) and its top-k counts; the
engine adds the layers' sums after the forward wave, and gives each layer's backward the gradient of aux with
respect to its probability sum, coefficient · E · F_e / (layers · tokens), which is constant within the step's
backward (F has no gradient). See runtime/router_loss.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import MegatrainError
from .base import TensorSpec, Unit
from .decoder import DecoderAdapter, rms_norm

# model_type -> (config key for the number of experts, module prefix in the checkpoint, router name,
#                expert tensor names in the checkpoint: gate, up, down)
FAMILIES = {
    "qwen3_moe": ("num_experts", "mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": ("num_experts", "mlp", "gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("num_local_experts", "block_sparse_moe", "gate", ("w1", "w3", "w2")),
}


class MoEAdapter(DecoderAdapter):
    moe = True

    def __init__(self, hf_config):
        c = hf_config
        super().__init__(c)
        if c.model_type == "qwen3_moe":
            self.qk_norm = "head"
        n_key, self.ckpt_prefix, self.router_name, self.expert_names = FAMILIES[c.model_type]
        self.num_experts = int(getattr(c, n_key))
        self.top_k = int(c.num_experts_per_tok)
        self.expert_intermediate = int(getattr(c, "moe_intermediate_size", None) or c.intermediate_size)
        self.norm_topk = True if c.model_type == "mixtral" else bool(getattr(c, "norm_topk_prob", False))
        self.router_aux_coef = float(getattr(c, "router_aux_loss_coef", 0.0) or 0.0)
        if c.model_type == "olmoe":
            self.qk_norm = "full"
            if getattr(c, "clip_qkv", None) is not None:
                raise MegatrainError("config.json: clip_qkv is not supported for olmoe")
        if getattr(c, "router_jitter_noise", 0.0):
            raise MegatrainError("config.json: router_jitter_noise must be 0 (megatrain's routing is deterministic)")
        if c.model_type == "qwen3_moe":
            step = getattr(c, "decoder_sparse_step", 1)
            dense = getattr(c, "mlp_only_layers", None) or []
            if step != 1 or dense:
                raise MegatrainError("config.json: decoder_sparse_step != 1 or mlp_only_layers (dense layers among "
                                     "the MoE ones) is not supported; every layer must be a MoE layer")
        if self.top_k > self.num_experts:
            raise MegatrainError(f"config.json: num_experts_per_tok {self.top_k} exceeds the {self.num_experts} experts")

    # ---- parameter counts for the planner ------------------------------------------------------------------
    def active_numel(self, unit: Unit) -> int:
        """A layer's parameters that multiply each token: all but the experts outside its top k."""
        experts = sum(s.numel for s in unit.specs if s.name.startswith("mlp.experts."))
        return unit.numel - experts + experts * self.top_k // self.num_experts

    # ---- tensor layout ------------------------------------------------------------------------------------
    def units(self) -> list[Unit]:
        units = super().units()
        E, H, I = self.num_experts, self.hidden_size, self.expert_intermediate
        gate, up, down = self.expert_names
        out = [units[0]]
        for u in units[1:-1]:
            p = f"model.layers.{u.index}."
            ck = f"{p}{self.ckpt_prefix}."
            attn = [s for s in u.specs if not s.name.startswith("mlp.")]
            router = f"{p}mlp.gate.weight"
            moe = [
                TensorSpec("mlp.gate.weight", router, (E, H), decay=True, init="normal",
                           parts=() if ck + "gate.weight" == router else (ck + "gate.weight",)),
                TensorSpec("mlp.experts.gate_up_proj", f"{p}mlp.experts.gate_up_proj", (E, 2, I, H), decay=True,
                           init="normal", parts=tuple(f"{ck}experts.{e}.{n}.weight" for e in range(E)
                                                      for n in (gate, up))),
                TensorSpec("mlp.experts.down_proj", f"{p}mlp.experts.down_proj", (E, H, I), decay=True,
                           init="normal", parts=tuple(f"{ck}experts.{e}.{down}.weight" for e in range(E))),
            ]
            decayed = [s for s in attn if s.decay] + moe
            rest = [s for s in attn if not s.decay]
            out.append(Unit("layer", u.index, tuple(decayed + rest)))
        out.append(units[-1])
        return out

    # ---- computation -------------------------------------------------------------------------------------
    # layer_forward (DecoderAdapter's): (output, router probability sum over real tokens [E] fp32, top-k counts
    # over real tokens [E] fp32). mlp_part gives the router probabilities per token, so that runtime/layer.py can
    # run it over token tiles and sum them once, in the same order as the whole layer (mlp_reduce).
    def mlp_part(self, w: dict[str, torch.Tensor], h: torch.Tensor, token_mask: torch.Tensor | None):
        """(output [..., H], router probabilities of h's tokens [n, E] fp32, zero on padding, top-k counts over real
        tokens [E] fp32) for h [..., H]."""
        x = rms_norm(h, w["post_attention_layernorm.weight"], self.eps)
        y, token_probs, counts = self.moe_block(w, x, token_mask)
        return h + y, token_probs, counts

    def mlp_reduce(self, out):
        y, token_probs, counts = out
        return y, token_probs.sum(0), counts

    def moe_block(self, w: dict[str, torch.Tensor], x: torch.Tensor, token_mask: torch.Tensor | None):
        H = x.shape[-1]
        flat = x.reshape(-1, H)
        logits = F.linear(flat, w["mlp.gate.weight"])  # [N, E] in the model dtype
        probs = torch.softmax(logits.float(), dim=-1)
        top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        top_w = top_p.to(logits.dtype)
        gate_up = w["mlp.experts.gate_up_proj"].flatten(1, 2)  # [E, 2I, H]: gate rows, then up rows
        y = expert_ffn(flat, top_i, top_w, gate_up, w["mlp.experts.down_proj"])
        token_probs, counts = router_statistics(logits, top_i, token_mask, self.num_experts)
        return y.reshape(x.shape), token_probs, counts


def router_statistics(logits: torch.Tensor, top_i: torch.Tensor, token_mask: torch.Tensor | None, num_experts: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's router statistics for the load-balancing loss, as load_balancing_loss_func computes them from the
    router logits [N, E]: (softmax(logits) in the logits' dtype, then fp32, per token [N, E], zero on padding,
    differentiable: the layer's probability sum is their sum over tokens; top-k counts over real tokens [E] fp32,
    detached). top_i [N, k]: the routed experts."""
    aux_probs = torch.softmax(logits, dim=-1).float()
    E, k = num_experts, top_i.shape[1]
    if token_mask is None:
        counts = torch.zeros(E, dtype=torch.float32, device=logits.device).scatter_add_(
            0, top_i.reshape(-1), torch.ones(top_i.numel(), dtype=torch.float32, device=logits.device))
    else:
        m = token_mask.reshape(-1).to(torch.float32)
        aux_probs = aux_probs * m[:, None]
        counts = torch.zeros(E, dtype=torch.float32, device=logits.device).scatter_add_(
            0, top_i.reshape(-1), m.repeat_interleave(k))
    return aux_probs, counts.detach()


def expert_ffn(x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    """Σ_k top_w[:, k] · down_e(silu(gate_e x) · up_e x) with e = top_i[:, k], for x [N, H], gate_up [E, 2I, H]
    (gate rows first), down [E, H, I]."""
    if (x.is_cuda and x.dtype == torch.bfloat16) or x.is_meta:  # meta: the planner's simulation of the CUDA path
        return _grouped_ffn(x, top_i, top_w, gate_up, down)
    return _looped_ffn(x, top_i, top_w, gate_up, down)


def _looped_ffn(x, top_i, top_w, gate_up, down):
    """transformers' loop: the experts that were hit, in order, each over its tokens (exact on CPU)."""
    E = gate_up.shape[0]
    out = torch.zeros_like(x)
    hit = torch.zeros(E, dtype=torch.bool, device=x.device)
    hit[top_i.reshape(-1)] = True
    for e in torch.nonzero(hit).flatten().tolist():  # a host sync: CPU and fp32 only
        token, slot = torch.where(top_i == e)
        g, u = F.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, down[e]) * top_w[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def sort_by_expert(top_i: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs of top_i [N, k] sorted by expert, on the device (no host synchronisation): (order:
    positions in top_i.reshape(-1) by expert, its inverse permutation, cumulative group ends [E] int32 for
    `grouped_mm`)."""
    flat_e = top_i.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = torch.zeros(num_experts, dtype=torch.int32, device=top_i.device).scatter_add_(
        0, flat_e, torch.ones_like(flat_e, dtype=torch.int32))
    return order, inverse, torch.cumsum(counts, 0, dtype=torch.int32)


class _PermuteRows(torch.autograd.Function):
    """rows[perm], with the gradient gathered back through the inverse permutation: a gather both ways, where
    index_add (the backward of index_select, and the usual combine) scatters with atomics (measured on the H200:
    index_add was 9 of the 28 ms of a Qwen3-30B-A3B layer's forward at 16 x 4096 tokens)."""

    @staticmethod
    def forward(ctx, rows, perm, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def dispatch(x: torch.Tensor, k: int, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x [N, H] -> its (token, slot) rows [N·k, H] in expert order (`sort_by_expert`). Backward: a gather back to
    (token, slot) order and a sum over the k slots, no atomics."""
    N, H = x.shape
    return _PermuteRows.apply(x.unsqueeze(1).expand(N, k, H).reshape(N * k, H), order, inverse)


def combine(y: torch.Tensor, top_w: torch.Tensor, order: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Expert-ordered rows y [N·k, H] -> Σ_k top_w[:, k] · y(token, k), [N, H]: rows gathered back to (token, slot)
    order, weighted, summed over the k slots (accumulated in fp32 by the reduction, rounded once)."""
    N, k = top_w.shape
    rows = _PermuteRows.apply(y, inverse, order) * top_w.reshape(-1, 1).to(y.dtype)
    return rows.view(N, k, -1).sum(1)


def _grouped_ffn(x, top_i, top_w, gate_up, down):
    """Two grouped GEMMs over the (token, slot) pairs sorted by expert; group offsets from a device-side count."""
    order, inverse, offs = sort_by_expert(top_i, gate_up.shape[0])
    xs = dispatch(x, top_i.shape[1], order, inverse)
    h = grouped_mm(xs, gate_up.transpose(-2, -1), offs)  # [N·k, 2I]
    g, u = h.chunk(2, dim=-1)
    y = grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs)  # [N·k, H]
    return combine(y, top_w, order, inverse)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows a[offs[e-1]:offs[e]] times b[e], for every expert e, in one kernel. On the meta device in fp32 (which
    the grouped kernel does not take) a product of the same shapes stands in, for the planner's byte count."""
    if a.is_meta and a.dtype != torch.bfloat16:
        return a @ b[0]
    return torch._grouped_mm(a, b, offs=offs)
