"""`megatrain probe`: measure this machine and write the profile `megatrain plan` uses.

    python3 -m megatrain.planner.probe --out profile.json --layer bench/model-configs/qwen2.5-7b:32x1024

On any machine: host RAM (cgroup-aware), the CPU AdamW rate (megatrain.runtime.adamw.CpuAdamW on a tile, bf16 copy
written, as the optimizer pipeline runs it) and a CPU matmul rate. With CUDA besides: pinned H2D and D2H
bandwidth, each alone and both at once (cudaHostRegister'ed memory, as the store and the landing buffers are),
pageable H2D, the cost of registering memory, the bf16 matmul rate, and for each `--layer MODEL:BxT` one
decoder layer's forward and recompute+backward rate at that micro-batch shape through megatrain's own template
(eager and torch.compile'd, as the engine runs it), with the activation memory it took, and the chunked LM
head's rate. With `--disk DIR`, the read and write rates of the disk under DIR as the SSD tier moves its states
(memory.disk_path; runtime/disk_probe.py). Only torch, transformers and the standard library are needed (no
pydantic, no datasets).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from .. import __version__
from ..errors import ArgumentParser, MegatrainError, check_file_target, positive_int, positive_number, report
from ..runtime.disk_files import check_disk_path
from ..runtime.disk_probe import START_BYTES, describe, measure_disk
from ..runtime.layer import layer_backward
from ..runtime.lmhead import HeadKernels, default_chunk, head_loss
from .calibration import ADAMW_THREADS_TOLERANCE, ALL_CORES_UP_TO
from .profile import PROFILE_VERSION, default_profile_path, layer_shape, peak_bf16_for, this_host
from .sysmem import host_memory, memlock_limit

GiB = 2**30


def log(msg: str) -> None:
    print(f"probe: {msg}", file=sys.stderr, flush=True)


# ---- CPU -------------------------------------------------------------------------------------------------------
def adamw_rates(numel: int, stream_dtype: torch.dtype, threads: list[int], reps: int = 3) -> dict[int, float]:
    """The CpuAdamW rate over one tile of `numel` parameters with each number of intra-op threads in `threads`:
    the best of `reps` timings each, taken in turn (one of each count per round, so that a slow moment of the
    machine does not fall on one count alone). torch's thread count is restored."""
    from ..models.base import TensorSpec, Unit
    from ..runtime.adamw import CpuAdamW
    from ..runtime.pinned import aligned_empty
    from ..runtime.tile import LayerTile

    unit = Unit("layer", 0, (TensorSpec("w", "w", (numel,), True, "normal"),))
    master = aligned_empty(numel, torch.float32, zero=False).normal_(0, 0.02)
    m = aligned_empty(numel, torch.float32, zero=True)
    v = aligned_empty(numel, torch.float32, zero=True)
    stream = aligned_empty(numel, stream_dtype, zero=True) if stream_dtype != torch.float32 else master
    tile = LayerTile(unit, master, m, v, stream)
    grad = aligned_empty(numel, torch.float32, zero=False).normal_(0, 1e-3)
    opt = CpuAdamW(weight_decay=0.1)
    before = torch.get_num_threads()
    best = {t: float("inf") for t in threads}
    try:
        opt.update(tile, grad, lr=1e-5)  # first touch, page faults
        for _ in range(reps):
            for t in threads:
                torch.set_num_threads(t)
                t0 = time.perf_counter()
                opt.update(tile, grad, lr=1e-5)
                best[t] = min(best[t], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {t: numel / s for t, s in best.items()}


def adamw_thread_counts(cores: int) -> list[int]:
    """The thread counts tried for the CPU AdamW on `cores` cores: three quarters and half, and all of them on a node
    of at most ALL_CORES_UP_TO. The update is bound by the host's DRAM, which half the cores of the hosts measured
    here saturate; more threads add stragglers, and every core leaves none to the runtime's own threads (the one
    that launches the GPU's work, the copy threads). Measured:
      - a 64-vCPU host (nvidia-h100-x4): 3.7-4.2 Gparam/s with 32 threads, 3.1 with 48, 0.1-3.2 (varying from one
        measurement to the next) with 56-64, so that a run with torch's default of 64 waited for its optimizer 40%
        of each step; with 32, Qwen2.5-7B 158 x 1024 on one GPU kept it 94-97% busy;
      - a 32-vCPU host (nvidia-h200-x2's H100 host): 3.58 Gparam/s alone with 32 threads against 3.14 with 16, but
        the same 7B on one GPU with 32 threads kept it only 65-77% busy (19.5 s a step, planned 14.8), while two
        ranks of 8 threads each on that host kept theirs 95-97% busy;
      - the 16-vCPU hosts of nvidia-h200 and nvidia-h100-x1: all 16 cores, the 7B at 14.7 s a step as planned."""
    if cores < 8:
        return [max(1, cores)]
    return sorted({cores * 3 // 4, cores // 2} | ({cores} if cores <= ALL_CORES_UP_TO else set()))


def choose_adamw_threads(rates: dict[int, float]) -> int:
    """The fewest threads whose rate is within ADAMW_THREADS_TOLERANCE of the fastest: fewer threads leave cores
    to the runtime's own threads (the GPU feeder, the copy threads) at no cost to the update."""
    best = max(rates.values())
    return min(t for t, r in rates.items() if r >= best * (1 - ADAMW_THREADS_TOLERANCE))


def measure_adamw_threads(cores: int, numel: int, reps: int = 2) -> tuple[int, dict[int, float]]:
    """The CPU AdamW's thread count for `cores` cores, measured now over a bf16-streaming tile of `numel`
    parameters: (the count chosen, every count's rate in params/s)."""
    rates = adamw_rates(numel, torch.bfloat16, adamw_thread_counts(cores), reps=reps)
    return choose_adamw_threads(rates), rates


def matmul_rate(n: int, dtype: torch.dtype, device: str, reps: int = 5) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2.0 * n**3 * reps / (time.perf_counter() - t0)


def _seconds(fn, device: str) -> float:
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- PCIe ------------------------------------------------------------------------------------------------------
def _registered(pinned, nbytes: int, what: str) -> tuple[torch.Tensor, float]:
    """A touched, page-aligned host buffer registered as pinned (as the runtime's are), and the seconds the
    registration took."""
    from ..runtime.pinned import aligned_empty

    buf = aligned_empty(nbytes, torch.uint8, zero=True)
    t0 = time.perf_counter()
    pinned.register(buf, what)
    return buf, time.perf_counter() - t0


def bandwidth(nbytes: int, reps: int = 5) -> dict:
    from ..runtime.pinned import PinnedHost

    pinned = PinnedHost(cuda=True)
    try:
        return _bandwidth(pinned, nbytes, reps)
    finally:
        pinned.close()


def _bandwidth(pinned, nbytes: int, reps: int) -> dict:
    host_in, register_s = _registered(pinned, nbytes, "probe's H2D source")
    host_out, _ = _registered(pinned, nbytes, "probe's D2H destination")
    dev_a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s_in, s_out = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(copies) -> float:
        """Seconds from a common start to the last stream's end, for [(stream, fn)] run concurrently."""
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        ends = []
        for stream, fn in copies:
            with torch.cuda.stream(stream):
                stream.wait_event(start)
                for _ in range(reps):
                    fn()
                e = torch.cuda.Event(enable_timing=True)
                e.record(stream)
                ends.append(e)
        torch.cuda.synchronize()
        return max(start.elapsed_time(e) for e in ends) / 1e3

    h2d = lambda: dev_a.copy_(host_in, non_blocking=True)  # noqa: E731
    d2h = lambda: host_out.copy_(dev_b, non_blocking=True)  # noqa: E731
    timed([(s_in, h2d), (s_out, d2h)])  # warm up
    out = {"h2d_pinned_bps": nbytes * reps / timed([(s_in, h2d)]),
           "d2h_pinned_bps": nbytes * reps / timed([(s_out, d2h)]),
           "bidirectional_per_direction_bps": nbytes * reps / timed([(s_in, h2d), (s_out, d2h)]),
           "register_s_per_gib": register_s / (nbytes / GiB), "bytes": nbytes}
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.fill_(1)
    out["h2d_pageable_bps"] = _pageable(dev_a, pageable)
    return out


def _pageable(dev: torch.Tensor, host: torch.Tensor, reps: int = 3) -> float:
    dev.copy_(host)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        dev.copy_(host)
    torch.cuda.synchronize()
    return host.numel() * reps / (time.perf_counter() - t0)


# ---- one decoder layer and the LM head at a micro-batch shape ----------------------------------------------------
def _adapter(model_dir: str):
    from transformers import AutoConfig

    from ..models import get_adapter

    return get_adapter(AutoConfig.from_pretrained(model_dir, trust_remote_code=False))


def layer_rate(model_dir: str, micro: int, seq: int, device: str, compile_layers: bool, reps: int = 3,
               dtype: torch.dtype = torch.bfloat16, ad=None, best: bool = False) -> dict:
    """Forward (no grad) and recompute+backward of one layer, as Engine runs them; executed FLOP/s of each and
    the activation memory of the backward (CUDA: max_memory_allocated growth). ad: the model's adapter (default:
    read from model_dir); best: the fastest of the reps (a machine others share), not their mean."""
    ad = ad or _adapter(model_dir)
    unit = next(u for u in ad.units() if u.kind == "layer")
    flat = (torch.randn(unit.numel, device=device) * 0.02).to(dtype)
    grad = torch.zeros(unit.numel, dtype=torch.float32, device=device)
    w, gviews = unit.views(flat), list(unit.views(grad).values())
    for s, v in zip(unit.specs, w.values()):  # norms at one, as initialised
        if s.init == "ones":
            v.fill_(1.0)
    x = torch.randn(micro, seq, ad.hidden_size, device=device).to(dtype)
    dh = torch.randn_like(x) * 1e-3
    pos = torch.arange(seq, device=device).repeat(micro, 1)
    ctx = ad.make_context(pos, dtype, False)
    layer = torch.compile(ad.layer_forward, dynamic=False) if compile_layers else ad.layer_forward

    def fwd():
        with torch.no_grad():
            return layer(w, x, ctx)

    def bwd():
        return layer_backward(layer, w, x, ctx, dh, gviews)

    def timed(fn) -> float:
        fn()  # warm up (and compile)
        _sync(device)
        if best:  # the first timings of a process run slow (its allocator and threads settling): more warm-up
            fn()
            return min(_seconds(fn, device) for _ in range(reps))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        return (time.perf_counter() - t0) / reps

    fwd_s = timed(fwd)
    act = None
    if device == "cuda":
        bwd()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        bwd()
        torch.cuda.synchronize()
        act = torch.cuda.max_memory_allocated() - base
    bwd_s = timed(bwd)
    tokens = micro * seq
    P = ad.active_numel(unit)  # a MoE layer: its top-k experts, as the planner counts
    attn = 2.0 * seq * ad.num_heads * ad.head_dim
    shape = dict(zip(("hidden", "intermediate", "heads", "kv_heads", "head_dim", "experts", "top_k",
                      "expert_intermediate"), layer_shape(ad)))
    return {"model": Path(model_dir).name, **shape, "micro": micro, "seq": seq,
            "compile": compile_layers, "forward_s": fwd_s, "backward_s": bwd_s,
            "forward_flops": (2.0 * P + attn) * tokens / fwd_s, "backward_flops": (6.0 * P + 3 * attn) * tokens / bwd_s,
            "activation_peak_bytes": act}


# cpu_layer_rates' bounds, so that it stays short (about a second at most: bf16 emulated without bf16 instructions
# runs at ~10 GFLOP/s on 2 cores) and small: the executed FLOPs of one layer's recompute+backward (the micro-batch's
# rows, then the row, are cut until it fits, down to 64 tokens), and the largest layer it runs (fp32 weights and
# gradients of 2**24 parameters: 128 MiB; a larger model's CPU plan keeps the profile's rates).
CPU_LAYER_FLOPS = 2e9
CPU_LAYER_PARAMS = 2**24


def cpu_layer_rates(ad, micro: int, seq: int, precisions=("fp32", "bf16"), reps: int = 4) -> dict | None:
    """This CPU's executed FLOP/s of one decoder layer of `ad` (forward, then recompute+backward, as the engine runs
    them) in each of `precisions`, at `micro` rows of `seq` tokens or fewer (CPU_LAYER_FLOPS), the fastest of
    `reps`: {"fp32": rate, "bf16": rate, "shape": "ROWSxTOKENS"}; None for a layer larger than CPU_LAYER_PARAMS.
    A CPU step is such layers for the most part, their matmuls and their elementwise work, which bf16 without bf16
    instructions slows down."""
    unit = next(u for u in ad.units() if u.kind == "layer")
    if unit.numel > CPU_LAYER_PARAMS:
        return None
    per_token = 6.0 * ad.active_numel(unit) + 6.0 * seq * ad.num_heads * ad.head_dim
    tokens = max(min(seq, 64), min(micro * seq, int(CPU_LAYER_FLOPS // per_token)))
    rows, length = (max(1, tokens // seq), seq) if tokens >= seq else (1, tokens)
    out = {"shape": f"{rows}x{length}"}
    for name in precisions:
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        r = layer_rate("", rows, length, "cpu", False, reps=reps, dtype=dtype, ad=ad, best=True)
        out[name] = (r["forward_flops"] * r["forward_s"] + r["backward_flops"] * r["backward_s"]) / \
            (r["forward_s"] + r["backward_s"])
    return out


def head_rate(model_dir: str, micro: int, seq: int, device: str, reps: int = 2) -> float:
    """Executed FLOP/s (6 per LM-head parameter per target) of the engine's chunked LM-head loss + backward."""
    ad = _adapter(model_dir)
    H, V = ad.hidden_size, ad.vocab_size
    dtype = torch.bfloat16
    n = micro * (seq - 1)
    h = torch.randn(micro, seq, H, device=device).to(dtype)
    index = torch.randperm(micro * seq, device=device)[:n].sort().values
    targets = torch.randint(0, V, (n,), device=device)
    norm_w = torch.ones(H, dtype=dtype, device=device)
    lm_w = (torch.randn(V, H, device=device) * 0.02).to(dtype)
    norm_g = torch.zeros(H, device=device)
    lm_g = torch.zeros(V, H, device=device)
    kernels = HeadKernels.for_device(device)

    def run():
        return head_loss(ad.final_norm, h, index, targets, norm_w, lm_w, norm_g, lm_g, 1.0 / n, default_chunk(V),
                         kernels)

    run()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(device)
    return 6.0 * V * H * n * reps / (time.perf_counter() - t0)


def parse_layer(spec: str) -> tuple[str, int, int]:
    """'MODEL_DIR:BxT' -> (MODEL_DIR, B, T)."""
    path, _, shape = spec.rpartition(":")
    try:
        b, t = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise MegatrainError(f"probe: --layer {spec!r}: expected MODEL_DIR:MICROxSEQ, e.g. models/qwen:32x1024") \
            from None
    if b < 1 or t < 1:
        raise MegatrainError(f"probe: --layer {spec!r}: rows and tokens must be whole numbers above 0")
    if not (Path(path) / "config.json").is_file():
        raise MegatrainError(f"probe: --layer {spec!r}: {path}/config.json does not exist")
    return path, b, t


def check_profile_target(out: Path) -> None:
    """--out: a file to write, and one that holds nothing but an earlier profile (a probe replaces its own
    measurement, never another file given by mistake); not through a symbolic link."""
    check_file_target(out, "probe: --out")
    if out.is_symlink():
        raise MegatrainError(f"probe: --out {out} is a symbolic link; give the file's own path")
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        if not (isinstance(old, dict) and "version" in old and "host_memory" in old):
            raise MegatrainError(f"probe: --out {out} exists and is not a profile megatrain probe wrote; choose "
                                 f"another path")


# ---- the profile ---------------------------------------------------------------------------------------------
def probe(layers: list[tuple[str, int, int]], compile_modes: list[bool], adam_params: int, bw_bytes: int,
          matmul_n: int, disk: tuple[str, int] | None = None) -> dict:
    mem = host_memory()
    prof = {"version": PROFILE_VERSION, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "host": this_host(),
            "torch": torch.__version__, "megatrain": __version__, "host_memory": mem.to_dict(),
            "memlock_bytes": memlock_limit()}
    log(f"host RAM {mem.available / GiB:.1f} of {mem.total / GiB:.1f} GiB available ({mem.source})")
    cores = torch.get_num_threads()
    threads, rates = measure_adamw_threads(cores, adam_params, reps=3)
    cpu = {"count": os.cpu_count(), "threads": threads, "adamw_threads": threads,
           "adamw_params_per_s_by_threads": {str(t): r for t, r in rates.items()},
           "adamw_params_per_s": rates[threads]}
    cpu["adamw_fp32_params_per_s"] = adamw_rates(adam_params, torch.float32, [threads])[threads]
    log(f"CPU AdamW {cpu['adamw_params_per_s'] / 1e9:.2f} Gparam/s (bf16 copy), "
        f"{cpu['adamw_fp32_params_per_s'] / 1e9:.2f} Gparam/s (fp32), {threads} of {cores} threads "
        f"({', '.join(f'{t}: {r / 1e9:.2f}' for t, r in rates.items())})")
    cpu["matmul_flops"] = matmul_rate(min(matmul_n, 2048), torch.float32, "cpu", reps=2)
    cpu["matmul_bf16_flops"] = matmul_rate(min(matmul_n, 1024), torch.bfloat16, "cpu", reps=2)
    log(f"CPU matmul fp32 {cpu['matmul_flops'] / 1e12:.2f}, bf16 {cpu['matmul_bf16_flops'] / 1e12:.2f} TFLOP/s")
    prof["cpu"] = cpu
    if disk is not None:  # the SSD tier's rates, measured as the tier moves its states (runtime/disk_probe.py)
        prof["disk"] = measure_disk(disk[0], disk[1], key="probe: --disk")
        log(describe(prof["disk"]))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        name = torch.cuda.get_device_name()
        gpu = {"name": name, "total_bytes": torch.cuda.get_device_properties(0).total_memory,
               "peak_bf16_flops": peak_bf16_for(name)}
        gpu["bandwidth"] = bandwidth(bw_bytes)
        b = gpu["bandwidth"]
        log(f"{name}: H2D {b['h2d_pinned_bps'] / 1e9:.1f} GB/s, D2H {b['d2h_pinned_bps'] / 1e9:.1f} GB/s, both at "
            f"once {b['bidirectional_per_direction_bps'] / 1e9:.1f} GB/s each, pageable H2D "
            f"{b['h2d_pageable_bps'] / 1e9:.1f} GB/s, cudaHostRegister {b['register_s_per_gib']:.3f} s/GiB")
        gpu["matmul_bf16_flops"] = matmul_rate(matmul_n, torch.bfloat16, "cuda")
        log(f"bf16 matmul {matmul_n}^3: {gpu['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s")
        prof["gpu"] = gpu
    rates = []
    for path, micro, seq in layers:
        for comp in compile_modes if device == "cuda" else [False]:
            try:
                r = layer_rate(path, micro, seq, device, comp)
            except torch.OutOfMemoryError:
                log(f"layer {path} {micro}x{seq}: out of GPU memory, skipped")
                torch.cuda.empty_cache()
                continue
            rates.append(r)
            act = f", activations {r['activation_peak_bytes'] / GiB:.2f} GiB" if r["activation_peak_bytes"] else ""
            log(f"layer {r['model']} {micro}x{seq}{' compiled' if comp else ''}: forward "
                f"{r['forward_flops'] / 1e12:.0f}, recompute+backward {r['backward_flops'] / 1e12:.0f} TFLOP/s{act}")
            if device == "cuda":
                torch.cuda.empty_cache()
    if layers:
        path, micro, seq = max(layers, key=lambda s: s[1] * s[2])
        try:
            head = head_rate(path, micro, seq, device)
            log(f"LM head ({Path(path).name}, {micro}x{seq}): {head / 1e12:.1f} TFLOP/s")
        except torch.OutOfMemoryError:
            head = None
            log("LM head: out of GPU memory, skipped")
        if device == "cuda":
            prof["gpu"]["head_flops"] = head
            prof["gpu"]["layers"] = rates
        else:
            prof["cpu"]["layers"] = rates
            prof["cpu"]["head_flops"] = head
    return prof


def main(argv: list[str] | None = None) -> int:
    """`megatrain probe`: user errors (arguments included) are one `megatrain: error: ...` line, exit status 2."""
    try:
        return _main(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except MegatrainError as e:
        return report(e)


def parser() -> ArgumentParser:
    """`megatrain probe`'s arguments."""
    p = ArgumentParser(prog="megatrain probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(default_profile_path()),
                   help=f"where the profile goes (default: {default_profile_path()}, which plan reads by default)")
    p.add_argument("--layer", action="append", default=[], metavar="MODEL_DIR:BxT",
                   help="measure one decoder layer of this model at B rows x T tokens per micro-batch (repeatable)")
    p.add_argument("--compile", choices=["both", "on", "off"], default="both",
                   help="CUDA: measure the layers compiled, eager, or both (default both)")
    p.add_argument("--adam-params", type=positive_int, default=1 << 27, help="tile size for the CPU AdamW rate")
    p.add_argument("--bandwidth-gib", type=positive_number, default=1.0, help="bytes per transfer measurement")
    p.add_argument("--matmul", type=positive_int, default=8192, help="square matmul size for the GPU rate")
    p.add_argument("--disk", metavar="DIR", default=None,
                   help="measure the disk under DIR as the SSD tier uses it (memory.disk_path): O_DIRECT, 8 requests "
                        "of 16 MiB in flight, written then read back")
    p.add_argument("--disk-gib", type=positive_number, default=START_BYTES / GiB,
                   help=f"GiB written and read by --disk (default {START_BYTES / GiB:g}, as `megatrain train` "
                        "measures at its start)")
    return p


def _main(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    layers = [parse_layer(s) for s in args.layer]
    out = Path(args.out).expanduser()
    check_profile_target(out)  # before anything is measured
    if args.disk is not None:
        check_disk_path(args.disk, "probe: --disk")
    modes = {"both": [False, True], "on": [True], "off": [False]}[args.compile]
    disk = (args.disk, int(args.disk_gib * GiB)) if args.disk is not None else None
    prof = probe(layers, modes, args.adam_params, int(args.bandwidth_gib * GiB), args.matmul, disk)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(prof, indent=2))
    os.replace(tmp, out)  # whole or not at all
    log(f"profile written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
