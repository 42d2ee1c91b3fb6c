"""Page-locked host memory: the one owner of every `cudaHostRegister` in megatrain.

The GPU copies to and from host memory at full PCIe speed only when that memory is page-locked (pinned):
55 GB/s against 10 GB/s from pageable memory (docs/design.md, rule 5). `torch.empty(pin_memory=True)` is slow
(0.3-0.5 s/GiB) and rounds every block up to a power of two, so megatrain allocates ordinary page-aligned memory,
touches it, and registers it with `cudaHostRegister` (~0.03 s/GiB, exact size). `PinnedHost` does that for the host
store's streaming copy, the optimizer pipeline's landing buffers and offloaded gradients, and the activation spill:
every registration's error is checked (a failure names the buffer and the memlock limit), and `close()`
unregisters whatever is still registered. Without CUDA nothing is registered and the buffers are plain memory.
"""

from __future__ import annotations

import torch

from ..errors import MegatrainError

PAGE = 4096
GiB = 2**30


def aligned_empty(numel: int, dtype: torch.dtype, zero: bool) -> torch.Tensor:
    """A flat tensor whose first element sits on a page boundary."""
    esize = torch.empty((), dtype=dtype).element_size()
    pad = PAGE // esize
    raw = torch.empty(numel + pad, dtype=dtype)
    offset = (-raw.data_ptr() % PAGE) // esize
    buf = raw[offset: offset + numel]
    if zero:
        buf.zero_()
    return buf


class PinnedHost:
    """Registers host buffers for DMA and keeps the list, so each is unregistered exactly once.

    cuda: register at all (False: a CPU run; `empty` returns plain aligned memory). cudart: the CUDA runtime
    bindings (default `torch.cuda.cudart()`; tests pass a stand-in to exercise the error paths on CPU)."""

    def __init__(self, cuda: bool, cudart=None):
        self.cuda = cuda
        self._cudart = cudart
        self._registered: dict[int, tuple[int, str]] = {}  # data_ptr -> (bytes, what)

    @property
    def cudart(self):
        if self._cudart is None:
            self._cudart = torch.cuda.cudart()
        return self._cudart

    @property
    def registered_bytes(self) -> int:
        return sum(n for n, _ in self._registered.values())

    def empty(self, numel: int, dtype: torch.dtype, what: str, zero: bool = False) -> torch.Tensor:
        """A new page-aligned buffer, registered on CUDA. `what` names it in errors ("gradient landing buffer")."""
        buf = aligned_empty(numel, dtype, zero=zero)
        self.register(buf, what)
        return buf

    def register(self, buf: torch.Tensor, what: str) -> None:
        """Register an existing buffer (contiguous, page-aligned). A no-op without CUDA or when already done."""
        if not self.cuda or buf.numel() == 0 or buf.data_ptr() in self._registered:
            return
        nbytes = buf.numel() * buf.element_size()
        err = int(self.cudart.cudaHostRegister(buf.data_ptr(), nbytes, 0))
        if err != 0:
            raise MegatrainError(
                f"pinning the {what} ({nbytes / GiB:.2f} GiB of host memory) failed: cudaHostRegister returned "
                f"{err} ({self._error_name(err)}); {self.registered_bytes / GiB:.2f} GiB were pinned before it. "
                f"Is the memlock limit (`ulimit -l`, or the container's) lower than that? `megatrain plan` shows "
                f"the pinned total")
        self._registered[buf.data_ptr()] = (nbytes, what)

    def release(self, buf: torch.Tensor) -> None:
        """Unregister one buffer (before it is replaced by a larger one, or freed)."""
        if self._registered.pop(buf.data_ptr(), None) is not None:
            self.cudart.cudaHostUnregister(buf.data_ptr())

    def close(self) -> None:
        """Unregister everything still registered; the buffers themselves are freed by their owners."""
        for ptr in list(self._registered):
            self.cudart.cudaHostUnregister(ptr)
        self._registered.clear()

    def _error_name(self, err: int) -> str:
        try:
            return str(self.cudart.cudaGetErrorString(err))
        except Exception:  # the name is a courtesy
            return "unknown error"


# torch's own caching host allocator (pin_memory(), tensors Inductor's autotuning copies to host: it keeps the
# mutated arguments of a kernel it benchmarks in page-locked host memory when a copy on the GPU would raise the
# GPU's peak) keeps every block it ever made. A compiled run's first step left 4 GiB there (Qwen2.5-7B, micro-batches
# of 80,896 tokens, fp32 streaming; bench/autotune_copies.py measures it), which no later step used.
TORCH_PINNED_IDLE = 64 * 2**20


_after_release = [0]  # what the allocator held after the last release: freed again only once it has grown


def release_torch_pinned_cache(min_idle: int = TORCH_PINNED_IDLE) -> int:
    """Return the free blocks of torch's caching host allocator to the system once it holds `min_idle` bytes more
    than after the last release (its stats count a freed block as active until it processes the block's events,
    which its empty_cache does first; cudaFreeHost waits for the device: not every step). Returns the bytes
    released (0: nothing done)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    if held - _after_release[0] < min_idle:
        return 0
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or \
        getattr(torch._C, "_host_emptyCache", None)
    if empty is None:
        return 0
    empty()
    _after_release[0] = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    return max(0, held - _after_release[0])
