"""Where a compiled run's first step puts Inductor's autotuning copies, and what would keep them off the host
(the host peak of Qwen2.5-7B with fp32 streaming is 12.30 B/param once Inductor's cache has the kernels tuned,
12.88 on a cold cache: bench/results/qwen2.5-7b-158x1024-tune-first-h100x2-cli).

The first time an Inductor kernel with several configurations runs, its autotuner benchmarks them; the buffers the
kernel writes are copied aside first, to the GPU when `max_memory_allocated() - memory_allocated()` has room, else
to page-locked host memory (`CachingAutotuner.copy_args_to_cpu_if_needed`), which torch's caching host allocator
keeps in power-of-two blocks. Each mode runs in its own process with its own Inductor cache folder, builds the
runtime for the model truncated to --layers layers as `megatrain train` does, runs one compiled step, and records
the page-locked bytes torch's host allocator held at its peak, the step's time, the GPU's allocated and reserved
peaks and how many graphs Dynamo compiled:

  cold          one engine, a cold cache: what a first run does today.
  warm          a new process on the cold mode's cache folder (run "cold" first): the kernels tuned, as a resumed
                run finds them.
  two-engines   a cold cache; a first engine over a model of its own runs one step, then a second engine, over
                another store and adapter of the same shape, runs one: does the second step find every kernel
                tuned (no copies) within Dynamo's recompile limit? (the fix "tune before the host store").
  bump          a cold cache; before the step, a GPU allocation of what the device has free (less --margin-gib)
                is made and freed, so that the autotuner's budget covers its copies (the fix "give the autotuner
                room on the GPU"): do the copies stay on the GPU, and at what reserved memory?

    python3 bench/autotune_copies.py --model bench/model-configs/qwen2.5-7b --seq 1024 --micro 79 [--json OUT]

The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = ("cold", "warm", "two-engines", "bump")
GiB = 2**30


def pinned_peak() -> float:
    import torch

    if not torch.cuda.is_available():
        return 0.0
    stats = torch.cuda.host_memory_stats()
    return float(stats.get("allocated_bytes.peak", stats.get("allocated_bytes.current", 0)))


def one_engine_step(args, seed: int) -> dict:
    """Build the runtime for the truncated model (a store, an adapter and an engine of its own) and run one step."""
    import torch
    from common import hf_config

    from megatrain.models import get_adapter
    from megatrain.runtime import (CpuAdamW, EngineOptions, HostStore, MicroBatch, Placement, RuntimeOptions,
                                   build_runtime, store_dtypes)

    tiny = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                vocab_size=1024, head_dim=64) if args.tiny else {}  # --tiny: the script's own check on CPU
    adapter = get_adapter(hf_config(args.model, num_hidden_layers=args.layers, **tiny))
    device = torch.device(args.device)
    placement = Placement(stream_dtype=args.stream_dtype)
    store = HostStore(adapter, *store_dtypes("bf16", placement.stream_dtype))
    store.init_random(seed, 0.02)
    runtime = build_runtime(store, device, CpuAdamW(), RuntimeOptions(
        engine=EngineOptions(compile_layers=True, placement=placement)))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, adapter.vocab_size, (args.micro, args.seq), generator=g)
    try:
        t = time.perf_counter()
        out = runtime.engine.train_step([MicroBatch.from_labels(ids, ids)])
        out.loss_sum.item()
        runtime.pipeline.finish_step(lr=1e-5, clip_coef=1.0)
        runtime.pipeline.drain()
        return {"step_s": time.perf_counter() - t}
    finally:
        runtime.close()


def child(args) -> dict:
    """One mode, in this process (its Inductor cache folder set by the parent)."""
    import torch
    import torch._dynamo.utils as dyn

    from megatrain.runtime.pinned import release_torch_pinned_cache

    cuda = args.device.startswith("cuda")
    rec = {"mode": args.child}
    if args.child == "two-engines":
        first = one_engine_step(args, seed=1)
        rec["first_step_s"] = first["step_s"]
        rec["first_pinned_peak_gib"] = pinned_peak() / GiB
        rec["first_graphs"] = int(dyn.counters["stats"].get("unique_graphs", 0))  # "graphs" then counts both
        release_torch_pinned_cache(min_idle=0)
        if cuda:
            reset = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
            if reset is not None:
                reset()
            torch.cuda.empty_cache()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if args.child == "bump" and cuda:
        free = torch.cuda.mem_get_info()[0]
        room = max(0, int(free - args.margin_gib * GiB))
        block = torch.empty(room, dtype=torch.uint8, device=args.device)
        del block
        rec["bump_gib"] = room / GiB
    step = one_engine_step(args, seed=2)
    rec["step_s"] = step["step_s"]
    rec["pinned_peak_gib"] = pinned_peak() / GiB
    if cuda:
        rec["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        rec["gpu_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
    rec["graphs"] = int(dyn.counters["stats"].get("unique_graphs", 0))
    rec["rss_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    rec["recompile_limit"] = int(getattr(torch._dynamo.config, "recompile_limit",
                                         getattr(torch._dynamo.config, "cache_size_limit", 0)))
    return rec


def run_mode(args, mode: str, cache: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    cmd = [sys.executable, __file__, "--child", mode, "--model", args.model, "--layers", str(args.layers),
           "--seq", str(args.seq), "--micro", str(args.micro), "--device", args.device,
           "--stream-dtype", args.stream_dtype, "--margin-gib", str(args.margin_gib)]
    cmd += ["--tiny"] if args.tiny else []
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, check=False)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        tail = (p.stdout + p.stderr)[-2000:]
        print(f"{mode}: exit status {p.returncode}\n{tail}", flush=True)
        return {"mode": mode, "error": p.returncode, "tail": tail[-500:]}
    rec = json.loads(lines[-1])
    rec["process_s"] = time.perf_counter() - t
    print(json.dumps(rec), flush=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(HERE / "model-configs" / "qwen2.5-7b"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=79)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--stream-dtype", default="fp32", choices=("bf16", "fp32"))
    ap.add_argument("--margin-gib", type=float, default=4.0, help="bump: GPU memory left free by the allocation")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--tiny", action="store_true", help="a 256-wide model: checks the script itself (CPU)")
    ap.add_argument("--json")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return 0
    rows = []  # each mode with a cache folder of its own, but "warm" with the one "cold" filled (when it ran)
    with tempfile.TemporaryDirectory(prefix="inductor-") as root:
        for mode in args.modes:
            cache = os.path.join(root, "cold" if mode == "warm" else mode)
            rows.append(run_mode(args, mode, cache))
    if args.json:
        from common import git_rev, machine, write_json

        write_json(args.json, {"command": " ".join(sys.argv), "git": git_rev(), "machine": machine(),
                               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": rows})
    cols = ("mode", "step_s", "pinned_peak_gib", "rss_peak_gib", "gpu_peak_gib", "gpu_reserved_gib", "graphs",
            "first_graphs", "first_step_s", "first_pinned_peak_gib", "bump_gib", "process_s")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            cells.append("-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
