"""The rollout's KV cache: transformers' DynamicCache, its full-attention layers replaced by slabs allocated once for
the longest row (prompt + max_new_tokens), so a decode step writes one position instead of concatenating the whole
cache (transformers' DynamicLayer grows by torch.cat, which copies every cached token at every step).

A slab lives on the device, or in pinned host memory (kv_on_host): then each step copies the layer's cached keys
and values to the device for the attention and writes the new position back. Dropping finished rows compacts the
slab in place (`batch_select_indices`). Sliding-window layers keep transformers' own layer (bounded by the window).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class SlabLayer(DynamicLayer):
    """A DynamicLayer over a preallocated [B, heads, capacity, head_dim] buffer; `keys`/`values` are the views of
    the cached positions (what the attention reads), on the compute device."""

    def __init__(self, capacity: int, on_host: bool):
        super().__init__()
        self.capacity, self.on_host, self.rows, self.length = capacity, on_host, 0, 0
        self.k_slab = self.v_slab = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B, Hk, _, D = key_states.shape
        pin = self.on_host and key_states.device.type == "cuda"
        where = "cpu" if self.on_host else key_states.device

        def slab(x):
            return torch.empty((B, x.shape[1], self.capacity, x.shape[3]), dtype=x.dtype, device=where,
                               pin_memory=pin)

        self.k_slab, self.v_slab = slab(key_states), slab(value_states)
        self.rows, self.length, self.is_initialized = B, 0, True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T, B = self.length, key_states.shape[-2], self.rows
        if n + T > self.capacity:
            raise RuntimeError(f"KV cache: {n + T} positions exceed the slab's {self.capacity}")
        nb = key_states.device.type == "cuda"
        if self.on_host:
            past_k = self.k_slab[:B, :, :n].to(key_states.device, non_blocking=nb)
            past_v = self.v_slab[:B, :, :n].to(key_states.device, non_blocking=nb)
            self.keys, self.values = torch.cat([past_k, key_states], -2), torch.cat([past_v, value_states], -2)
            self.k_slab[:B, :, n:n + T].copy_(key_states, non_blocking=nb)
            self.v_slab[:B, :, n:n + T].copy_(value_states, non_blocking=nb)
        else:
            self.k_slab[:B, :, n:n + T] = key_states
            self.v_slab[:B, :, n:n + T] = value_states
            self.keys, self.values = self.k_slab[:B, :, :n + T], self.v_slab[:B, :, :n + T]
        self.length = n + T
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        m, n = len(indices), self.length
        for slab in (self.k_slab, self.v_slab):
            slab[:m, :, :n] = slab[indices.to(slab.device), :, :n]
        self.rows = m
        if not self.on_host:
            self.keys, self.values = self.k_slab[:m, :, :n], self.v_slab[:m, :, :n]

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the rollout repeats prompts before the prefill")

    @property
    def nbytes(self) -> int:
        return 0 if self.k_slab is None else 2 * self.k_slab.numel() * self.k_slab.element_size()


def make_cache(hf_config, capacity: int, kv_on_host: bool) -> DynamicCache:
    """transformers' DynamicCache for `hf_config`, its full-attention layers slabs of `capacity` positions."""
    cache = DynamicCache(config=hf_config)
    n = hf_config.get_text_config(decoder=True).num_hidden_layers
    if not cache.layers:  # a config without layer types: transformers adds layers lazily; give it all of them
        cache.layers = [DynamicLayer() for _ in range(n)]
        cache.layer_class_to_replicate = None
    cache.layers = [SlabLayer(capacity, kv_on_host) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SlabLayer):
            total += layer.nbytes
        elif getattr(layer, "keys", None) is not None and layer.is_initialized:
            total += 2 * layer.keys.numel() * layer.keys.element_size()
    return total
