"""Every fitted constant of the planner, in one table: its value, unit, what it means and why it has that value, and
the benchmark that refits it.

A fitted constant is a number chosen to match measurement (a rate, an efficiency, an overhead in bytes, a slowdown,
a threshold set by the plan's measured accuracy), as opposed to a unit or a definition. The modules that use one
import it from here (`from .calibration import GPU_RESERVE`) and keep it importable under their own name
(`memory.GPU_RESERVE`, `profile.COMPILED_SPEEDUP`, ...). `TABLE` lists them all; tests/test_calibration.py checks
that each has its unit, meaning and refitting benchmark, and that no planner module defines one elsewhere.

Most were fitted on one H200 machine (16 cores, PCIe Gen5 x16, 128 GiB RAM) and checked on an H100 80GB with the same
host side: `megatrain probe` replaces the machine's rates (`Profile`'s defaults below) with its own. To refit one,
run its benchmark, then `python3 bench/plan_vs_measured.py RESULTS_DIR` and `python3 bench/plan_choices.py` to see
what the change moves. Only the standard library is imported here (profile.py and the probe import this module).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


@dataclass(frozen=True)
class Fit:
    name: str
    value: float | int | tuple | dict  # a rate or size; a range or a table keyed by shape
    unit: str
    meaning: str  # what it is and why it has this value
    refit: str  # the command whose measurement refits it


TABLE: dict[str, Fit] = {}


def _fit(name: str, value, unit: str, meaning: str, refit: str):
    TABLE[name] = Fit(name, value, unit, meaning, refit)
    return value


# Benchmark commands (bench/README and docs/benchmarks.md say more of each)
_BENCH = "python3 bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79"
_CLI = "python3 bench/bench_cli.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79"
_LONG = "python3 bench/bench_cli.py --model bench/model-configs/llama-3.1-8b --seqs 1 --micro 1 --compile"
_PVM = "python3 bench/plan_vs_measured.py RESULTS_DIR"
_PROBE = "megatrain probe"

# ---- host memory (memory.host_memory) ----------------------------------------------------------------------------
RUNTIME_HOST = _fit(
    "RUNTIME_HOST", {"cuda": 1.5 * GiB, "cpu": 0.6 * GiB}, "bytes, by device",
    "peak RSS of the runtime itself (Python, torch, CUDA libraries) beyond the store's buffers: the host peak of the "
    "bench runs less every component the plan counts", f"{_BENCH} --compile --json OUT.json; {_PVM} (host peak RSS)")
DATA_BYTES_PER_TOKEN = _fit(
    "DATA_BYTES_PER_TOKEN", 64.0, "bytes per token of a step",
    "one step's rows in host memory: input ids, labels and positions as int64 and their pinned copies for the device, "
    "with room for the sampler's index (the tokenised data stays in memory-mapped Arrow files, page cache)",
    f"{_CLI} --compile --json OUT.json; {_PVM} (host peak RSS of the real command)")
DATA_FIXED_GIB = _fit(
    "DATA_FIXED_GIB", 0.25, "GiB",
    "the data path's fixed host memory (tokenizer, sampler, dataset handles) besides DATA_BYTES_PER_TOKEN",
    f"{_CLI} --compile --json OUT.json; {_PVM} (host peak RSS of the real command)")
CHECKPOINT_EXTRA = _fit(
    "CHECKPOINT_EXTRA", 16 * 2**20, "bytes per checkpoint",
    "what a save writes beside the fp32 master, m and v (the run state, the manifest): an allowance above their size",
    f"{_CLI} --set checkpoint.at_end=true --workdir W (the checkpoint's size on disk against 12 B/param)")
COMPILED_HOST_FROM_TOKENS = _fit(
    "COMPILED_HOST_FROM_TOKENS", 32768, "tokens per micro-batch",
    "a torch.compile'd run's extra peak RSS (Inductor's autotuning copies, where memory.autotune_host has no model "
    "of them: MoE layers) is COMPILED_HOST_BASE_GIB up to micro-batches of this many tokens, rising linearly above",
    f"{_BENCH} --compile --micro M --json OUT.json for several M; {_PVM} (host peak RSS)")
COMPILED_HOST_FULL_TOKENS = _fit(
    "COMPILED_HOST_FULL_TOKENS", 80896, "tokens per micro-batch",
    "micro-batches from which that extra RSS stays at COMPILED_HOST_BASE_GIB + COMPILED_HOST_RISE_GIB (4.4 GiB)",
    f"{_BENCH} --compile --micro M --json OUT.json for several M; {_PVM} (host peak RSS)")
COMPILED_HOST_BASE_GIB = _fit(
    "COMPILED_HOST_BASE_GIB", 0.3, "GiB",
    "a compiled run's extra peak RSS at micro-batches of COMPILED_HOST_FROM_TOKENS tokens or fewer",
    f"{_BENCH} --compile --micro M --json OUT.json for several M; {_PVM} (host peak RSS)")
COMPILED_HOST_RISE_GIB = _fit(
    "COMPILED_HOST_RISE_GIB", 4.1, "GiB",
    "what that extra RSS adds from COMPILED_HOST_FROM_TOKENS to COMPILED_HOST_FULL_TOKENS tokens per micro-batch",
    f"{_BENCH} --compile --micro M --json OUT.json for several M; {_PVM} (host peak RSS)")

# ---- GPU memory (memory.gpu_phases, memory.gpu_needed) --------------------------------------------------------
GPU_WORKSPACE = _fit(
    "GPU_WORKSPACE", int(0.25 * GiB), "bytes",
    "cuBLAS/cuDNN workspaces held in the caching allocator through the step",
    f"{_BENCH} --json OUT.json; {_PVM} (GPU peak allocated)")
GPU_RESERVE = _fit(
    "GPU_RESERVE", 0.10, "share of the allocated peak",
    "the caching allocator's reserve above the allocated peak with eager layers (fragmentation): reserved / allocated "
    "measured 1.07-1.09 over the eager runs", f"{_BENCH} --json OUT.json (gpu_reserved_gib / gpu_peak_gib)")
GPU_RESERVE_COMPILED = _fit(
    "GPU_RESERVE_COMPILED", 0.35, "share of the allocated peak",
    "the same reserve with compiled layers, whose kernels' buffers fragment more: reserved / allocated 1.18-1.49; "
    "not lower for a tiled layer (Gemma-2-9B's 4,096-token micro-batches through tiles of 8,192 tokens reserved "
    "1.43x), only for one long row (GPU_RESERVE_LONG_ROW)", f"{_BENCH} --compile --json OUT.json (reserved / peak)")
GPU_RESERVE_STREAMS = _fit(
    "GPU_RESERVE_STREAMS", 0.20, "share of the allocated peak",
    "added to the reserve when inputs are spilled, gradients sent to host or accumulators parked on the host: the "
    "side streams' record_stream delays reuse (eager runs with spill and offload: 1.29)",
    f"{_BENCH} --spill S --offload N --json OUT.json (reserved / peak)")
LONG_ROW = _fit(
    "LONG_ROW", 131072, "tokens",
    "rows from which one row per micro-batch through the tiled layer gets GPU_RESERVE_LONG_ROW: a few large "
    "same-sized buffers per layer use, which the allocator reuses", f"{_LONG} --seq 131072 (reserved / allocated)")
GPU_RESERVE_LONG_ROW = _fit(
    "GPU_RESERVE_LONG_ROW", 0.10, "share of the allocated peak",
    "the reserve of one row of LONG_ROW tokens or more through the tiled layer: reserved / allocated 1.013-1.083 "
    "(Llama-3.1-8B and Qwen2.5-7B at 128k-256k tokens; the same row through the untiled compiled layer: 1.30, "
    "which this does not cover)", f"{_LONG} --seq 131072, --seq 262144 (reserved / allocated)")
GPU_RESERVE_LONG_ROW_STREAMS = _fit(
    "GPU_RESERVE_LONG_ROW_STREAMS", 0.12, "share of the allocated peak",
    "added to GPU_RESERVE_LONG_ROW with spilled inputs or gradients sent to host: the 512k rows measured 1.152 "
    "(H200) and 1.216 (H100, the attention's backward in blocks, expandable segments on)",
    f"{_LONG} --seq 524288 --set memory.spill_layers=S (reserved / allocated)")
CUDA_CONTEXT = _fit(
    "CUDA_CONTEXT", int(0.6 * GiB), "bytes",
    "the CUDA context and libraries' device memory, outside the caching allocator",
    f"{_BENCH} --json OUT.json (the GPU's used memory in nvidia-smi during the run, less gpu_reserved_gib)")
COMPILED_ACTIVATIONS = _fit(
    "COMPILED_ACTIVATIONS", 0.67, "compiled / eager",
    "a compiled layer's recompute+backward activation peak against the eager template's (measured on the meta "
    "device): compiling fuses the layer's elementwise work; a probe at the shape replaces it",
    f"{_BENCH} --compile --json OUT.json; {_PVM} (GPU peak), or megatrain probe --layer MODEL:BxT --compile both")

# ---- placement (choice.choose) ---------------------------------------------------------------------------------
SEQ_TILE = _fit(
    "SEQ_TILE", 8192, "tokens",
    "tokens per MLP tile when the planner tiles: GEMMs of this many rows run at the dense rate on an H100/H200 "
    "(686-741 TFLOP/s at 16k rows), and one tile's MLP work of a 7-8B layer is 1-2 GiB, small beside the "
    "attention's at the lengths that need tiling", f"{_LONG} --seq 131072 --set memory.seq_tile=T for T = 4096, 8192, "
    "16384 (the smallest T at the untiled step's rate)")
REUSE_FROM = _fit(
    "REUSE_FROM", 32768, "tokens",
    "rows from which layers may keep their attention for the backward (memory.reuse_attention): there the attention "
    "forward is 6% or more of a 7-8B step (14% at 128k); below, keeping it trades the compiled whole layer for the "
    "split one for about 1%", f"{_LONG} --seq S --set memory.reuse_attention=N for S = 16384, 32768 (against N = 0)")
ATTN_BLOCK = _fit(
    "ATTN_BLOCK", 65536, "tokens",
    "queries and keys per block of the attention's backward when the planner blocks it: a 65,536 x 65,536 pair is "
    "~10^14 FLOPs for a 32-head layer (long enough to run at the kernel's rate), its working set ~2.75 GiB against "
    "16 GiB for the fused backward at 512k", "python3 bench/blocked_attention.py --seqs 131072 262144 --block B")
NEAR_FASTEST = _fit(
    "NEAR_FASTEST", 0.05, "share of the fastest step",
    "placements predicted this close to the fastest count as fast, and of those the least host RAM wins: within "
    "the plan's step-time error, so the choice does not follow noise in the time model", f"{_PVM} (step time error)")
HOST_HEADROOM = _fit(
    "HOST_HEADROOM", 0.05, "share of the host RAM limit",
    "host RAM a placement should leave free to be preferred over one that uses less: the plan's host figure has been "
    "within 4.6% of the measured peak, so a placement planned closer to the limit may not fit",
    f"{_PVM} (host peak RSS error)")

# ---- step time (timing.step_time, timing._simulate) -------------------------------------------------------------
ADAMW_IN_STEP = _fit(
    "ADAMW_IN_STEP", 0.62, "share of the probed AdamW rate",
    "the CPU AdamW inside a training step, against its rate alone on an idle machine (the probe's): in a step it "
    "shares the cores with the training thread and host memory with the PCIe copies. The GPU idle time of each "
    "default-profile H200 run (the forward of unit u waiting for unit u's update) implies 0.44-0.72, median 0.62 "
    "(2.8 Gparam/s), over 33k to 262k tokens per step", f"{_BENCH} --compile --json OUT.json; {_PVM} (GPU idle)")
FP32_SLOWDOWN = _fit(
    "FP32_SLOWDOWN", 989.0 / 67.0, "bf16 rate / fp32 rate",
    "fp32 runs compute in fp32 without TF32: the H100/H200 datasheet's dense bf16 989 TFLOP/s against fp32 67. A "
    "datasheet ratio, not fitted: a run in fp32 mode is for exactness, not speed (the plan says so in its rate "
    "source)", f"{_BENCH} --precision fp32 --json OUT.json (against the same run in bf16)")
SATURATED = _fit(
    "SATURATED", 0.9, "share of the update window",
    "without clipping, the CPU optimizer is named the step's bound when, having made the GPU wait, it was busy "
    "(updating or waiting for a gradient's copy) this share of the time from the first gradient queued to the "
    "embedding's update", f"{_CLI} --compile --set train.max_grad_norm=null --json OUT.json; {_PVM} (bound column)")

# ---- rates (profile.Profile, timing) ----------------------------------------------------------------------------
COMPILED_SPEEDUP = _fit(
    "COMPILED_SPEEDUP", 1.17, "compiled rate / eager rate",
    "a decoder layer's compiled rate against its eager rate: Qwen2.5-7B at the same 161,792 tokens per step, the "
    "layers took 16.12 s eager (32-row micro-batches) and 13.75 s compiled (79 rows), busy compute less the (eager) "
    "LM head. Converts a layer rate the profile has only in the other mode",
    f"{_BENCH} --json OUT.json against --micro 79 --compile, or megatrain probe --layer MODEL:BxT --compile both")
RATE_SEQ_RANGE = _fit(
    "RATE_SEQ_RANGE", 4.0, "factor of row length",
    "a probed layer's rate applies to rows within this factor of its own length: a layer's rate mixes its matmuls and "
    "its attention, whose share grows with the row (a Llama-3.1-8B layer: ~7% at 4,096 tokens, ~91% at 524,288)",
    f"{_PROBE} --layer MODEL:BxT at several T (how far a rate carries)")
ATTENTION_BY_SEQ = _fit(
    "ATTENTION_BY_SEQ", ((4096, 1.0), (32768, 390 / 170), (131072, 2.34), (262144, 2.34 * 526 / 564)),
    "(tokens per row, x attention_flops)",
    "the causal attention rate against the row length, as a multiple of Profile.attention_flops (fitted on rows of "
    "1k-4k), log-linear between anchors, flat beyond 256k. 32k: Llama-3.1-8B, one 32,768-token row per step (busy "
    "compute 5.3-5.5 s, which the layer matmuls at the default rate leave to attention at 390 TFLOP/s). 128k: the "
    "131,072-token one-row run (50.8 s): per FLOP the attention runs at 128k as at 32k. 256k: the 128k anchor times "
    "SDPA's forward decline from 128k to 256k (564 -> 526 TFLOP/s), not checked against a run",
    f"{_LONG} --seq S for S = 32768, 131072, 262144; {_PVM} (step time)")
KERNEL_RATE = _fit(
    "KERNEL_RATE", {
        ("varlen", "plain", 128): ((370, 0.146, 0.158), (1374, 0.356, 0.358), (1796, 0.398, 0.415),
                                   (4096, 0.546, 0.547), (18545, 0.568, 0.589), (32768, 0.518, 0.591),
                                   (49228, 0.609, 0.607), (131072, 0.602, 0.613)),
        ("varlen", "plain", 256): ((1798, 0.344, 0.453), (4096, 0.445, 0.57)),
        ("flex", "plain", 64): ((248, 0.129, 0.153), (1798, 0.339, 0.439), (4096, 0.81, 0.715)),
        ("flex", "plain", 128): ((370, 0.165, 0.179), (1374, 0.364, 0.418), (1796, 0.439, 0.484), (4096, 0.583, 0.661),
                                 (18545, 0.659, 0.701), (32768, 0.633, 0.723), (49228, 0.759, 0.73)),
        ("flex", "plain", 256): ((1798, 0.338, 0.282), (4096, 0.406, 0.373)),
        ("flex", "sinks", 64): ((248, 0.101, 0.108), (1798, 0.295, 0.374), (4096, 0.719, 0.63)),
        ("flex", "softcap", 256): ((1798, 0.315, 0.305), (4096, 0.426, 0.411)),
    }, "(span, forward share, forward + backward share) by (kernel, score, head_dim)",
    "the rate of the attention kernels other than SDPA's causal one, per FLOP they execute, as a share of SDPA's "
    "over plain rows of the same head_dim and length, against the span the rows attend over per token (their "
    "documents', Σd²/T; a window's): log-linear in the span between points, flat beyond. A layer on FlexAttention "
    "(packed rows under 32,768 tokens at head_dim 128 and below, windows, Gemma 2's soft-capping, gpt-oss's sinks) or "
    "the variable-length flash kernel (packed rows otherwise) costs, on top of its attention at the planner's rate, "
    "the time its kernel takes beyond SDPA's at SDPA_RATE over the same FLOPs (kernel_time.kernel_extra). Short "
    "documents cost more per FLOP (blocks and tails partly empty): documents of 50-600 tokens run at a seventh of "
    "SDPA's rate, of 200-3,000 at two fifths, whole rows at 0.52-0.61 (varlen) and 0.58-0.72 (FlexAttention, "
    "head_dim 128), documents of 32,768-98,304 tokens at 0.61 (varlen) and 0.73-0.76 (FlexAttention); Gemma 2's "
    "capped scores at head_dim 256 0.31-0.43 (0.19-0.27 before the sigmoid form and Hopper's tiles, "
    "models/attention.py)",
    "python3 bench/attention_kernels.py --quick --json OUT.json (prints calibration.KERNEL_RATE)")
SDPA_RATE = _fit(
    "SDPA_RATE", {128: ((4096, 577e12, 497e12), (32768, 668e12, 547e12), (131072, 553e12, 533e12)),
                  64: ((4096, 425e12, 388e12),), 256: ((4096, 652e12, 407e12),)},
    "(tokens per row, forward FLOP/s, forward + backward FLOP/s) by head_dim; FLOPs: 2·T·heads·head_dim per token "
    "forward, 3.5x that forward + backward",
    "SDPA's causal kernel alone over plain bf16 rows (8 x 4,096 tokens; one row of 32,768 and 131,072), the kernel "
    "KERNEL_RATE's shares are of: what a layer's other kernel takes beyond it is timed at this rate (the planner's "
    "attention rate, ATTENTION_BY_SEQ, is a layer's whole attention, per-token work included, fitted to runs: a "
    "third of the kernel's at 4,096 tokens), log-linear in the row length between points, flat beyond",
    "python3 bench/attention_kernels.py --quick --json OUT.json (prints calibration.SDPA_RATE)")
BLOCKED_ATTENTION_SLOWDOWN = _fit(
    "BLOCKED_ATTENTION_SLOWDOWN", 1.01, "blocked time / SDPA's time",
    "the attention whose backward runs over block pairs (memory.attn_block), with the kernels SDPA itself picks for "
    "the row (cuDNN's on Hopper), against SDPA's whole-row kernel: forward + backward 1.0075x and 1.0002x at 131,072 "
    "and 262,144 tokens (Llama-3.1-8B's heads, blocks of 65,536). The flash op per pair ran 1.66-1.68x; where SDPA "
    "picks the flash op itself (before Hopper) the blocked one runs the same kernels: not measured there",
    "python3 bench/blocked_attention.py --seqs 131072 262144 --block 65536")
MOE_DEFAULT_SHARE = _fit(
    "MOE_DEFAULT_SHARE", 0.81, "share of the dense layer rate",
    "a MoE layer with no measured rate runs at this share of the default dense rate: routing, the token permutation "
    "and grouped GEMMs over a few thousand tokens per expert are slower than one dense GEMM. Qwen3-30B-A3B (12 "
    "layers, 256 x 4096 per step, compiled): the layers took 21.2 s of the 24.4 s busy compute, the dense rate gave "
    "17.2 s. A probed MoE layer (`megatrain probe --layer MODEL:BxT`) replaces it",
    "python3 bench/bench_megatrain.py --model bench/model-configs/qwen3-30b-a3b --layers 12 --seq 4096 --seqs 256 "
    f"--compile --json OUT.json; {_PVM}")

# The default machine profile (profile.Profile's defaults, profile.DEFAULTS): one H200's, used until `megatrain
# probe` measures the machine. The probe measures each of these but layer_flops and attention_flops, which it derives
# from the layers it is given (--layer).
DEFAULT_GPU_TOTAL_BYTES = _fit(
    "DEFAULT_GPU_TOTAL_BYTES", int(139.8 * GiB), "bytes",
    "the default machine's GPU memory (an H200 as torch reports it)", _PROBE)
DEFAULT_H2D_BPS = _fit(
    "DEFAULT_H2D_BPS", 55.5e9, "bytes/s",
    "host to device over PCIe Gen5 x16 from page-locked memory, one direction alone", _PROBE)
DEFAULT_D2H_BPS = _fit(
    "DEFAULT_D2H_BPS", 55.5e9, "bytes/s", "device to host into page-locked memory, one direction alone", _PROBE)
DEFAULT_BIDIR_BPS = _fit(
    "DEFAULT_BIDIR_BPS", 50.8e9, "bytes/s per direction",
    "each direction when both run at once (101.6 GB/s together): the gradients' copy-out while weights stream in",
    _PROBE)
DEFAULT_MATMUL_FLOPS = _fit(
    "DEFAULT_MATMUL_FLOPS", 790e12, "FLOP/s", "a bf16 8192^3 matmul", _PROBE)
DEFAULT_LAYER_FLOPS = _fit(
    "DEFAULT_LAYER_FLOPS", 560e12, "FLOP/s (eager)",
    "a decoder layer's matmuls when no measured layer shape applies (x COMPILED_SPEEDUP compiled): least squares on "
    "the relative step time of the first 19 H200 runs (7B/8B, a 3B shape, a 16-128 layer depth sweep, spill and "
    "offload), the other rates held at their probed values. A profile with probed layers sets it from its largest",
    f"{_BENCH} --json OUT.json over several shapes; {_PVM} (step time), or {_PROBE} --layer MODEL:BxT")
DEFAULT_ATTENTION_FLOPS = _fit(
    "DEFAULT_ATTENTION_FLOPS", 170e12, "FLOP/s (eager)",
    "causal flash attention on rows of 1k-4k tokens, fitted with DEFAULT_LAYER_FLOPS (ATTENTION_BY_SEQ scales it "
    "with the row)", f"{_BENCH} --json OUT.json over several shapes; {_PVM} (step time)")
DEFAULT_HEAD_FLOPS = _fit(
    "DEFAULT_HEAD_FLOPS", 628e12, "FLOP/s",
    "the chunked LM head with its CUDA kernels (fused cross-entropy, in-GEMM accumulation) at the Llama-3.1-8B "
    "shape (the eager head: 387)",
    f"python3 bench/head_attn_variants.py --model bench/model-configs/llama-3.1-8b --micro 16 --seq 4096, or {_PROBE}")
DEFAULT_ADAMW_PARAMS_PER_S = _fit(
    "DEFAULT_ADAMW_PARAMS_PER_S", 4.55e9, "parameters/s",
    "the CPU AdamW alone on the machine (16 cores), bf16 copy written; the planner takes ADAMW_IN_STEP of it in a "
    "step. `megatrain train` measures the machine's own at its start when no profile is given", _PROBE)
DEFAULT_CPU_FLOPS = _fit(
    "DEFAULT_CPU_FLOPS", 0.5e12, "FLOP/s", "the CPU's bf16 matmul rate, for plans of CPU-device runs", _PROBE)
DEFAULT_DISK_READ_BPS = _fit(
    "DEFAULT_DISK_READ_BPS", 1.2e9, "bytes/s",
    "the SSD tier's disk (memory.disk_path) read with O_DIRECT and 16 MiB requests: the GPU hosts' local disk (a "
    "real NVMe RAID does 10-25 GB/s). `megatrain train` measures memory.disk_path at its start when the profile has "
    "no disk", f"{_PROBE} --disk PATH")
DEFAULT_DISK_WRITE_BPS = _fit(
    "DEFAULT_DISK_WRITE_BPS", 1.6e9, "bytes/s", "the same disk written (O_DIRECT, 16 MiB requests)",
    f"{_PROBE} --disk PATH")
IO_EFFICIENCY = _fit(
    "IO_EFFICIENCY", {"load": 0.9, "save": 0.95, "resume": 0.9, "export": 0.9, "export_ckpt": 0.95},
    "share of the disk's rate",
    "what loading pretrained safetensors (read), a checkpoint's save (write), a resume (read), the export from the "
    "store (write) and from a checkpoint (its masters read and the bf16 written, pipelined) reach of the disk's "
    "O_DIRECT rates with the default I/O threads on an H200 host (Qwen2.5-7B's layers, disk 2.07 GB/s read, 2.33 "
    "write): load 0.93 (not in the page cache; 0.92 in megatrain train beside a warm compile, 0.49 beside a cold "
    "one), save 1.03, resume 0.93, export 0.93, a checkpoint's export 0.99 of the sum of its read and write times; "
    "rounded down",
    "python3 bench/bench_io.py --model bench/model-configs/qwen2.5-7b --layers 6 --json OUT.json")
IO_HASH_BPS = _fit(
    "IO_HASH_BPS", 14e9, "bytes/s",
    "sha256 on the I/O threads of a save or a resume (checkpoint/fastio.py), 16 threads: 19.2 GB/s measured on a "
    "16-core H200 host, 14.9 on an H100 host; the lower kept: a disk faster than this is not written or read faster "
    "than it is hashed",
    "python3 bench/bench_io.py --model bench/model-configs/qwen2.5-7b --layers 6 --json OUT.json (sha256_bps)")

# ---- several ranks (world.py) -------------------------------------------------------------------------------
INTRA_NODE_BPS = _fit(
    "INTRA_NODE_BPS", 300e9, "bytes/s",
    "NCCL bus bandwidth of a reduce-scatter over NVLink on H100/H200 boards: a default, not probed",
    "python3 bench/bench_cli.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --compile "
    "--nproc-per-node N (exposed reduction time)")
INTER_NODE_BPS = _fit(
    "INTER_NODE_BPS", 40e9, "bytes/s per rank",
    "across nodes, one 400 Gb/s NIC per GPU at its line rate: assumed, not measured (the benchmarks run one node)",
    "python3 bench/bench_cli.py --nproc-per-node N, run across nodes (not yet done)")

# ---- the probe (probe.py) ----------------------------------------------------------------------------------
ADAMW_THREADS_TOLERANCE = _fit(
    "ADAMW_THREADS_TOLERANCE", 0.05, "share of the fastest rate",
    "the CPU AdamW takes the fewest threads whose rate is within this share of the fastest count's: fewer threads "
    "leave cores to the runtime's own (the GPU feeder, the copy threads) at no cost to the update",
    f"{_PROBE} (the rate of each thread count), then {_BENCH} --compile --adam-threads T (GPU busy share)")
ALL_CORES_UP_TO = _fit(
    "ALL_CORES_UP_TO", 16, "cores",
    "every core is a candidate for the CPU AdamW only on nodes of at most this many. The update is bound by DRAM, "
    "which half the cores saturate; on a 64-vCPU host 56-64 threads gave 0.1-3.2 Gparam/s (varying) against 3.7-4.2 "
    "with 32, and a run with all 64 waited for its optimizer 40% of each step; on a 32-vCPU host 32 threads updated "
    "fastest alone (3.58 against 3.14 with 16) but kept the GPU only 65-77% busy; the 16-vCPU hosts run best with all",
    f"{_BENCH} --compile --adam-threads T for T = cores, 3/4, 1/2 (GPU busy share)")

# ---- rollouts (planner/rollout_estimate.py, GRPO's sampling phase) --------------------------------------------
_ROLLOUT = ("python3 bench/bench_rollout.py --model bench/model-configs/qwen2.5-7b --prompts 64 --n 8 "
            "--prompt-len 128 --max-new 512 --json OUT.json")
ROLLOUT_HBM_BPS = _fit(
    "ROLLOUT_HBM_BPS", {"H200": 4.8e12 * 0.75, "H100": 3.35e12 * 0.75, "A100": 2.0e12 * 0.75, "default": 2.5e12},
    "bytes/s, by GPU name",
    "what a resident decode step reads from HBM per second (the weights once, the live rows' KV cache): the "
    "data-sheet bandwidth times 0.75, the share batched bf16 GEMV-like matmuls reach (not yet measured here)",
    f"{_ROLLOUT} (resident decode_s against the bytes a step reads)")
ROLLOUT_MATMUL_EFFICIENCY = _fit(
    "ROLLOUT_MATMUL_EFFICIENCY", 0.5, "share of the peak bf16 FLOP/s",
    "what a prefill's matmuls reach (all prompt tokens at once): the streamed prefill of 512 rows x 64-128 tokens "
    "of Qwen2.5-7B on an H200 took 1.68 s against 1.74 s of matmuls at 0.5 of the peak",
    f"{_ROLLOUT} (prefill_s)")
ROLLOUT_DECODE_EFFICIENCY = _fit(
    "ROLLOUT_DECODE_EFFICIENCY", 0.33, "share of the peak bf16 FLOP/s",
    "what a resident decode step's work reaches (one token per row: GEMMs of a few hundred rows, the attention "
    "over the padded cache, per-layer kernel launches): 512 rows of Qwen2.5-7B on an H200 decoded at 32.7 ms a "
    "step, 7.4 ms of it at the peak (the plan's FLOPs), with ROLLOUT_STEP_OVERHEAD_S besides",
    f"{_ROLLOUT} (resident decode_s / decode steps)")
ROLLOUT_STEP_OVERHEAD_S = _fit(
    "ROLLOUT_STEP_OVERHEAD_S", 0.01, "seconds per decode step",
    "a decode step's fixed cost besides its bytes and FLOPs: transformers' module calls and mask building on the "
    "host, the draw, the finished-row check that syncs the GPU each step",
    f"{_ROLLOUT} --prompts 1 --n 1 (decode_s / steps at one row)")
