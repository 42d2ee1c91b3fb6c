"""A rollout decode step's attention at a model's shape, each kernel the sampler could use (megatrain/rollout/
attention.py): one query per row over a KV slab's cached positions (a strided view, as the sampler's), left padding
masked.

    python bench/decode_attention.py --model bench/model-configs/qwen2.5-7b --rows 512 --cached 640

Kernels: sdpa-packed (torch's fused attention, the query heads packed per key/value head, the padding mask),
sdpa-packed-nomask (the same without a mask: prompts of one length, a lower bound), matmul (two batched matmuls, fp32
scores), repeat-kv (transformers' sdpa before it packed: the keys and values repeated per query head, then
sdpa with the mask). Reports each one's time per layer and per decode step (all layers), the cached keys' and
values' bytes over that time (GB/s; the HBM bound), and its largest difference from the matmul kernel's output.

The kernels alone, on inputs made here: inside the sampler (transformers' modules, its masks) sdpa-packed's decode
step has run 2.6x matmul's where alone the two take about the same time, so the sampler's choice is measured there
(bench_rollout.py --modes resident:matmul,resident:sdpa), not here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import table, write_json  # noqa: E402
from megatrain.rollout.attention import matmul_attention  # noqa: E402


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, default=512, help="live rows (the batch)")
    ap.add_argument("--cached", type=int, default=640, help="cached positions (prompt + tokens so far)")
    ap.add_argument("--padded", type=float, default=0.25, help="the largest share of a row's positions padded")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    H, Hkv, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    D = cfg.get("head_dim") or cfg["hidden_size"] // H
    B, n, G, dev = args.rows, args.cached, H // Hkv, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, 1, D, device=dev, dtype=torch.bfloat16, generator=g)
    k_slab = torch.randn(B, Hkv, n + 64, D, device=dev, dtype=torch.bfloat16, generator=g)
    v_slab = torch.randn(B, Hkv, n + 64, D, device=dev, dtype=torch.bfloat16, generator=g)
    k, v = k_slab[:, :, :n], v_slab[:, :, :n]
    pad = torch.randint(0, int(n * args.padded) + 1, (B,), device=dev, generator=g)
    mask = (torch.arange(n, device=dev)[None] >= pad[:, None])[:, None, None, :]  # [B, 1, 1, n]
    qp = q.reshape(B, Hkv, G, D)

    kernels = {
        "sdpa-packed": lambda: F.scaled_dot_product_attention(qp, k, v, attn_mask=mask),
        "sdpa-packed-nomask": lambda: F.scaled_dot_product_attention(qp, k, v),
        "matmul": lambda: matmul_attention(qp, k, v, mask, D ** -0.5),
        "repeat-kv": lambda: F.scaled_dot_product_attention(
            q, k.repeat_interleave(G, 1), v.repeat_interleave(G, 1), attn_mask=mask).reshape(B, Hkv, G, D),
    }
    ref = kernels["matmul"]().float()
    kv_bytes = 2 * B * Hkv * n * D * 2
    rows = []
    for name, fn in kernels.items():
        try:
            s = timed(fn, args.reps)
            diff = (fn().float() - ref).abs().max().item() if name != "sdpa-packed-nomask" else None
        except RuntimeError as e:  # a kernel torch has no implementation of at this shape
            print(f"{name}: {e}", file=sys.stderr)
            continue
        rows.append({"kernel": name, "layer_ms": s * 1e3, "step_ms": s * L * 1e3, "kv_gbps": kv_bytes / s / 1e9,
                     "max_diff": diff})
    res = {"model": Path(args.model).name, "rows": B, "cached": n, "heads": H, "kv_heads": Hkv, "head_dim": D,
           "layers": L, "device": torch.cuda.get_device_name(), "kernels": rows}
    write_json(args.json, {"command": " ".join(sys.argv), "result": res})
    print(table(rows, ["kernel", "layer_ms", "step_ms", "kv_gbps", "max_diff"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
