"""The MoE layer's experts alone on CUDA in bf16, as the engine runs them (models/moe.py: two grouped GEMMs over the
(token, slot) pairs sorted by expert): forward + backward time and TFLOP/s at each model's expert shape.

    python bench/moe_experts.py [--models qwen3-30b-a3b mixtral-8x7b gpt-oss-120b] [--tokens 16384] --json OUT.json

The shape (hidden, expert width, experts, experts per token) comes from bench/model-configs/<model>/config.json;
`--tokens` tokens are routed by random router logits (top-k of their softmax, renormalised), weights random. FLOPs
count the routed pairs only: 2 x pairs x 3 x hidden x width forward (gate, up, down), three times that forward and
backward. The time is the median of --reps after two warm-up passes. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import hf_config, table, write_json  # noqa: E402
from megatrain.models.moe import _grouped_ffn  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "model-configs"


def expert_shape(model: str) -> tuple[int, int, int, int]:
    """(hidden, expert width, experts, experts per token) of a model config's MoE layers."""
    c = hf_config(str(CONFIGS / model))
    width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts")
    return c.hidden_size, width, experts, c.num_experts_per_tok


def inputs(N: int, H: int, I: int, E: int, k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(N, H, device="cuda", dtype=torch.bfloat16, generator=g)
    logits = torch.randn(N, E, device="cuda", generator=g)
    top_p, top_i = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    top_w = (top_p / top_p.sum(-1, keepdim=True)).to(torch.bfloat16)
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    return x, top_i, top_w, gate_up, down


def measure(model: str, N: int, reps: int) -> dict:
    H, I, E, k = expert_shape(model)
    x, top_i, top_w, gate_up, down = inputs(N, H, I, E, k)
    leaves = [t.requires_grad_(True) for t in (x, top_w, gate_up, down)]

    def once():
        y = _grouped_ffn(leaves[0], top_i, leaves[1], leaves[2], leaves[3])
        y.backward(torch.ones_like(y))

    for _ in range(2):
        once()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        once()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    flops = 3 * 2 * N * k * 3 * H * I
    return {"model": model, "hidden": H, "expert_width": I, "experts": E, "top_k": k, "tokens": N,
            "fwd_bwd_ms": s * 1e3, "tflops": flops / s / 1e12}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-120b"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_experts.py: needs a CUDA device (the grouped GEMMs run there)")
    rows = [measure(m, a.tokens, a.reps) for m in a.models]
    write_json(a.json, {"bench": "moe_experts", "tokens": a.tokens, "reps": a.reps, "results": rows})
    print(table(rows, ["model", "hidden", "expert_width", "experts", "top_k", "tokens", "fwd_bwd_ms", "tflops"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
