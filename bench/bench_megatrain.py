"""megatrain's step on one GPU: step time, wall time per step, tokens/s, TFLOP/s (6·N and MFU with attention), GPU
peak, host peak RSS and bytes/param, and the busy shares of the compute, H2D and D2H streams.

    python bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --compile

The runtime is built as the trainer builds it (`megatrain.runtime.build_runtime`): the store's streaming copy
pinned, the engine with the optimizer pipeline as its gradient sink and the stream timeline. Random-initialised
weights, random tokens (full-length rows, every token a target). The first --warmup steps are not measured.
Per step: `step_s`, from the start of `engine.train_step` to the loss and norm read back (the GPU work of the step),
and `wall_s`, from the end of the previous step's `finish_step` to the end of this one's (what a training loop
sees per step; compare bench_cli.py's wall time per step). Prints every measured step, the slowest over their median
with its GPU idle time and idle stretches (--gaps: the stall check), a table last, and writes JSON (--json).
`--device cpu` runs the same code on the CPU (a check of the script, with a tiny config.json).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (H200_BF16_PEAK, hf_config, peak_rss_bytes, rss_bytes, spread_lines, step_spread,  # noqa: E402
                    table, write_json)
from megatrain.models import get_adapter  # noqa: E402
from megatrain.planner.flops import flops_per_token  # noqa: E402
from megatrain.runtime import (CpuAdamW, EngineOptions, HostStore, MicroBatch, Placement, RuntimeOptions,  # noqa: E402
                               build_runtime, store_dtypes)
from megatrain.runtime.adamw import clip_coefficient  # noqa: E402


def split(total: int, micro: int) -> list[int]:
    sizes = [micro] * (total // micro)
    if total % micro:
        sizes.append(total % micro)
    return sizes


def plan_of(args, adapter, device):
    """The plan `megatrain train` would make for this run, the planner choosing every placement key."""
    from megatrain.planner import Workload, make_plan
    from megatrain.planner import sysmem
    from megatrain.planner.placement import FREE_ALL
    from megatrain.planner.profile import GiB, load_profile

    cuda = device.type == "cuda"
    if args.gpu_budget:
        gpu_limit = args.gpu_budget * GiB
    else:
        gpu_limit = float(torch.cuda.mem_get_info(device)[0]) if cuda else None
    w = Workload(tuple(split(args.seqs, args.micro)), args.seq, device=device.type, precision=args.precision,
                 num_slots=args.slots, compile=args.compile)
    return make_plan(adapter, w, load_profile(args.profile), host_available=float(sysmem.host_memory().available),
                     gpu_limit=gpu_limit, suggest=False, choose_keys=FREE_ALL)


def run(args) -> dict:
    cfg = hf_config(args.model, num_hidden_layers=args.layers, hidden_size=args.hidden,
                    intermediate_size=args.intermediate)
    adapter = get_adapter(cfg)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # memory queries and caps want the index
        device = torch.device("cuda", torch.cuda.current_device())
    cuda = device.type == "cuda"
    if args.gpu_budget and cuda:  # a hard cap: the caching allocator raises out-of-memory rather than exceed it
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(args.gpu_budget * 2**30 / total, device)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    plan = None
    if args.auto:  # the placement megatrain train would run: the planner's, from the budgets before anything is
        plan = plan_of(args, adapter, device)  # allocated (as megatrain train plans before loading weights)
        print(f"planner's placement: {plan.placement_keys} ({plan.why})", flush=True)
        if not plan.fits:  # what megatrain train would refuse, before the weights are allocated
            raise SystemExit(f"the plan does not fit: {plan.why}")
    placement = Placement(checkpoint_every=args.checkpoint_every, keep_top_layers=args.keep_top,
                          spill_layers=args.spill, grads_to_host=args.offload, wave_groups=args.wave_groups,
                          group_grads=args.group_grads, stream_dtype=args.stream_dtype)
    if plan is not None:
        placement = plan.placement
    if args.adam_threads is None and cuda:  # as megatrain train: the fewest threads within 5% of the fastest
        from megatrain.planner.plan import QUICK_ADAMW_PARAMS
        from megatrain.planner.probe import measure_adamw_threads

        args.adam_threads, rates = measure_adamw_threads(torch.get_num_threads(), QUICK_ADAMW_PARAMS)
        print(f"CPU AdamW threads: {args.adam_threads} (Gparam/s: "
              f"{', '.join(f'{t}: {r / 1e9:.2f}' for t, r in rates.items())})", flush=True)
    t0 = time.perf_counter()
    store = HostStore(adapter, *store_dtypes(args.precision, placement.stream_dtype))
    store.init_random(0, 0.02)
    runtime = build_runtime(store, device, CpuAdamW(weight_decay=0.1), RuntimeOptions(
        engine=EngineOptions(num_slots=args.slots, compile_layers=args.compile, placement=placement),
        adam_threads=args.adam_threads))
    init_s = time.perf_counter() - t0  # the store's allocation and init, pinning, slots, landing buffers
    engine, pipeline, timeline = runtime.engine, runtime.pipeline, runtime.timeline
    n_params = store.num_params
    fpt6, fpt_model = flops_per_token(adapter, args.seq)
    tokens = args.seqs * args.seq
    g = torch.Generator().manual_seed(0)
    records = []
    try:
        last_end = time.perf_counter()  # step 0's wall time runs from here
        for step in range(args.warmup + args.steps):
            mbs = []
            for b in split(args.seqs, args.micro):
                ids = torch.randint(0, adapter.vocab_size, (b, args.seq), generator=g)
                mbs.append(MicroBatch.from_labels(ids, ids))
            start = timeline.marker() if timeline else None
            t = time.perf_counter()
            out = engine.train_step(mbs)
            norm = out.grad_sq_norm.sqrt().item()
            loss = out.loss_sum.item()
            end = timeline.marker() if timeline else None
            dt = time.perf_counter() - t
            pipeline.finish_step(lr=1e-5, clip_coef=clip_coefficient(norm, 1.0))
            now = time.perf_counter()
            wall, last_end = now - last_end, now
            shares = timeline.shares(start, end, gaps=args.gaps) if timeline else {}
            rec = {"step": step, "loss": loss, "grad_norm": norm, "step_s": dt, "wall_s": wall,
                   "tokens_per_s": tokens / dt, "tflops_6n": fpt6 * tokens / dt / 1e12,
                   "mfu": fpt_model * tokens / dt / H200_BF16_PEAK,
                   "busy_compute": shares.get("compute", 0.0) if cuda else None,
                   "busy_h2d": shares.get("h2d", 0.0) if cuda else None,
                   "busy_d2h": shares.get("d2h", 0.0) if cuda else None}
            rec["gpu_idle"] = 1.0 - rec["busy_compute"] if cuda else None
            if shares.get("gaps") is not None:  # --gaps: where the compute stream sat idle, longest first
                rec["idle_gaps"] = shares["gaps"]
                for gap in shares["gaps"]:
                    print(f"  idle {gap['ms']:8.1f} ms after [{gap['after']}] before [{gap['before']}]")
            # the optimizer thread since the last step's end (it updates step t-1 during this step's forward)
            st = pipeline.take_stats()
            rec.update(adamw_s=st["update_s"], adamw_wait_s=st["copy_wait_s"],
                       adamw_gparam_s=st["params"] / st["update_s"] / 1e9 if st["update_s"] else None)
            records.append(rec)
            busy = (f"compute {rec['busy_compute']:.2f} h2d {rec['busy_h2d']:.2f} d2h {rec['busy_d2h']:.2f} "
                    if cuda else "")
            print(f"step {step}: {dt:.2f}s (wall {wall:.2f}s) loss {loss:.3f} {rec['tflops_6n']:.0f} TFLOP/s(6N) "
                  f"{busy}adamw {rec['adamw_s']:.2f}s ({rec['adamw_gparam_s'] or 0:.2f} Gparam/s) "
                  f"waiting {rec['adamw_wait_s']:.2f}s", flush=True)
        pipeline.drain()
    finally:
        runtime.close()
    measured = records[args.warmup:]

    def mean(k):
        vals = [r[k] for r in measured if r[k] is not None]
        return sum(vals) / len(vals) if vals else None

    return {
        "label": args.label, "device": device.type, "compile": args.compile, "loss_chunk": engine.loss_chunk,
        "placement": asdict(placement),
        "planned": None if plan is None else {"gpu_peak_gib": plan.gpu_peak / 2**30, "gpu_needed_gib":
                                              plan.gpu_needed / 2**30, "host_gib": plan.host_total / 2**30,
                                              "step_s": plan.step_s, "why": plan.why},
        "model": Path(args.model).name, "layers": adapter.num_layers,
        "hidden": adapter.hidden_size, "params": n_params, "seq": args.seq, "seqs_per_step": args.seqs,
        "micro": args.micro, "tokens_per_step": tokens, "precision": args.precision,
        "step_s": mean("step_s"), "wall_step_s": mean("wall_s"), "tokens_per_s": mean("tokens_per_s"),
        "tflops_6n": mean("tflops_6n"), "mfu": mean("mfu"), "busy_compute": mean("busy_compute"),
        "busy_h2d": mean("busy_h2d"), "busy_d2h": mean("busy_d2h"), "gpu_idle": mean("gpu_idle"),
        "adamw_s": mean("adamw_s"), "adamw_wait_s": mean("adamw_wait_s"),
        "adamw_threads": args.adam_threads, "switch_interval": args.switch_interval,
        "gpu_peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "gpu_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
        "gpu_budget_gib": args.gpu_budget,
        "host_peak_rss_gib": peak_rss_bytes() / 2**30, "host_rss_gib": rss_bytes() / 2**30,
        "host_bytes_per_param": peak_rss_bytes() / n_params, "init_s": init_s, "steps": records,
        **step_spread(measured, "step_s"),  # every measured step, the slowest over the median and its idle stretches
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="folder with config.json")
    p.add_argument("--label", default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=158, help="sequences per optimizer step")
    p.add_argument("--micro", type=int, default=32, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--compile", action="store_true", help="torch.compile the layer template")
    p.add_argument("--spill", type=int, default=0, help="layers whose checkpoints live in pinned host memory")
    p.add_argument("--offload", type=int, default=0, help="units whose gradients go to host during backward "
                                                          "(memory.grads_to_host)")
    p.add_argument("--checkpoint-every", type=int, default=1, help="keep every K-th layer's input (memory."
                                                                     "checkpoint_every)")
    p.add_argument("--keep-top", type=int, default=0, help="with --checkpoint-every > 1: top layers that keep their "
                                                           "inputs (memory.keep_top_layers)")
    p.add_argument("--wave-groups", type=int, default=1, help="micro-batch groups per step (memory.wave_groups)")
    p.add_argument("--group-grads", choices=["gpu", "host"], default="gpu",
                   help="where accumulators wait between wave groups (memory.group_grads)")
    p.add_argument("--attn", default="default", choices=["default", "cudnn", "flash"],
                   help="preferred SDPA backend (others stay enabled as fallbacks)")
    p.add_argument("--adam-threads", type=int, default=None,
                   help="intra-op threads of the optimizer thread (default on CUDA: measured at the start, as "
                        "megatrain train does; on CPU: torch's)")
    p.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (GIL handoff, s)")
    p.add_argument("--gpu-budget", type=float, default=None,
                   help="GiB the caching allocator may hold (torch.cuda.set_per_process_memory_fraction)")
    p.add_argument("--auto", action="store_true", help="the planner chooses the placement from the GPU budget "
                   "(--gpu-budget, else free memory) and free host RAM, as megatrain train does (overrides --spill, "
                   "--offload, --checkpoint-every, --keep-top, --wave-groups, --group-grads, --stream-dtype)")
    p.add_argument("--profile", default=None, help="machine profile for --auto (default: as megatrain plan)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--gaps", type=int, default=3, help="record and print each step's N longest idle stretches of "
                   "the compute stream, with the uses before and after them (CUDA; the slowest step's are reported)")
    p.add_argument("--stream-dtype", default="bf16", choices=["bf16", "fp32"],
                   help="bf16 runs: stream a host bf16 copy, or the fp32 master cast on the GPU (memory.stream_dtype)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    args.label = args.label or Path(args.model).name
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = {"cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION],
             "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]}.get(args.attn)
    print("sdpa priority before:", torch._C._get_sdp_priority_order(), flush=True)
    if order:
        order += [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(order, set_priority=True):
            res = run(args)
    else:
        res = run(args)
    res["attn"] = args.attn
    write_json(args.json, {"command": " ".join(sys.argv), "result": res})
    cols = ["label", "params", "tokens_per_step", "step_s", "wall_step_s", "tokens_per_s", "tflops_6n", "mfu",
            "gpu_idle", "busy_h2d", "busy_d2h", "gpu_peak_gib", "host_peak_rss_gib", "host_bytes_per_param",
            "step_median_s", "slowest_step", "slowest_over_median", "slowest_idle_s"]
    print(spread_lines(res))
    print(table([res], cols))


if __name__ == "__main__":
    main()
