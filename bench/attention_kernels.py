"""The attention kernels megatrain's layers run on CUDA, timed at each family's shape: SDPA's causal kernel
(FlashAttention: plain unpacked rows) against FlexAttention (what a layer runs when it needs a mask or a score
change: packed rows, sliding windows shorter than the row, Gemma 2's soft-capping, gpt-oss's sinks), through
megatrain's own functions (models/attention.py: causal_attention, sink_attention; the contexts attention_context
builds). The planner times attention at one rate (Profile.attention_rate, fitted to flash runs); this measures
what the other kernel costs against it at the same shape.

    python bench/attention_kernels.py [--json OUT.json] [--reps 5]

Per case: forward alone (no autograd) and forward + backward, milliseconds and TFLOP/s by the planner's count
(forward 2·span·heads·head_dim per token, span = T for causal rows, 2W - W²/T with a window W; backward 2.5x the
forward), and for FlexAttention cases the time against the flash case of the same shape. A table last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from common import git_rev, machine, table, write_json  # noqa: E402
from megatrain.models.attention import attention_context, causal_attention, sink_attention  # noqa: E402

# (family, heads, kv_heads, head_dim, rows, tokens per row, window): real configs' attention shapes
SHAPES = [
    ("llama-3.1-8b", 32, 8, 128, 8, 4096, None),
    ("gemma-2-9b", 16, 8, 256, 8, 4096, None),
    ("gpt-oss-120b", 64, 8, 64, 8, 4096, None),
    ("gpt-oss-120b sliding", 64, 8, 64, 8, 4096, 128),
    ("llama-3.1-8b 32k", 32, 8, 128, 1, 32768, None),
]


def span(T: int, window: int | None) -> float:
    return float(T) if window is None or T <= window else 2.0 * window - window * window / T


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps (after two warm-up calls: compiling)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def case(name, kernel, h, kvh, d, B, T, window, reps, fn_kind):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, h, T, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(B, kvh, T, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(B, kvh, T, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    pos = torch.arange(T, device=dev).expand(B, T)
    cos = torch.ones(B, T, d, device=dev)
    ctx = attention_context(pos, cos, cos, packed=False, window=window, force_mask=kernel == "flex")
    scale = d ** -0.5
    sinks = torch.randn(h, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    cap = 50.0

    def softcap(score, b, hh, qi, ki):
        return torch.tanh(score / cap) * cap

    def attend():
        if fn_kind == "sinks":
            return sink_attention(q, k, v, sinks, ctx, scale)
        return causal_attention(q, k, v, ctx, scale, score_mod=softcap if fn_kind == "softcap" else None)

    def fwd():
        with torch.no_grad():
            attend()

    dout = torch.randn(B, h, T, d, device=dev, dtype=torch.bfloat16, generator=g)

    def fwd_bwd():
        attend().backward(dout)

    fwd_s, both_s = timed(fwd, reps), timed(fwd_bwd, reps)
    flops = 2.0 * span(T, window) * h * d * B * T
    torch.cuda.synchronize()
    return {"case": name, "kernel": kernel + ("" if fn_kind == "plain" else f"+{fn_kind}"), "heads": h,
            "kv_heads": kvh, "head_dim": d, "rows": B, "tokens": T, "window": window,
            "forward_ms": fwd_s * 1e3, "fwd_bwd_ms": both_s * 1e3, "forward_tflops": flops / fwd_s / 1e12,
            "fwd_bwd_tflops": 3.5 * flops / both_s / 1e12, "backward_tflops": 2.5 * flops / (both_s - fwd_s) / 1e12}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for name, h, kvh, d, B, T, window in SHAPES:
        runs = []
        if window is None:
            runs.append(("flash", "plain"))
        runs.append(("flex", "plain"))
        if name.startswith("gemma"):
            runs.append(("flex", "softcap"))
        if name.startswith("gpt-oss"):
            runs.append(("flex", "sinks"))
        base = None
        for kernel, kind in runs:
            r = case(name, kernel, h, kvh, d, B, T, window, args.reps, kind)
            if kernel == "flash":
                base = r
            r["vs_flash_fwd"] = r["forward_ms"] / base["forward_ms"] if base else None
            r["vs_flash_fwd_bwd"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base else None
            rows.append(r)
            print(f"{name:<22} {r['kernel']:<14} fwd {r['forward_ms']:8.2f} ms {r['forward_tflops']:6.0f} TF/s  "
                  f"fwd+bwd {r['fwd_bwd_ms']:8.2f} ms {r['fwd_bwd_tflops']:6.0f} TF/s", flush=True)
            torch.cuda.empty_cache()
    write_json(args.json, {"machine": machine(), "git": git_rev(), "command": " ".join(sys.argv), "results": rows})
    print(table(rows, ["case", "kernel", "head_dim", "rows", "tokens", "window", "forward_ms", "fwd_bwd_ms",
                       "forward_tflops", "backward_tflops", "vs_flash_fwd", "vs_flash_fwd_bwd"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
