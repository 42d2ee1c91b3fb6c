"""Why one MoE layer's forward runs slower than its recompute + backward (a diagnosis, not a benchmark).

`megatrain probe --layer gpt-oss-120b:16x4096` on the H200 (2026-11-25) measured the compiled layer's forward (no
grad, as the engine's first pass runs it) at 117 TFLOP/s and its recompute + backward at 376. This times one layer
of MODEL at BxT four ways: compiled and eager, each under no_grad and with grad enabled (the forward only), then
profiles the compiled no-grad forward and prints its ten most expensive CUDA kernels.

    python3 bench/moe_forward_diag.py bench/model-configs/gpt-oss-120b:16x4096 [--json OUT.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from megatrain.models import get_adapter  # noqa: E402


def build(model_dir: str, micro: int, seq: int):
    ad = get_adapter(AutoConfig.from_pretrained(model_dir))
    unit = next(u for u in ad.units() if u.kind == "layer")
    flat = (torch.randn(unit.numel, device="cuda") * 0.02).to(torch.bfloat16)
    w = unit.views(flat)
    for s, v in zip(unit.specs, w.values()):
        if s.init == "ones":
            v.fill_(1.0)
    x = torch.randn(micro, seq, ad.hidden_size, device="cuda").to(torch.bfloat16)
    pos = torch.arange(seq, device="cuda").repeat(micro, 1)
    return ad, w, x, ad.make_context(pos, torch.bfloat16, False)


def timed(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("layer", help="MODEL_DIR:BxT")
    ap.add_argument("--json")
    a = ap.parse_args()
    model_dir, shape = a.layer.rsplit(":", 1)
    micro, seq = (int(s) for s in shape.split("x"))
    ad, w, x, ctx = build(model_dir, micro, seq)
    compiled = torch.compile(ad.layer_forward, dynamic=False)
    wg = {k: v.detach().requires_grad_(True) for k, v in w.items()}
    rows = {}
    for name, fn, ws, grad in (("compiled no_grad", compiled, w, False), ("compiled grad", compiled, wg, True),
                               ("eager no_grad", ad.layer_forward, w, False), ("eager grad", ad.layer_forward, wg, True)):
        def run():
            with torch.set_grad_enabled(grad):
                return fn(ws, x, ctx)
        rows[name] = timed(run)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with torch.no_grad():
            compiled(w, x, ctx)
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()),
                     key=lambda r: -r[1])[:10]
    print(f"{model_dir} {micro}x{seq}: forward of one layer (ms)")
    for k, v in rows.items():
        print(f"  {k:18s} {v * 1e3:9.1f}")
    print("compiled no_grad forward, top CUDA kernels (ms, calls):")
    for k, ms, n in kernels:
        print(f"  {ms:9.2f} {n:4d}  {k[:110]}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"layer": a.layer, "forward_ms": {k: v * 1e3 for k, v in rows.items()},
                       "top_kernels": [{"name": k, "ms": ms, "calls": n} for k, ms, n in kernels]}, f, indent=1)


if __name__ == "__main__":
    main()
