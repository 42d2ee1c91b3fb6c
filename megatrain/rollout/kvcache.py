"""The rollout's KV cache: transformers' DynamicCache, its full-attention layers replaced by slabs allocated once for
the longest row (prompt + max_new_tokens), so a decode step writes one position instead of concatenating the whole
cache (transformers' DynamicLayer grows by torch.cat, which copies every cached token at every step).

A slab lives on the device, or in pinned host memory (kv_on_host, position-major so that the cached prefix is one
contiguous copy): then each step copies the layer's cached keys and values to the device for the attention and
writes the new position back. Dropping finished rows compacts the
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
        self.expect_rows: int | None = None  # the batch's rows when a prefill comes in row chunks
        self.window: tuple[int, int] | None = None  # the rows a chunked prefill writes now

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        B = self.expect_rows or key_states.shape[0]
        if self.on_host:  # position-major [capacity, B, heads, head_dim]: the cached prefix is one contiguous copy
            pin = key_states.device.type == "cuda"
            self.k_slab, self.v_slab = (torch.empty((self.capacity, B, *x.shape[1:2], x.shape[3]), dtype=x.dtype,
                                                    pin_memory=pin) for x in (key_states, value_states))
        else:
            self.k_slab, self.v_slab = (torch.empty((B, x.shape[1], self.capacity, x.shape[3]), dtype=x.dtype,
                                                    device=x.device) for x in (key_states, value_states))
        self.rows, self.length, self.is_initialized = B, 0, True

    def _host_view(self, slab: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """The host slab's first capacity x rows entries as [capacity, rows, heads, head_dim] (compaction packs
        the live rows there, so every prefix of positions stays contiguous)."""
        c, _, h, d = slab.shape
        rows = self.rows if rows is None else rows
        return slab.view(-1)[: c * rows * h * d].view(c, rows, h, d)

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, T = self.length, key_states.shape[-2]
        r0, r1 = self.window or (0, self.rows)
        if n + T > self.capacity:
            raise RuntimeError(f"KV cache: {n + T} positions exceed the slab's {self.capacity}")
        if self.on_host:
            nb = key_states.device.type == "cuda"
            out = []
            for slab, new in ((self.k_slab, key_states), (self.v_slab, value_states)):
                view = self._host_view(slab)[:, r0:r1]
                past = view[:n].to(new.device, non_blocking=nb).permute(1, 2, 0, 3)
                out.append(torch.cat([past, new], -2))
                view[n:n + T].copy_(new.permute(2, 0, 1, 3), non_blocking=nb)
            self.keys, self.values = out
        else:
            self.k_slab[r0:r1, :, n:n + T] = key_states
            self.v_slab[r0:r1, :, n:n + T] = value_states
            self.keys, self.values = self.k_slab[r0:r1, :, :n + T], self.v_slab[r0:r1, :, :n + T]
        if self.window is None:  # a chunked prefill sets the length once every chunk is in
            self.length = n + T
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        m, n = len(indices), self.length
        if self.on_host:
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the last step's writes into the slab
            idx, slabs = indices.cpu(), (self.k_slab, self.v_slab)
            kept = [self._host_view(slab)[:n, idx].clone() for slab in slabs]
            for slab, k in zip(slabs, kept):
                self._host_view(slab, m)[:n] = k
            self.rows = m
            return
        for slab in (self.k_slab, self.v_slab):
            slab[:m, :, :n] = slab[indices.to(slab.device), :, :n]
        self.rows = m
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


def slabs_only(cache: DynamicCache) -> bool:
    return all(isinstance(layer, SlabLayer) for layer in cache.layers)


def chunked_prefill(cache: DynamicCache, rows: int, length: int, chunks: list[tuple[int, int]], run) -> list:
    """Prefills a batch of `rows` rows of `length` positions in row `chunks` [(r0, r1), ...]: `run(r0, r1)` runs
    the forward over those rows with this cache (each chunk's keys and values land in its rows of the slabs);
    returns run's results. A cache of slabs alone (slabs_only)."""
    for layer in cache.layers:
        layer.expect_rows = rows
    out = []
    for r0, r1 in chunks:
        for layer in cache.layers:
            layer.window = (r0, r1)
        out.append(run(r0, r1))
    for layer in cache.layers:
        layer.window, layer.expect_rows, layer.length = None, None, length
    return out


def cache_bytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        if isinstance(layer, SlabLayer):
            total += layer.nbytes
        elif getattr(layer, "keys", None) is not None and layer.is_initialized:
            total += 2 * layer.keys.numel() * layer.keys.element_size()
    return total
