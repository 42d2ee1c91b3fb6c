"""The in-GPU peer: plain transformers on one GPU for a model that fits in HBM, same tokens per step.

fp32 master weights on the GPU, bf16 autocast, gradient checkpointing (so it recomputes like megatrain), SDPA
attention, fused GPU AdamW, gradient accumulation over micro-batches, global-norm clipping.

    python bench/bench_reference.py --model bench/model-configs/llama-3b-shape --seq 1024 --seqs 64 --micro 8

Mixtures of experts: the router's load-balancing loss is part of the loss (`output_router_logits`, as megatrain
trains them) and `--experts-impl` picks transformers' expert kernels (`grouped_mm`: torch's grouped GEMM, the
fastest it has; `eager`: a loop over the experts that received tokens). `--layers N` truncates the depth the way
bench_cli.py does (the first N of the real layer pattern). A run that does not fit in GPU memory is recorded as such
(`fits: false`, the peak allocated before it failed) and exits 3; a run that `timeout` stops (SIGTERM) records
the tokens/s of the micro-batches it finished after the first (`partial: true`) and exits 124.

`--device cpu` runs the same loop on the CPU (a check of the script, with a tiny config.json).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import H200_BF16_PEAK, hf_config, peak_rss_bytes, table, write_json  # noqa: E402
from megatrain.planner.flops import active_params, flops_per_token  # noqa: E402
from megatrain.models import get_adapter  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--experts-impl", default=None, choices=("grouped_mm", "eager", "batched_mm"),
                   help="transformers' experts implementation for a MoE model (its default when not given)")
    p.add_argument("--device", default="cuda", help="cuda (the benchmark), or cpu to check the script")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    cfg = hf_config(args.model, num_hidden_layers=args.layers)
    adapter = get_adapter(cfg)
    moe = active_params(adapter) < sum(u.numel for u in adapter.units())
    if moe:
        cfg.output_router_logits = True  # the load-balancing loss in the loss, as megatrain trains a MoE
    extra = {"experts_implementation": args.experts_impl} if args.experts_impl else {}
    torch.manual_seed(0)
    attn = "sdpa"
    with dev:
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn, **extra)
        except ValueError as e:  # a family transformers runs without SDPA (gpt-oss: attention sinks)
            if "scaled_dot_product_attention" not in str(e):
                raise
            attn = "eager"
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn, **extra)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=True)  # fused: CUDA and CPU
    n_params = sum(p.numel() for p in model.parameters())
    n_active = active_params(adapter)
    fpt6, fpt_model = flops_per_token(adapter, args.seq)
    label = f"transformers-in-gpu {Path(args.model).name}" + (f" {args.layers}L" if args.layers else "") + (
        f" experts={getattr(model.config, '_experts_implementation', None) or 'default'}" if moe else "") + (
        f" attn={attn}" if attn != "sdpa" else "")
    head = {"label": label, "attn_implementation": attn, "params": n_params, "params_active": n_active,
            "layers": cfg.num_hidden_layers, "seq": args.seq, "seqs_per_step": args.seqs, "micro": args.micro,
            "tokens_per_step": args.seqs * args.seq}

    def on_term(signum, frame):  # `timeout` ended the run: record the rate of the micro-batches that ran
        # fits: unknown until a step has run (torch's AdamW allocates its states, 8 B/param, at its first step)
        res = {**head, "fits": True if PROGRESS.get("step") else None, "partial": True, **PROGRESS,
               "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "host_peak_rss_gib": peak_rss_bytes() / 2**30}
        if PROGRESS.get("tokens_per_s"):
            res["tflops_6n"] = fpt6 * PROGRESS["tokens_per_s"] / 1e12
            res["tflops_6n_active"] = 6 * n_active * PROGRESS["tokens_per_s"] / 1e12 if moe else None
        write_json(args.json, {"command": " ".join(sys.argv), "result": res})
        print(f"{label}: stopped (signal {signum}) in step {PROGRESS.get('step')} after "
              f"{PROGRESS.get('micro_done')} micro-batches; partial result written", flush=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_term)
    try:
        records = train_steps(args, model, opt, cfg, dev, sync, fpt6, fpt_model, n_active)
    except torch.OutOfMemoryError as e:
        res = {**head, "fits": False, "error": str(e).splitlines()[0][:300],
               "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
               "host_peak_rss_gib": peak_rss_bytes() / 2**30}
        write_json(args.json, {"command": " ".join(sys.argv), "result": res})
        print(f"{label}: does not fit in GPU memory ({res['error']}); peak allocated {res['gpu_peak_gib']:.1f} GiB")
        sys.exit(3)
    m = records[args.warmup:]
    mean = lambda k: sum(r[k] for r in m) / len(m)
    res = {**head, "fits": True, "step_s": mean("step_s"), "tokens_per_s": mean("tokens_per_s"),
           "tflops_6n": mean("tflops_6n"), "tflops_6n_active": mean("tflops_6n_active") if moe else None,
           "mfu": mean("mfu"), "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "host_peak_rss_gib": peak_rss_bytes() / 2**30, "steps": records}
    write_json(args.json, {"command": " ".join(sys.argv), "result": res})
    print(table([res], ["label", "params", "tokens_per_step", "step_s", "tokens_per_s", "tflops_6n", "tflops_6n_active",
                        "mfu", "gpu_peak_gib"]))


PROGRESS: dict = {}  # where the current step is: what a run stopped by `timeout` records


def train_steps(args, model, opt, cfg, dev, sync, fpt6, fpt_model, n_active) -> list[dict]:
    """Warm-up and measured steps: micro-batches of random token ids, autocast bf16, clip, AdamW."""
    g = torch.Generator().manual_seed(0)
    records = []
    n_micro = args.seqs // args.micro
    every = max(1, n_micro // 16)  # progress reports (a GPU sync each) per step
    for step in range(args.warmup + args.steps):
        sync()
        t = time.perf_counter()
        t1 = None
        for i in range(n_micro):
            ids = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / n_micro
            loss.backward()
            if i == 0 or (i + 1) % every == 0:
                sync()
                now = time.perf_counter()
                t1 = now if i == 0 else t1
                # the micro-batches after the first (its one-off costs apart), the optimizer step not included
                rate = i * args.micro * args.seq / (now - t1) if i else None
                PROGRESS.update(step=step, micro_done=i + 1, micro_total=n_micro, elapsed_s=now - t,
                                first_micro_s=t1 - t, tokens_per_s=rate)
                print(f"step {step} micro-batch {i + 1}/{n_micro}: {now - t:.1f} s"
                      + (f", {rate:,.0f} tokens/s after the first" if rate else ""), flush=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - t
        tokens = args.seqs * args.seq
        records.append({"step": step, "step_s": dt, "tokens_per_s": tokens / dt,
                        "tflops_6n": fpt6 * tokens / dt / 1e12, "tflops_6n_active": 6 * n_active * tokens / dt / 1e12,
                        "mfu": fpt_model * tokens / dt / H200_BF16_PEAK})
        print(f"step {step}: {dt:.2f}s {records[-1]['tflops_6n']:.0f} TFLOP/s(6N) "
              f"{records[-1]['tflops_6n_active']:.0f} TFLOP/s(6N_active)", flush=True)
    return records


if __name__ == "__main__":
    main()
