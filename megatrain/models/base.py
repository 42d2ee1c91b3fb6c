"""What an architecture adapter tells the rest of megatrain: units, their tensors, and how to run them.

A *unit* is what streams as one tile: the embedding, each decoder layer, and the head (final norm + LM head).
Templates are stateless functions called with a dict of weight views; they know nothing of streaming.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Container, Literal

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class TensorSpec:
    name: str  # key in the template's weight dict, e.g. "self_attn.q_proj.weight"
    hf_name: str  # full name in the Hugging Face checkpoint, e.g. "model.layers.3.self_attn.q_proj.weight"
    shape: tuple[int, ...]
    decay: bool  # AdamW weight decay applies (matrices yes; norms and biases no)
    init: Literal["normal", "ones", "zeros"]
    # The checkpoint's tensors when it stores this one otherwise than under hf_name (the name transformers' model
    # gives the parameter): its row-major sub-blocks along the leading dimensions, in order. A MoE layer's experts
    # are one stacked [E, 2, I, H] tensor here, 2E tensors `...experts.{e}.gate_proj.weight`/`up_proj` there; one
    # part is a rename (mixtral's router, `block_sparse_moe.gate.weight` in the checkpoint).
    parts: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return self.parts or (self.hf_name,)

    @property
    def part_shape(self) -> tuple[int, ...]:
        """The shape of each checkpoint tensor: `shape` less the leading dimensions that number the parts."""
        n, lead = len(self.checkpoint_names), 0
        while n > 1:
            if lead >= len(self.shape) or n % self.shape[lead]:
                raise ValueError(f"{self.hf_name}: {len(self.parts)} parts do not split shape {self.shape}")
            n //= self.shape[lead]
            lead += 1
        return self.shape[lead:]

    def split(self, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """(checkpoint name, view) for each checkpoint tensor of `t`, a tensor of this spec's shape."""
        names = self.checkpoint_names
        return list(zip(names, t.reshape(len(names), *self.part_shape).unbind(0)))


@dataclass(frozen=True)
class PackedTensor:
    """A tensor that a checkpoint stores as other tensors the loader converts (gpt_oss's MXFP4 experts: `*_blocks`
    and `*_scales`): the checkpoint tensors to read, and `build(destination, tensors)`, which writes the tensor into
    `destination` (the host store's view, of the spec's shape) from them, in `names` order; it raises ValueError
    when their shapes do not fit."""

    names: tuple[str, ...]
    build: Callable[[torch.Tensor, list[torch.Tensor]], None]


@dataclass(frozen=True)
class Unit:
    kind: Literal["embed", "layer", "head"]
    index: int  # layer number for layers, -1 otherwise
    specs: tuple[TensorSpec, ...]  # decayed tensors first, then the rest: the optimizer relies on this order

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views, one per tensor, into a flat buffer laid out like this unit."""
        out, off = {}, 0
        for s in self.specs:
            out[s.name] = flat[off: off + s.numel].view(s.shape)
            off += s.numel
        return out

    @property
    def name(self) -> str:
        return f"layer {self.index}" if self.kind == "layer" else self.kind

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def decay_numel(self) -> int:
        return sum(s.numel for s in self.specs if s.decay)


# Packed rows (and windows shorter than the row) with a plain score run FlexAttention up to this head_dim over rows
# shorter than FLEX_PACKED_TOKENS, the variable-length kernel otherwise (bench/attention_kernels.py,
# forward + backward over 8 x 4096 packed tokens: FlexAttention 7.04 ms at head_dim 128 against varlen 8.30, and
# 15.3 at 256 against 9.83; a window of 1024 at 128: 6.35 against 7.59). From FLEX_PACKED_TOKENS on, the varlen
# kernel at any head_dim: its backward runs over block pairs (memory.attn_block), a kept attention
# (memory.reuse_attention) holds only its output, and the planner measures its memory as it allocates it; there
# FlexAttention ran faster still (32,768 tokens of 2 documents: 45.6 ms against 55.3).
FLEX_PACKED_HEAD_DIM = 128
FLEX_PACKED_TOKENS = 32768


def prefers_flex(head_dim: int | None, seq_len: int) -> bool:
    """Whether packed rows or a window with a plain score run FlexAttention rather than the variable-length kernel
    on CUDA: at head_dims up to FLEX_PACKED_HEAD_DIM over rows shorter than FLEX_PACKED_TOKENS, where it measured
    faster (the constants' comment says by how much). None: the varlen kernel."""
    return head_dim is not None and head_dim <= FLEX_PACKED_HEAD_DIM and seq_len < FLEX_PACKED_TOKENS


@dataclass
class AttnContext:
    """Per micro-batch inputs a layer needs besides hidden states; built once, reused by recompute."""

    cos: torch.Tensor  # [B, T, head_dim]
    sin: torch.Tensor
    mask: torch.Tensor | None  # CPU, packed documents or a window: bool [B, 1, T, T], True = may attend
    block_mask: BlockMask | None = None  # CUDA, a mask for soft-capping or sinks: FlexAttention's (no T x T tensor)
    window: int | None = None  # sliding window (a query sees itself and the window - 1 keys before it), or None
    variants: dict[str, "AttnContext"] = field(default_factory=dict)  # other layer kinds' contexts (see below)
    token_mask: torch.Tensor | None = None  # bool [B, T]: real tokens (not padding), for MoE router statistics
    attn_block: int = 0  # plain causal rows longer than this: the attention's backward over blocks of this many
    #                      queries and keys (models/attention.blockwise_causal; Placement.attn_block; 0: whole)
    # CUDA (and the planner's meta device), packed documents or a window with a plain score: the variable-length
    # kernel's segments over the rows laid end to end (models/varlen.py): int32 offsets, the longest segment
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    flex_options: dict | None = None  # FlexAttention's kernel_options (attention.flex_kernel_options) or its defaults

    @property
    def varlen(self) -> bool:  # not max_seqlen > 0: a compiled layer would be guarded on each micro-batch's longest
        return self.cu_seqlens is not None

    def with_token_mask(self, mask: torch.Tensor | None) -> "AttnContext":
        """Sets the micro-batch's real-token mask on this context and its variants; returns self."""
        for c in (self, *self.variants.values()):
            c.token_mask = mask
        return self

    def with_attn_block(self, block: int) -> "AttnContext":
        """Sets the attention's backward block (Placement.attn_block) on this context and its variants; returns
        self."""
        for c in (self, *self.variants.values()):
            c.attn_block = int(block)
        return self

    def for_kind(self, kind: str) -> "AttnContext":
        """The context of a layer of `kind` (ModelAdapter.layer_kinds): this one for "full" attention, else the
        variant built for that kind (a sliding window, another rope base), or this one if none was needed."""
        return self.variants.get(kind, self)


class ModelAdapter:
    """Interface every architecture family implements."""

    model_type: str
    hf_config: PretrainedConfig
    num_layers: int
    hidden_size: int
    vocab_size: int
    tied: bool

    def units(self) -> list[Unit]:
        raise NotImplementedError

    def active_numel(self, unit: Unit) -> int:
        """Parameters of `unit` that multiply each token (a MoE layer: its top-k experts of E, not all)."""
        return unit.numel

    @property
    def layer_kinds(self) -> list[str]:
        """Each layer's attention kind ("full", "sliding", ...): the engine runs layer i with
        `ctx.for_kind(layer_kinds[i])`. All "full" unless a family says otherwise."""
        return ["full"] * self.num_layers

    # What the family's attention adds to the scaled scores, which SDPA's causal kernel cannot run: "plain" (none),
    # "softcap" (Gemma 2's tanh capping), "sinks" (gpt-oss's sink logits, from the kernel's log-sum-exp).
    attention_score = "plain"

    def cuda_attention(self, kind: str, seq_len: int, packed: bool) -> tuple[str, str]:
        """(kernel, score) a layer of `kind` runs on CUDA over rows of `seq_len` tokens, as its make_context and
        models/attention.attention_context choose: ("flash", "plain") for SDPA's causal kernel; ("varlen", "plain")
        for the variable-length flash kernel (packed rows, a sliding window shorter than the row); ("flex", score)
        for FlexAttention: a score SDPA cannot run (soft-capping, sinks), or packed rows and windows where it
        measured faster (prefers_flex)."""
        window = getattr(self, "sliding_window", None) if kind == "sliding" else None
        if self.attention_score != "plain":
            return "flex", self.attention_score
        if packed or (window is not None and seq_len > window):
            return ("flex", "plain") if prefers_flex(getattr(self, "head_dim", None), seq_len) else ("varlen", "plain")
        return "flash", "plain"

    def packed_source(self, spec: TensorSpec, available: Container[str]) -> PackedTensor | None:
        """How to load `spec` from a checkpoint holding the tensor names `available` when it stores the tensor
        otherwise than under `spec.checkpoint_names` (quantized); None when it stores it plainly."""
        return None

    def layer_forward(self, w: dict[str, torch.Tensor], h: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
        raise NotImplementedError

    def make_context(self, position_ids: torch.Tensor, dtype: torch.dtype, packed: bool) -> AttnContext:
        raise NotImplementedError

    def final_norm(self, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    moe: bool = False  # layer_forward returns (h, router probability sum [E], top-k counts [E]): models/moe.py
    num_experts: int = 0
    router_aux_coef: float = 0.0
    embed_scale: float | None = None  # the embedding's output multiplied by it (gemma: sqrt(hidden_size))
    logit_softcap: float | None = None  # logits capped as c·tanh(logits/c) before the loss (gemma2)

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The input embedding: a lookup, times `embed_scale` rounded to the weight's dtype (as transformers'
        Gemma*ScaledWordEmbedding) where the family scales it."""
        h = torch.nn.functional.embedding(ids, weight)
        return h if self.embed_scale is None else h * torch.tensor(self.embed_scale, dtype=weight.dtype)

    def embed_input_grad(self, dh: torch.Tensor) -> torch.Tensor:
        """d(embedding rows) from d(embedding output): the scale's chain rule, in dh's dtype as autograd does."""
        return dh if self.embed_scale is None else dh * torch.tensor(self.embed_scale, dtype=dh.dtype)
