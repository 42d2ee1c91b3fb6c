"""The machine profile the planner uses: transfer and compute rates, CPU optimizer rate, memory sizes.

`megatrain probe` measures one and writes it as JSON; without one the planner uses `DEFAULTS`, the H200
measurements of DESIGN.md and of the first benchmark runs (bench/results/2026-11-21), and says so. Only the
standard library is imported here (the probe runs where pydantic is not installed).
"""

from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

GiB = 2**30
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


# Compiled / eager rate of a decoder layer on the H200 (2026-11-21): qwen2.5-7b at the same 161,792 tokens per
# step, the layers took 16.12 s eager (32-row micro-batches) and 13.75 s compiled (79 rows), the busy compute time
# less the LM head (eager in both runs): 1.17. Converts a layer rate the profile has only in the other mode.
COMPILED_SPEEDUP = 1.17


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


# The attention rate against the row length, as a multiple of Profile.attention_flops (the 1k-4k fit), log-linear
# between anchors, flat beyond 256k (not measured). 32k: fitted to Llama-3.1-8B with one 32,768-token row per step
# on an H200 (bench/results/2026-11-25/h200-noclip: 5.3-5.5 s of busy compute, which the layer matmuls at the
# default rate leave to attention at 390 TFLOP/s, x COMPILED_SPEEDUP compiled). 128k: fitted to the Llama-3.1-8B
# one-sequence 131,072-token run (nvidia-h200, bench/results/2026-11-25/h200-longctx-128k: 50.8 s; the earlier
# anchor, SDPA's forward decline 674 -> 564 TFLOP/s from 32k, planned 59.3 s): per FLOP the step's attention runs
# at 128k as at 32k. 256k: the 128k anchor times SDPA's forward decline from 128k (564 -> 526, measured on the
# H200), not yet checked against a run.
RATE_SEQ_RANGE = 4.0  # a probed layer's rate applies to rows within this factor of its own (Profile.layer_rate)
ATTENTION_BY_SEQ = ((4096, 1.0), (32768, 390 / 170), (131072, 2.34), (262144, 2.34 * 526 / 564))

# FlexAttention against SDPA's causal flash kernel at the same shape, by the score FlexAttention applies and
# head_dim: (flash forward, flash forward + backward, flex forward, flex forward + backward) in milliseconds over
# 8 rows x 4096 tokens with heads x head_dim = 4096 (FLEX_SHAPE_FLOPS forward FLOPs by the planner's count);
# measured on the H200 through megatrain's own attention functions (bench/attention_kernels.py,
# bench/results/2026-11-25/h200-diag/attention_kernels.json; Llama's shape at one 32k row: 14.7 / 55.7 / 20.5 /
# 77.1). A layer runs FlexAttention for packed rows, a sliding window shorter than the row, or a score SDPA cannot
# apply (ModelAdapter.cuda_attention). The planner's attention rate is fitted to flash runs; a FlexAttention layer
# costs the measured difference per FLOP on top (timing.flex_extra).
FLEX_MEASURED = {
    ("plain", 64): (2.488, 9.902, 3.207, 14.013), ("sinks", 64): (2.488, 9.902, 3.567, 15.275),
    ("plain", 128): (1.818, 7.658, 2.991, 11.196),
    ("plain", 256): (1.654, 9.407, 4.107, 25.179), ("softcap", 256): (1.654, 9.407, 6.778, 35.421),
}
FLEX_SHAPE_FLOPS = 2.0 * 4096 * 4096 * 8 * 4096
# FlexAttention computes whole blocks of 128 queries x 128 keys: a sliding window of W keys costs the blocks it
# touches, W rounded up to blocks plus one.
FLEX_BLOCK = 128

# The attention whose backward runs over blocks (Placement.attn_block, models/attention.blockwise_causal): forward
# over the row, backward per block pair, with the kernels SDPA itself picks for the row (cuDNN's on Hopper), where
# the planner's attention rate is SDPA's for the whole row. Measured on the H200 (bench/blocked_attention.py,
# results/2026-11-25/h200-rss-diag; Llama-3.1-8B's heads, blocks of 65,536): forward + backward 1.0075x and 1.0002x
# SDPA's at 131,072 and 262,144 tokens (0.917 s against 0.910; 3.717 against 3.716). Until 2026-11-25 the blocked
# attention ran the flash op, at 1.66-1.68x (H100, results/2026-11-25/h100-llama512k; the H200: 1.68x). Where SDPA
# picks the flash op itself (before Hopper) the blocked one runs the same kernels: not measured there.
BLOCKED_ATTENTION_SLOWDOWN = 1.01

# A MoE layer with no measured rate runs at this share of the default (dense) layer rate: routing, the token
# permutation and grouped GEMMs over a few thousand tokens per expert are slower than one dense GEMM. Fitted to
# the one MoE run measured (Qwen3-30B-A3B, 12 layers, 256 x 4096 per step, compiled, one H200,
# bench/results/2026-11-25/h200-moe): the layers took 21.2 s of the 24.4 s busy compute (the head 3.1 s), the
# default rate gave 17.2 s. A probed MoE layer (`megatrain probe --layer MODEL:BxT`) replaces it.
MOE_DEFAULT_SHARE = 0.81


@dataclass
class Profile:
    source: str  # "defaults" or the file it was read from
    measured: bool
    host: str = ""
    created: str = ""
    gpu_name: str = "NVIDIA H200 (assumed)"
    gpu_total_bytes: int = int(139.8 * GiB)
    peak_bf16: float | None = 989.4e12
    h2d_bps: float = 55.5e9  # pinned, one direction alone
    d2h_bps: float = 55.5e9
    bidir_bps: float = 50.8e9  # per direction, when both run at once (101.6 GB/s together)
    matmul_flops: float = 790e12
    layer_rates: list[LayerRate] = field(default_factory=list)
    # Rates used when no measured layer shape applies, fitted (least squares on the relative step time, the
    # rates below held at their probed values) to the 19 H200 runs of bench/results/2026-11-21 (7B/8B, a 3B
    # shape, a 16-128 layer depth sweep, spill/offload): eager layer matmuls (x COMPILED_SPEEDUP compiled),
    # causal flash attention. A measured profile sets layer_flops from its largest probed layer, as an eager rate.
    layer_flops: float = 560e12
    attention_flops: float = 170e12
    # The chunked LM head with its CUDA kernels (fused cross-entropy, in-GEMM accumulation): 628 TFLOP/s at the
    # Llama-3.1-8B shape (bench/results/2026-11-21/call10/kernel_variants_call10.json; the eager head of the
    # first runs: 387). The CPU AdamW (alone on the machine, bf16 copy written): the H200 probe
    # (bench/results/2026-11-21/h200_profile.json). The planner applies the in-step share of the AdamW rate.
    head_flops: float = 628e12
    adamw_params_per_s: float = 4.55e9
    adamw_threads: int | None = None  # the optimizer's intra-op threads the rate was measured with (None: torch's)
    cpu_count: int | None = None
    # CPU-device plans: a step's executed FLOP/s in fp32 and in bf16 (a CPU without bf16 instructions emulates it,
    # ~10x slower). A probed profile: square matmuls; `megatrain train` and `plan` on a CPU measure one layer of the
    # run's model at its micro-batch shape at start instead (plan.run_profile): cpu_measured names the precisions.
    cpu_flops: float = 0.5e12
    cpu_bf16_flops: float = 0.5e12
    cpu_measured: tuple[str, ...] = ()
    host_total_bytes: int | None = None
    host_available_bytes: int | None = None
    # The SSD tier's disk (memory.disk_path): O_DIRECT with 16 MiB requests, DESIGN.md's local disk (a real NVMe
    # RAID does 10-25 GB/s). A profile's "disk": {"read_bps", "write_bps"} (`megatrain probe --disk PATH`)
    # replaces them, as does the measurement `megatrain train` makes at memory.disk_path when the profile has none
    # (runtime/disk_probe.py); disk_source says which.
    disk_read_bps: float = 1.2e9
    disk_write_bps: float = 1.6e9
    disk_source: str = "DESIGN.md's local disk (the defaults; `megatrain probe --disk PATH` measures one)"
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
