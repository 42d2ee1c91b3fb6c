"""transformers' own model for the rollout, its parameters on the meta device and supplied per call
(torch.func.functional_call): resident, every unit copied to the device once; streamed, the embedding and the head
resident and the decoder layers streamed through two device slots (LayerStreamer), each forward (a prefill or a
decode step) running all its rows through layer i before layer i + 1, as transformers' decoder loop does."""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch.func import functional_call

from .attention import register as register_attention
from .weights import UnitWeights, WeightSource, as_param, unit_key


@contextmanager
def meta_parameters():
    """Modules built inside get their parameters on the meta device and their buffers (rotary frequencies) real."""
    orig = torch.nn.Module.register_parameter

    def register(self, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        orig(self, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = orig


def build_meta_model(hf_config, dtype: torch.dtype, device: torch.device):
    import copy

    from transformers import AutoModelForCausalLM

    hf_config = copy.deepcopy(hf_config)
    if getattr(hf_config, "output_router_logits", False):  # the router loss is training's, not the rollout's
        hf_config.output_router_logits = False
    with meta_parameters():  # sdpa, a decode step's query heads packed per key/value head (attention.py)
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=register_attention(), dtype=dtype)
    model.eval().requires_grad_(False)
    for mod in model.modules():
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = b.to(device)
    return model


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder's layer list (`model.model.layers` in transformers' causal LMs)."""
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    inner = getattr(model, "model", None)
    if inner is not None and isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        return inner.layers
    for _, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            return m
    raise ValueError(f"{type(model).__name__}: no list of {n} decoder layers")


def cache_keyword(model) -> str:
    """The name transformers' forward gives the KV cache: `cache` in newer releases, `past_key_values` before. A name
    the forward does not take would land in its **kwargs unread, and every step would run without the cache."""
    params = inspect.signature(type(model).forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise ValueError(f"{type(model).__name__}.forward takes neither `cache` nor `past_key_values`")


def _tied_head(model) -> str | None:
    """The LM head's parameter name when it is the input embedding's (tied), else None."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and out.weight is inp.weight:
        return next(n for n, p in model.named_parameters(remove_duplicate=False) if p is out.weight and "lm_head" in n)
    return None


class LayerStreamer:
    """Streams the decoder layers through two device slots, in order, cyclically (layer 0 of the next forward
    follows layer L-1 of this one). Layer i's pre-hook waits for its copy, then starts the copy of the next layer
    into the other slot once the compute that read that slot (layer i - 1) is queued before it: on CUDA the copy
    runs on its own stream, overlapping layer i's compute. `parity()`: the slot layer 0 of the next forward uses
    (layer i: (parity + i) % 2)."""

    def __init__(self, layers: list[UnitWeights], device: torch.device, dtype: torch.dtype):
        self.units, self.device, self.L = layers, device, len(layers)
        size = max(u.flat.numel() for u in layers)
        self.slots = [torch.empty(size, dtype=dtype, device=device) for _ in range(2)]
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ready: list = [None, None]
        self.freed: list = [None, None]
        self.issued = self.waited = 0  # copies started (copy c fills slot c % 2 with layer c % L), layers run
        self.bytes = 0

    def _issue(self) -> None:
        c, s = self.issued, self.issued % 2
        u = self.units[c % self.L]
        dst = self.slots[s][: u.flat.numel()]
        if self.cuda:
            with torch.cuda.stream(self.copy_stream):
                if self.freed[s] is not None:
                    self.copy_stream.wait_event(self.freed[s])
                dst.copy_(u.flat, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.copy_stream)
                self.ready[s] = ev
        else:
            dst.copy_(u.flat)
        self.issued += 1
        self.bytes += u.nbytes

    def parity(self) -> int:
        """The slot of this forward's layer 0 (its copy started here unless the last forward prefetched it)."""
        if self.issued == self.waited:
            self._issue()
        return self.waited % 2

    def before(self, i: int) -> None:
        s = self.waited % 2
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[s])
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # layer i - 1's compute, which read the other slot
            self.freed[1 - s] = ev
        self.waited += 1
        self._issue()  # layer i + 1, or the next forward's layer 0

    def views(self, parity: int) -> dict[str, torch.Tensor]:
        out = {}
        for i, u in enumerate(self.units):
            out.update(u.views(self.slots[(parity + i) % 2]))
        return out

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)


class RolloutModel:
    """The model a Sampler runs: `forward(cache=..., **kwargs)` is transformers' CausalLM forward with the weights
    bound, the cache passed under the forward's own name for it (cache_keyword)."""

    def __init__(self, hf_config, weights: WeightSource, device, mode: str, dtype: torch.dtype):
        self.device, self.mode, self.dtype = torch.device(device), mode, dtype
        self.model = build_meta_model(hf_config, dtype, self.device)
        shapes = {n: p.shape for n, p in self.model.named_parameters()}
        tied = _tied_head(self.model)
        layers = decoder_layers(self.model)
        if len(weights.layers) != len(layers):
            raise ValueError(f"weights: {len(weights.layers)} layers, the model {len(layers)}")
        given = {n for u in weights.units() for n, _, _ in u.entries}
        missing = sorted(set(shapes) - given - ({tied} if tied else set()))
        extra = sorted(given - set(shapes) - ({tied} if tied else set()))
        if missing or extra:
            raise ValueError(f"weights do not fit {type(self.model).__name__}: missing {missing[:4]}, "
                             f"unknown {extra[:4]}")
        self.tied = tied
        self.cache_kw = cache_keyword(self.model)

        def device_copy(u: UnitWeights) -> dict[str, torch.Tensor]:
            return u.views(u.flat.to(self.device, dtype))

        self.fixed: dict[str, torch.Tensor] = {}
        for u in (weights.embed, weights.head) + (tuple(weights.layers) if mode == "resident" else ()):
            self.fixed.update(device_copy(u))
        self.streamer = None
        self.resident_bytes = sum(t.numel() * t.element_size() for t in self.fixed.values())
        if mode == "streamed":
            self.streamer = LayerStreamer(weights.layers, self.device, dtype)
            self.resident_bytes += sum(s.numel() * s.element_size() for s in self.streamer.slots)
            self._views = [self.streamer.views(p) for p in (0, 1)]
            self._hooks = [layer.register_forward_pre_hook(self._pre_hook(i)) for i, layer in enumerate(layers)]
        self._bound = [self._bind(self.fixed if mode == "resident" else {**self.fixed, **self._views[p]}, shapes)
                       for p in ((0,) if mode == "resident" else (0, 1))]

    def _bind(self, tensors: dict[str, torch.Tensor], shapes) -> dict[str, torch.Tensor]:
        return {n: as_param(t, shapes[n], n) for n, t in tensors.items() if n in shapes}  # a tied head: the embedding

    def _pre_hook(self, i: int):
        def hook(module, args):
            self.streamer.before(i)
        return hook

    @torch.inference_mode()
    def forward(self, cache=None, **kwargs):
        kwargs[self.cache_kw] = cache
        params = self._bound[0] if self.streamer is None else self._bound[self.streamer.parity()]
        return functional_call(self.model, params, args=(), kwargs=kwargs, strict=False)

    @property
    def streamed_bytes(self) -> int:
        return 0 if self.streamer is None else self.streamer.bytes

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.synchronize()
            self.streamer.slots = []
        self.fixed.clear()
        self._bound = []


class RandomWeights(WeightSource):
    """Random weights in the shapes of transformers' model for `hf_config` (benchmarks): matrices N(0, std) from a
    block of random values, shifted windows of it repeated (filling tens of GB with fresh draws would take minutes),
    norms 1, biases 0. pin: page-locked buffers (CUDA hosts)."""

    RANDOM_BLOCK = 1 << 22

    def __init__(self, hf_config, dtype: torch.dtype = torch.bfloat16, seed: int = 0, std: float = 0.02,
                 pin: bool = False):
        model = build_meta_model(hf_config, dtype, torch.device("cpu"))
        B = self.RANDOM_BLOCK
        block = (torch.randn(2 * B, generator=torch.Generator().manual_seed(seed)) * std).to(dtype)
        groups: dict = {}
        for name, p in model.named_parameters():
            groups.setdefault(unit_key(name), []).append((name, tuple(p.shape)))

        def pack(key):
            items = groups.get(key, [])
            total = sum(torch.Size(s).numel() for _, s in items)
            flat = torch.empty(total, dtype=dtype, pin_memory=pin)
            entries, off = [], 0
            for name, shape in items:
                n = torch.Size(shape).numel()
                dst = flat[off: off + n]
                if "norm" in name and len(shape) == 1:
                    dst.fill_(1.0)
                elif name.endswith("bias"):
                    dst.zero_()
                else:
                    for i in range(0, n, B):  # each chunk a shifted window of the block
                        k, start = min(B, n - i), (off + i) // B * 7919 % B
                        dst[i: i + k].copy_(block[start: start + k])
                entries.append((name, shape, off))
                off += n
            return UnitWeights(key, flat, tuple(entries))

        layers = sorted(k for k in groups if isinstance(k, int))
        self.embed, self.layers, self.head = pack("embed"), [pack(i) for i in layers], pack("head")
