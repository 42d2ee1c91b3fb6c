"""Rollout throughput (issue 38): megatrain's sampler against transformers' generate on the same device and batch
(resident), and against the bus bound (streamed: the decoder layers' bf16 bytes / the measured H2D rate, per decode
step). Random weights, every row decoding exactly --max-new tokens (EOS ignored), so both sides do the same work.

  python3 bench/bench_rollout.py --model bench/model-configs/qwen2.5-7b --prompts 64 --n 8 --prompt-len 128 \\
      --max-new 512 --modes resident,streamed,hf --json OUT.json
  python3 bench/bench_rollout.py --model bench/model-configs/qwen2.5-32b --prompts 32 --n 8 --prompt-len 128 \\
      --max-new 512 --modes streamed --json OUT.json
  python3 bench/bench_rollout.py --model megatrain/defaults/tiny-llama --device cpu --dtype fp32 --prompts 2 --n 2 \\
      --prompt-len 8 --max-new 8 --modes resident,streamed,hf        # a CPU check of the script

Writes {machine, config, runs: {mode: {tokens, seconds, tokens_per_s, prefill_s, decode_s, decode_step_s, ...}},
h2d_bps, bus_bound_step_s, streamed_vs_bus, resident_vs_hf, vs_hf (every run against generate), plan:
rollout_estimate per mode}. A mode MODE:KERNEL runs the sampler with that decode attention kernel (rollout/
attention.py's DECODE_KERNEL: sdpa, matmul; MODE alone: the default), e.g. --modes resident,resident:sdpa,hf.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import hf_config, write_json  # noqa: E402

from megatrain.planner.profile import DEFAULTS, load_profile  # noqa: E402
from megatrain.rollout import Sampler, SamplingParams  # noqa: E402
from megatrain.planner.rollout_estimate import rollout_estimate  # noqa: E402
from megatrain.rollout import attention  # noqa: E402
from megatrain.rollout.model import RandomWeights  # noqa: E402

DEFAULT_KERNEL = attention.DECODE_KERNEL


def measure_h2d(nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Pinned host -> device bytes/s, one direction, the best of `reps` copies of `nbytes`."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(max(1, args.prompt_len // 2), args.prompt_len + 1, (args.prompts,), generator=g).tolist()
    lens[0] = args.prompt_len
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def run_hf(cfg, weights, device, dtype, batch, args) -> dict:
    """transformers' generate over the same left-padded batch (n copies of each prompt), sampling at temperature 1,
    exactly max_new tokens per row."""
    from transformers import AutoModelForCausalLM

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval()
    views = {n: t for u in weights.units() for n, t in u.views().items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(views[name].view(p.shape))
    rows = [p for p in batch for _ in range(args.n)]
    P = max(map(len, rows))
    ids = torch.tensor([[0] * (P - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (P - len(r)) + [1] * len(r) for r in rows], device=device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.max_new,
              min_new_tokens=args.max_new, pad_token_id=0)
    model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:], **{**kw, "max_new_tokens": 2,
                                                                          "min_new_tokens": 2})  # warm-up
    sync(device)
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kw)
    sync(device)
    seconds = time.perf_counter() - t
    tokens = (out.shape[1] - P) * out.shape[0]
    del model, out
    return dict(tokens=tokens, seconds=seconds, tokens_per_s=tokens / seconds)


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128, help="the longest prompt (others from half of it)")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--modes", default="resident,streamed,hf",
                    help="of resident, streamed, hf; MODE:KERNEL for another decode attention kernel")
    ap.add_argument("--kv-on-host", action="store_true", help="streamed: the KV cache in pinned host memory")
    ap.add_argument("--compile", action="store_true", help="the sampler's compiled decoder layers")
    ap.add_argument("--layers", type=int, default=None, help="truncate the model to this many layers")
    ap.add_argument("--profile", default=None, help="a `megatrain probe` profile for the plan (default: its own)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = hf_config(args.model, num_hidden_layers=args.layers)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cuda = device.type == "cuda"
    t = time.perf_counter()
    weights = RandomWeights(cfg, dtype, seed=args.seed, pin=cuda)
    print(f"random weights: {weights.nbytes / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s", flush=True)
    batch = prompts(args, cfg.vocab_size)
    params = SamplingParams(max_new_tokens=args.max_new, temperature=1.0, n=args.n, seed=args.seed)
    runs: dict = {}
    modes = [m for m in args.modes.split(",") if m]
    for mode in modes:
        if mode == "hf":
            runs["hf"] = run_hf(cfg, weights, device, dtype, batch, args)
        else:
            base, _, kernel = mode.partition(":")  # resident:matmul: that decode attention kernel
            attention.DECODE_KERNEL = kernel or DEFAULT_KERNEL
            s = Sampler(cfg, weights, device, mode=base, dtype=dtype, kv_on_host=args.kv_on_host and base == "streamed",
                        compile=args.compile)
            s.generate(batch[:1], SamplingParams(max_new_tokens=2, n=2, seed=1))  # warm-up
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out = s.generate(batch, params)
            st = dict(out.stats)
            st["decode_step_s"] = st["decode_s"] / max(st["decode_steps"], 1)
            if cuda:
                st["gpu_peak_bytes"] = torch.cuda.max_memory_allocated()
            s.close()
            del s
            runs[mode] = st
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(mode, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in runs[mode].items()}, flush=True)
    layer_bytes = sum(u.nbytes for u in weights.layers)
    res = dict(model=args.model, config=vars(args), weight_bytes=weights.nbytes, layer_bytes=layer_bytes, runs=runs)
    if cuda:
        res["h2d_bps"] = measure_h2d()
        res["bus_bound_step_s"] = layer_bytes / res["h2d_bps"]
        streamed = [m for m in runs if m.partition(":")[0] == "streamed"]
        if streamed:  # the first streamed run's (streamed, or streamed:KERNEL)
            res["streamed_vs_bus"] = runs[streamed[0]]["decode_step_s"] / res["bus_bound_step_s"]
    if "resident" in runs and "hf" in runs:
        res["resident_vs_hf"] = runs["resident"]["tokens_per_s"] / runs["hf"]["tokens_per_s"]
    if "hf" in runs:
        res["vs_hf"] = {m: r["tokens_per_s"] / runs["hf"]["tokens_per_s"] for m, r in runs.items() if m != "hf"}
        print("vs hf:", {m: round(v, 3) for m, v in res["vs_hf"].items()})
    prof = load_profile(args.profile) if args.profile else DEFAULTS
    if cuda:
        import dataclasses
        prof = dataclasses.replace(prof, gpu_name=torch.cuda.get_device_name(), h2d_bps=res["h2d_bps"])
    res["plan"] = {m: rollout_estimate(cfg, args.prompts * args.n, args.prompt_len, args.max_new, m, prof,
                                       kv_on_host=args.kv_on_host and m == "streamed")
                   for m in ("resident", "streamed")}
    for k in ("resident_vs_hf", "streamed_vs_bus", "bus_bound_step_s", "h2d_bps"):
        if k in res:
            print(f"{k}: {res[k]:.4g}")
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
