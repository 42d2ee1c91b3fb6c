"""The machine profile the planner uses: transfer and compute rates, CPU optimizer rate, memory sizes.

`megatrain probe` measures one and writes it as JSON; without one the planner uses `DEFAULTS`, one H200's rates
(calibration.py, DEFAULT_*), and says so. Only the standard library is imported here (the probe runs where pydantic
is not installed).
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from .calibration import (ATTENTION_BY_SEQ, COMPILED_SPEEDUP, DEFAULT_ADAMW_PARAMS_PER_S, DEFAULT_ATTENTION_FLOPS,
                          DEFAULT_BIDIR_BPS, DEFAULT_CPU_FLOPS, DEFAULT_D2H_BPS, DEFAULT_DISK_READ_BPS,
                          DEFAULT_DISK_WRITE_BPS, DEFAULT_GPU_TOTAL_BYTES, DEFAULT_H2D_BPS, DEFAULT_HEAD_FLOPS,
                          DEFAULT_LAYER_FLOPS, DEFAULT_MATMUL_FLOPS, GiB, RATE_SEQ_RANGE)
from .calibration import BLOCKED_ATTENTION_SLOWDOWN, KERNEL_RATE, MOE_DEFAULT_SHARE  # noqa: F401
#                        (the rates' constants, importable from here as before)

PROFILE_VERSION = 1

# Dense bf16 peak FLOP/s by device name (datasheets), for MFU. Unknown devices report no MFU.
PEAK_BF16 = {"H200": 989.4e12, "H100 SXM": 989.4e12, "H100 80GB HBM3": 989.4e12, "H100 PCIe": 756.5e12,
             "H100 NVL": 835.5e12, "GH200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "A800": 312e12,
             "L40S": 362.05e12, "RTX 4090": 165.2e12, "B200": 2250e12}


def peak_bf16_for(name: str) -> float | None:
    for key, flops in sorted(PEAK_BF16.items(), key=lambda kv: -len(kv[0])):  # longest (most specific) first
        if key.lower() in name.lower():
            return flops
    return None



def default_profile_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatrain" / "profile.json"


@dataclass
class LayerRate:
    """One decoder layer's measured rates at one shape (executed FLOPs: forward 2/param/token + attention;
    backward = recompute + backward, 6/param/token + 3x attention)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    micro: int  # sequences per micro-batch
    seq: int
    compile: bool
    forward_flops: float  # executed FLOP/s
    backward_flops: float
    activation_peak_bytes: int | None = None  # torch.cuda.max_memory_allocated growth during recompute+backward
    # MoE layers (0 for dense ones): experts, experts per token, each expert's intermediate size. Their executed
    # FLOPs count the active parameters (the top-k experts), as the planner does.
    experts: int = 0
    top_k: int = 0
    expert_intermediate: int = 0

    @property
    def tokens(self) -> int:
        return self.micro * self.seq

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.hidden, self.intermediate, self.heads, self.kv_heads, self.head_dim, self.experts, self.top_k,
                self.expert_intermediate)


def layer_shape(adapter) -> tuple[int, ...]:
    """What a measured layer rate must match: the attention and MLP sizes, and a MoE layer's expert sizes."""
    moe = tuple(int(getattr(adapter, k, 0)) for k in ("num_experts", "top_k", "expert_intermediate")) \
        if adapter.moe else (0, 0, 0)
    return (adapter.hidden_size, adapter.intermediate_size, adapter.num_heads, adapter.num_kv_heads,
            adapter.head_dim, *moe)


# FlexAttention's block: its block mask holds one entry per 128 queries x 128 keys (activations.mask_bytes); the
# time whole blocks cost over a window's or short documents' span is in calibration.KERNEL_RATE.
FLEX_BLOCK = 128


@dataclass
class Profile:
    source: str  # "defaults" or the file it was read from
    measured: bool
    host: str = ""
    created: str = ""
    gpu_name: str = "NVIDIA H200 (assumed)"
    gpu_total_bytes: int = DEFAULT_GPU_TOTAL_BYTES
    peak_bf16: float | None = 989.4e12
    h2d_bps: float = DEFAULT_H2D_BPS  # pinned, one direction alone
    d2h_bps: float = DEFAULT_D2H_BPS
    bidir_bps: float = DEFAULT_BIDIR_BPS  # per direction, when both run at once
    matmul_flops: float = DEFAULT_MATMUL_FLOPS
    layer_rates: list[LayerRate] = field(default_factory=list)
    # Rates used when no measured layer shape applies: eager layer matmuls (x COMPILED_SPEEDUP compiled), causal
    # flash attention. A measured profile sets layer_flops from its largest probed layer, as an eager rate.
    layer_flops: float = DEFAULT_LAYER_FLOPS
    attention_flops: float = DEFAULT_ATTENTION_FLOPS
    # The chunked LM head with its CUDA kernels; the CPU AdamW alone on the machine (the planner applies the
    # in-step share of it, calibration.ADAMW_IN_STEP).
    head_flops: float = DEFAULT_HEAD_FLOPS
    adamw_params_per_s: float = DEFAULT_ADAMW_PARAMS_PER_S
    adamw_threads: int | None = None  # the optimizer's intra-op threads the rate was measured with (None: torch's)
    adamw_chunks_per_call: int = 1  # CHUNK blocks per AdamW kernel call (runtime/adamw.CpuAdamW)
    cpu_count: int | None = None
    # CPU-device plans: a step's executed FLOP/s in fp32 and in bf16 (a CPU without bf16 instructions emulates it,
    # ~10x slower). A probed profile: square matmuls; `megatrain train` and `plan` on a CPU measure one layer of the
    # run's model at its micro-batch shape at start instead (plan.run_profile): cpu_measured names the precisions.
    cpu_flops: float = DEFAULT_CPU_FLOPS
    cpu_bf16_flops: float = DEFAULT_CPU_FLOPS
    cpu_measured: tuple[str, ...] = ()
    host_total_bytes: int | None = None
    host_available_bytes: int | None = None
    # The SSD tier's disk (memory.disk_path), O_DIRECT with 16 MiB requests. A profile's "disk": {"read_bps",
    # "write_bps"} (`megatrain probe --disk PATH`) replaces them, as does the measurement `megatrain train` makes at
    # memory.disk_path when the profile has none (runtime/disk_probe.py); disk_source says which.
    disk_read_bps: float = DEFAULT_DISK_READ_BPS
    disk_write_bps: float = DEFAULT_DISK_WRITE_BPS
    disk_source: str = "the defaults: a local disk with O_DIRECT; `megatrain probe --disk PATH` measures one"
    disk_measured: bool = False

    def layer_rate(self, adapter, micro: int, seq: int, compile: bool) -> tuple[LayerRate | None, str]:
        """The measured rate for this layer shape, nearest micro-batch size (and compile mode) first, among those
        probed at rows within RATE_SEQ_RANGE of `seq`: a layer's rate mixes its matmuls and its attention, whose
        share of the FLOPs grows with the row (a Llama-3.1-8B layer: ~7% at 4,096 tokens, ~91% at 524,288), so
        a rate probed at another length says nothing of this one (the default branch then times the matmuls and
        the attention apart: timing.step_time)."""
        same = [r for r in self.layer_rates if r.shape == layer_shape(adapter)]
        if not same:
            return None, "no measured layer of this shape"
        near = [r for r in same if r.seq <= seq * RATE_SEQ_RANGE and seq <= r.seq * RATE_SEQ_RANGE]
        if not near:
            return None, (f"the layer probed at rows of {', '.join(str(r.seq) for r in same)} tokens, too far from "
                          f"{seq} to take its rate")
        same = near
        tokens = micro * seq
        best = min(same, key=lambda r: (r.compile != compile, abs(r.seq - seq) / seq, abs(r.tokens - tokens) / tokens))
        exact = best.compile == compile and best.seq == seq and best.micro == micro
        how = "measured at this shape" if exact else \
            f"measured at {best.micro}x{best.seq} tokens{' compiled' if best.compile else ''}"
        return best, how


    def attention_rate(self, seq: int) -> float:
        """The causal attention rate at `seq` tokens per row: `attention_flops` (fitted on rows of 1k-4k tokens)
        scaled by ATTENTION_BY_SEQ (flash attention runs far faster on long rows), log-linear between anchors."""
        pts = ATTENTION_BY_SEQ
        if seq <= pts[0][0]:
            return self.attention_flops * pts[0][1]
        for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
            if seq <= t1:
                f = math.log2(seq / t0) / math.log2(t1 / t0)
                return self.attention_flops * (r0 + f * (r1 - r0))
        return self.attention_flops * pts[-1][1]

DEFAULTS = Profile(source="defaults", measured=False)


def load_profile(path: str | Path | None) -> Profile:
    """The profile at `path`; with None, the default location if a probe wrote one there, else DEFAULTS."""
    explicit = path is not None
    p = Path(path).expanduser() if explicit else default_profile_path()
    if not p.is_file():
        if explicit:
            from ..errors import MegatrainError

            raise MegatrainError(f"plan.profile: {p} does not exist (write one with `megatrain probe --out {p}`)")
        return DEFAULTS
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        from ..errors import MegatrainError

        raise MegatrainError(f"plan.profile: {p} is not a readable profile ({e})") from None
    return from_dict(raw, str(p))


def from_dict(raw: dict, source: str) -> Profile:
    prof = Profile(source=source, measured=True, host=raw.get("host", ""), created=raw.get("created", ""))
    gpu = raw.get("gpu") or {}
    if gpu:
        prof.gpu_name = gpu.get("name", prof.gpu_name)
        prof.gpu_total_bytes = int(gpu.get("total_bytes", prof.gpu_total_bytes))
        prof.peak_bf16 = gpu.get("peak_bf16_flops", peak_bf16_for(prof.gpu_name))
        bw = gpu.get("bandwidth", {})
        prof.h2d_bps = bw.get("h2d_pinned_bps", prof.h2d_bps)
        prof.d2h_bps = bw.get("d2h_pinned_bps", prof.d2h_bps)
        prof.bidir_bps = bw.get("bidirectional_per_direction_bps", prof.bidir_bps)
        prof.matmul_flops = gpu.get("matmul_bf16_flops", prof.matmul_flops)
        prof.layer_rates = [LayerRate(**{k: v for k, v in r.items() if k in LayerRate.__dataclass_fields__})
                            for r in gpu.get("layers", [])]
        dense = [r for r in prof.layer_rates if not r.experts]
        if dense:  # the rate for unprobed shapes: the largest probed dense layer's, as an eager rate
            best = max(dense, key=lambda r: (r.tokens, not r.compile))
            prof.layer_flops = (best.forward_flops + 3 * best.backward_flops) / 4 / \
                (COMPILED_SPEEDUP if best.compile else 1.0)
        prof.head_flops = gpu.get("head_flops", prof.head_flops)
    else:
        prof.gpu_name, prof.gpu_total_bytes, prof.peak_bf16 = "", 0, None
    cpu = raw.get("cpu") or {}
    prof.adamw_params_per_s = cpu.get("adamw_params_per_s", prof.adamw_params_per_s)
    prof.adamw_threads = cpu.get("adamw_threads")
    prof.adamw_chunks_per_call = int(cpu.get("adamw_chunks_per_call", 1))
    prof.cpu_count = cpu.get("count")
    prof.cpu_flops = cpu.get("matmul_flops", prof.cpu_flops)
    prof.cpu_bf16_flops = cpu.get("matmul_bf16_flops", prof.cpu_flops)
    disk = raw.get("disk") or {}
    if disk:
        prof.disk_read_bps = disk.get("read_bps", prof.disk_read_bps)
        prof.disk_write_bps = disk.get("write_bps", prof.disk_write_bps)
        prof.disk_source, prof.disk_measured = f"{source}, measured at {disk.get('path', '?')}", True
    mem = raw.get("host_memory") or {}
    prof.host_total_bytes = mem.get("total_bytes")
    prof.host_available_bytes = mem.get("available_bytes")
    return prof


def this_host() -> str:
    return socket.gethostname()
