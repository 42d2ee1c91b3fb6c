"""Activation memory of the layer template and the LM-head loss, measured by running them on the meta device.

No memory is allocated and nothing is computed: a dispatch mode sees every tensor the real code creates, adds
its storage's bytes when it appears and subtracts them when the storage is freed (Python refcounting works the
same on meta tensors), so `peak` is the largest live total the real code reaches, autograd's saved tensors and
backward transients included. Inputs (weights, the checkpoint, d(output), rope tables) are not counted: the
planner counts them as its own components.

Attention is the one part whose memory depends on the kernel CUDA picks, not on the template: on the meta
device SDPA falls back to the math path, which materialises [B, heads, T, T] scores. On CUDA, a causal
unmasked call runs flash (or cuDNN) attention, which keeps only q, k, v, the output and a [B, heads, T] fp32
log-sum-exp for backward, and allocates an fp32 dq accumulator (plus expanded dk/dv with grouped KV heads) in
backward. `FlashLike` reproduces exactly those allocations; a masked call (the CPU path's packed rows) runs the
memory-efficient kernel, which in addition turns the bool mask into an additive [B, 1, T, T] bias it keeps. Packed
rows and windows on CUDA run the variable-length kernel (models/varlen.py), which allocates on the meta device what
the CUDA kernel does.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..models import attention
from ..runtime.layer import can_stash, layer_backward, layer_template
from ..runtime.lmhead import HeadKernels, default_chunk, head_loss
from .calibration import COMPILED_ACTIVATIONS
from .meta_trace import measure
from .profile import FLEX_BLOCK, Profile, layer_shape
from .workload import Workload


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of live storages created under it; `ignore(*tensors)` excludes pre-existing inputs."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def ignore(self, *tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t, count=False)

    def _track(self, t: torch.Tensor, count: bool = True) -> None:
        s = t.untyped_storage()
        key = id(s)
        if key in self._seen:
            return
        n = s.nbytes() if count else 0
        self._seen[key] = n
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(s, self._free, key, n)

    def _free(self, key: int, n: int) -> None:
        self.live -= n
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = _run_op(func, args, kwargs or {})
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


# ---- an op's meta outputs, made once per op and input metadata ----------------------------------------------
# torch's meta kernels are mostly Python (type promotion, broadcasting, strides: ~0.1 ms an op), and a tiled layer
# runs the same ops on the same shapes tile after tile: an op that makes fresh tensors (no view, no in-place or out=
# argument) makes outputs whose metadata depends only on its arguments' (meta tensors hold no data), so the outputs
# of a repeat are made empty with the metadata of the first (the same shapes, strides, dtypes and storage bytes)
_OUTS: dict = {}  # (op, arguments' metadata, default dtype) -> ((shape, stride, dtype) of each output, tuple or not)
_FRESH: dict = {}  # op -> whether it makes only fresh tensors


def _fresh(func) -> bool:
    got = _FRESH.get(func)
    if got is None:
        schema = func._schema
        got = _FRESH[func] = bool(schema.returns) and \
            all(a.alias_info is None for a in schema.arguments) and \
            all(r.alias_info is None and isinstance(r.type, torch._C.TensorType) for r in schema.returns)
    return got


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(x):
    """What of an argument an op's output metadata can depend on; None: not a meta argument this cache takes."""
    if type(x) is torch.Tensor or type(x) is torch.nn.Parameter:
        if not x.is_meta or x.layout != torch.strided or x.is_nested:
            return None
        return x.dtype, tuple(x.shape), x.stride(), x.storage_offset()
    if type(x) in _PLAIN:
        return type(x), x
    if type(x) in (list, tuple):
        keys = tuple(_meta_key(v) for v in x)
        return None if None in keys else (type(x), keys)
    return None


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes of the smallest storage holding `t` from offset 0 (what empty_strided allocates)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def _new_storages(outs: tuple, args, kwargs) -> bool:
    """Whether each output has a storage of its own, none an argument's (a kernel may hand back an input as is)."""
    mine = {t.untyped_storage()._cdata for t in outs}
    theirs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
    return len(mine) == len(outs) and not mine & theirs


def _run_op(func, args, kwargs):
    """func(*args, **kwargs) on meta tensors, its outputs made from the first run's metadata on a repeat (above)."""
    if not _fresh(func):
        return func(*args, **kwargs)
    key = _meta_key(args), _meta_key(tuple(sorted(kwargs.items())))
    if key[0] is None or key[1] is None:
        return func(*args, **kwargs)
    key = (func, key, torch.get_default_dtype())
    got = _OUTS.get(key)
    if got is not None:
        metas, single = got
        outs = tuple(torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in metas)
        return outs[0] if single else outs
    out = func(*args, **kwargs)
    single = isinstance(out, torch.Tensor)
    outs = (out,) if single else out
    if type(outs) is tuple and all(type(t) is torch.Tensor and t.is_meta and t.layout == torch.strided and
                                   t.storage_offset() == 0 and t.untyped_storage().nbytes() == _storage_bytes(t)
                                   for t in outs) and _new_storages(outs, args, kwargs):
        if len(_OUTS) >= 1 << 16:
            _OUTS.clear()
        _OUTS[key] = tuple((tuple(t.shape), t.stride(), t.dtype) for t in outs), single
    return out


class FlashLike(torch.autograd.Function):
    """Allocates and saves what CUDA's fused attention kernels do (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, bias_shape):
        B, h, T, d = q.shape
        out = q.new_empty(B, T, h, d).transpose(1, 2)  # the kernels write [B, T, h, d]: o.transpose(1,2) is free
        lse = q.new_empty(B, h, T, dtype=torch.float32)
        saved = [q, k, v, out, lse]
        if bias_shape is not None:
            saved.append(q.new_empty(bias_shape))  # the bool mask as an additive bias in the query dtype
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors[:3]
        B, h, T, d = q.shape
        work = [q.new_empty(B, T, h, d, dtype=torch.float32), q.new_empty(B, h, T, dtype=torch.float32)]
        if k.shape[1] != h:  # grouped KV heads: per-query-head dk, dv, reduced at the end
            work += [q.new_empty(B, T, h, d), q.new_empty(B, T, h, d)]
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del work
        return dq, dk, dv, None


def fused_sdpa_meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as the planner's meta device runs it: the fused CUDA kernels' allocations
    (FlashLike)."""
    bias = None if attn_mask is None else (q.shape[0], 1, q.shape[2], k.shape[2])
    return FlashLike.apply(q, k, v, bias)


@contextmanager
def _cuda_attention(enabled: bool):
    """The CUDA kernels' allocations (enabled), else the CPU path's; packed rows and windows: the variable-length
    kernel's segments (models/varlen.py, which allocates on the meta device what the CUDA kernel does) or the CPU's
    explicit mask (models/attention.META_AS_CUDA)."""
    was = attention.META_AS_CUDA[0]
    attention.META_AS_CUDA[0] = enabled
    if not enabled:
        try:
            yield
        finally:
            attention.META_AS_CUDA[0] = was
        return
    orig = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = fused_sdpa_meta
    try:
        yield
    finally:
        F.scaled_dot_product_attention = orig
        attention.META_AS_CUDA[0] = was


def mask_bytes(adapter, rows: int, seq: int, packed: bool, cuda: bool) -> float:
    """Bytes a micro-batch's attention contexts keep for packed rows (models/attention.attention_context): the CPU
    path's boolean [rows, 1, T, T] mask; on CUDA, for layer kinds on the variable-length kernel its int32 segment
    offsets (at most one segment per token: models/varlen.segments), for kinds on FlexAttention (soft-capping,
    sinks) the document ids (int64 per token) and the block mask (four int32 [rows, T/128, T/128] index tables and
    their counts, for queries and keys)."""
    if not packed:
        return 0.0
    if not cuda:
        return float(rows * seq * seq)
    kernels = {adapter.cuda_attention(k, seq, True)[0] for k in set(adapter.layer_kinds)}
    n = -(-seq // FLEX_BLOCK)
    flex = 8.0 * rows * seq + 4 * 4.0 * rows * n * (n + 1) if "flex" in kernels else 0.0
    varlen = 4.0 * (rows * seq + 1) if "varlen" in kernels else 0.0
    return flex + varlen


def _meta_layer_inputs(adapter, batch: int, seq: int, dtype: torch.dtype, packed: bool):
    unit = next(u for u in adapter.units() if u.kind == "layer")
    w = {s.name: torch.empty(s.shape, dtype=dtype, device="meta") for s in unit.specs}
    pos = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    ctx = adapter.make_context(pos, dtype, packed)
    x = torch.empty(batch, seq, adapter.hidden_size, dtype=dtype, device="meta")
    return w, ctx, x


def layer_memory(adapter, batch: int, seq: int, dtype: torch.dtype = torch.bfloat16, packed: bool = False,
                 cuda_attention: bool = True, seq_tile: int = 0, stash: bool = False,
                 attn_block: int = 0, plain: bool = True) -> dict[str, int]:
    """Bytes of one layer for one micro-batch of `batch` x `seq` tokens, its MLP part over tiles of `seq_tile`
    tokens (0: whole), its attention's backward over blocks of `attn_block` tokens on plain causal rows longer than
    that (Placement.attn_block; models/attention.blockwise_causal: on the meta device it allocates what the CUDA
    kernel does per block pair), as runtime.layer.layer_template builds the engine's layer:

    forward_peak   no-grad forward (the forward wave), output included
    backward_peak  recompute + local backward + fp32 accumulation (runtime.layer.layer_backward, the engine's
                   own function): saved tensors, backward transients, the bf16 weight gradients and d(input)

    and with `stash` (the layer keeps its attention for the backward: Placement.reuse_attention), when the adapter
    can (runtime.layer.can_stash):

    stash                the bytes the kept attention holds from the forward to the backward (its q, k, v, output
                         and what the kernel saves)
    forward_stash_peak   the forward that keeps it, output and stash included
    backward_stash_peak  the backward that spends it, the stash included (freed as it goes)

    plain=False: the stash's three only (the planner measures the plain template's apart).
    """
    with _cuda_attention(cuda_attention):
        w, ctx, x = _meta_layer_inputs(adapter, batch, seq, dtype, packed)
    ctx.with_attn_block(attn_block)
    grad_acc = {k: torch.empty(v.shape, dtype=torch.float32, device="meta") for k, v in w.items()}
    dh = torch.empty_like(x)
    layer = layer_template(adapter, seq_tile, attn_block=attn_block)
    out = {}
    with _cuda_attention(cuda_attention):
        if plain:
            mode = LiveBytes()
            mode.ignore(*w.values(), x, dh, ctx.cos, ctx.sin, ctx.mask)
            with mode, torch.no_grad():
                y = layer(w, x, ctx)
                del y
            out["forward_peak"] = mode.peak

            mode = LiveBytes()
            mode.ignore(*w.values(), x, dh, ctx.cos, ctx.sin, ctx.mask, *grad_acc.values())
            with mode:
                dx = layer_backward(layer, w, x, ctx, dh, list(grad_acc.values()))
                del dx
            out["backward_peak"] = mode.peak
        if stash and can_stash(adapter):
            layer = layer_template(adapter, seq_tile, stash=True, attn_block=attn_block)
            mode = LiveBytes()
            mode.ignore(*w.values(), x, dh, ctx.cos, ctx.sin, ctx.mask, *grad_acc.values())
            with mode:
                with torch.no_grad():
                    y, kept = layer.forward_stash(w, x, ctx)
                out["forward_stash_peak"] = mode.peak
                del y
                out["stash"] = mode.peak = mode.live  # what stays: the stash; then the backward that spends it
                layer_backward(layer, w, x, ctx, dh, list(grad_acc.values()), stash=kept)  # d(input): dropped
                del kept
            out["backward_stash_peak"] = mode.peak
    return out


def head_memory(adapter, batch: int, seq: int, targets: int, chunk: int, dtype: torch.dtype = torch.bfloat16,
                cuda: bool = True) -> int:
    """Peak bytes of the LM-head loss and its backward for one micro-batch (runtime.lmhead.head_loss, the engine's
    own function, run on the meta device with the CUDA kernels when `cuda`), excluding the hidden states, weights
    and gradient accumulators it is given, and excluding the d(hidden) it returns (the planner counts those per
    micro-batch). Capped logits (Gemma 2's final_logit_softcapping) as the engine caps them."""
    H, V = adapter.hidden_size, adapter.vocab_size
    h = torch.empty(batch, seq, H, dtype=dtype, device="meta")
    index = torch.empty(targets, dtype=torch.long, device="meta")
    labels = torch.empty(targets, dtype=torch.long, device="meta")
    norm_w = torch.empty(H, dtype=dtype, device="meta")
    lm_w = torch.empty(V, H, dtype=dtype, device="meta")
    norm_g = torch.empty(H, dtype=torch.float32, device="meta")
    lm_g = torch.empty(V, H, dtype=torch.float32, device="meta")
    mode = LiveBytes()
    mode.ignore(h, norm_w, lm_w, norm_g, lm_g, index, labels)
    with mode:
        loss, dh = head_loss(adapter.final_norm, h, index, labels, norm_w, lm_w, norm_g, lm_g,
                             1.0 / max(targets, 1), chunk, HeadKernels(fused_ce=cuda, fused_accumulate=cuda),
                             getattr(adapter, "logit_softcap", None))
        del loss, dh
    return mode.peak


# ---- GPU: one micro-batch's work, measured on the meta device (without importing torch._dynamo: meta_trace.py) ---
# adapter -> {shape: sizes}: suggestions re-plan the same shapes many times
_ACTIVATIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _measured_activations(adapter, w: Workload, prof: Profile | None, b: int) -> float | None:
    """The probe's measured recompute+backward peak for this layer shape, micro-batch and compile mode."""
    if prof is None or w.device != "cuda" or w.packed or w.precision != "bf16" or \
            0 < w.placement.seq_tile < b * w.seq_len or 0 < w.placement.attn_block < w.seq_len:  # the probe runs
        return None  # the layer whole, its attention's backward fused
    shape = layer_shape(adapter)
    for r in prof.layer_rates:
        if r.shape == shape and (r.micro, r.seq, r.compile) == \
                (b, w.seq_len, w.compile) and r.activation_peak_bytes:
            return float(r.activation_peak_bytes)
    return None


def activation_sizes(adapter, w: Workload, notes: list[str], prof: Profile | None = None) -> dict[int, dict]:
    """Per distinct micro-batch size: the layer's forward and backward peaks and the LM head's peak (read only: the
    same dict for every placement that shares what it depends on, with the note it makes)."""
    pl = w.placement
    key = ("sizes", w.precision, w.loss_chunk_tokens, w.seq_len, w.targets_per_row, frozenset(w.micro_batches),
           w.packed, w.device, w.head_kernels, w.compile, pl.seq_tile, pl.attn_block, pl.reuse_attention > 0, id(prof))
    cache = _ACTIVATIONS.setdefault(adapter, {})
    got = cache.get(key)
    if got is None or got[0] is not prof:
        said: list[str] = []
        got = cache[key] = (prof, _activation_sizes(adapter, w, said, prof), said)
    notes.extend(got[2])
    return got[1]


def _activation_sizes(adapter, w: Workload, notes: list[str], prof: Profile | None) -> dict[int, dict]:
    dtype = torch.bfloat16 if w.precision == "bf16" else torch.float32
    chunk = w.loss_chunk_tokens or default_chunk(adapter.vocab_size)  # the Engine's
    targets = w.seq_len - 1 if w.targets_per_row is None else w.targets_per_row
    out = {}
    cache = _ACTIVATIONS.setdefault(adapter, {})
    tiled = False
    for b in sorted(set(w.micro_batches)):
        tile = w.placement.seq_tile if w.placement.seq_tile < b * w.seq_len else 0  # one tile: the whole layer
        block = w.placement.attn_block if 0 < w.placement.attn_block < w.seq_len else 0
        tiled |= bool(tile or block)  # (rows longer than the attention's block run the split layer too)
        stash = w.placement.reuse_attention > 0
        # measured once each (the search plans many placements of one shape): the layer's peaks, the kept
        # attention's (the split template's: not shrunk by compiling, full-length kernel buffers), the LM head's
        key = (b, w.seq_len, dtype, w.packed, w.device, tile, block)
        if key not in cache:
            layer = measure(layer_memory, adapter, b, w.seq_len, dtype, w.packed, cuda_attention=w.device == "cuda",
                            seq_tile=tile, attn_block=block)
            cache[key] = {"forward": layer["forward_peak"], "backward": layer["backward_peak"]}
        if stash and ("stash",) + key not in cache:
            layer = measure(layer_memory, adapter, b, w.seq_len, dtype, w.packed, cuda_attention=w.device == "cuda",
                            seq_tile=tile, stash=True, attn_block=block, plain=False)
            cache[("stash",) + key] = {"stash": layer["stash"], "forward_stash": layer["forward_stash_peak"],
                                       "backward_stash": layer["backward_stash_peak"]} if "stash" in layer else {}
        head = ("head", b, w.seq_len, dtype, w.device, chunk, targets, w.head_kernels)
        if head not in cache:
            cache[head] = measure(head_memory, adapter, b, w.seq_len, b * targets, chunk, dtype,
                                  cuda=w.device == "cuda" and w.head_kernels)
        out[b] = {**cache[key], "head": cache[head], **(cache[("stash",) + key] if stash else {})}
        # compiling fuses a whole layer's elementwise work; a tiled layer's peak is its full-length buffers (q, k, v,
        # the attention's output and gradients), which compiling does not shrink: no discount
        out[b]["backward"] *= COMPILED_ACTIVATIONS if w.compile and not (tile or block) else 1.0
    measured = {b: _measured_activations(adapter, w, prof, b) for b in out}
    for b, m in measured.items():
        if m is not None:
            out[b]["backward"] = m
    if any(m is not None for m in measured.values()):
        notes.append("layer activations: measured by the probe at this shape")
    elif tiled:
        notes.append(f"layer activations: the layer over tiles of {w.placement.seq_tile} tokens, measured on the meta "
                     f"device as it runs eagerly (compiling shrinks only the per-tile work)")
    elif w.compile:
        notes.append(f"compiled template: layer activations taken as {COMPILED_ACTIVATIONS:.2f} x the eager "
                     f"template's (fitted to the H200 runs); a probe at this shape measures them")
    return out
