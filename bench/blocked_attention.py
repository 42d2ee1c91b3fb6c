"""Which kernels the attention blocked for its backward (memory.attn_block) should call on CUDA: SDPA's default for a
causal GQA call against the flash op and the cuDNN op called directly, forward alone and the backward over block
pairs, at Llama-3.1-8B's heads over long rows.

With the flash op per block pair, the blocked backward took 1.66x SDPA's on the H100, and a 524,288-token
Llama-3.1-8B step 1,270 s where SDPA's rate gives ~830 s; the cuDNN op per block pair runs at SDPA's speed, so the
engine runs the kernel SDPA picks (models/attention.blocked_kernel). This measures, per row length:

    sdpa      F.scaled_dot_product_attention(is_causal, enable_gqa): the backend SDPA picks (torch._fused_sdp_choice,
              recorded), forward alone and forward + backward over the whole row (what the planner's rate is)
    blocked   the engine's blocked forward + backward (its kernel recorded: cudnn or flash)
    flash     the flash op forward alone, and the same decomposition with the flash backward per pair
    cudnn     the cuDNN op forward alone (with its log-sum-exp), and the same decomposition with the cuDNN backward
              per pair, given the row's output and log-sum-exp slices; each variant's gradients against the
              engine's (relative error: whether the decomposition holds for that kernel) or the error it raised
    mixed     the cuDNN forward's output and log-sum-exp fed to the flash backward per pair (whether the two
              kernels' log-sum-exp agree; the forward is 3 of a blocked layer's 5 attention passes)

    python bench/blocked_attention.py [--seqs 131072 262144] [--block 65536] [--json OUT.json]

A table last.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import git_rev, machine, table, write_json  # noqa: E402
from attention_kernels import timed  # noqa: E402
from megatrain.models.attention import blocked_kernel, blockwise_backward, blockwise_causal  # noqa: E402

H, KH, D = 32, 8, 128


def _cudnn_forward(q, k, v, scale: float):
    """The cuDNN op's output, log-sum-exp ([B, heads, T, 1] there: as [B, heads, T], the flash op's layout) and what
    its backward takes besides (cumulative lengths, rng state)."""
    o, lse, cq, ck, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, True, False, scale=scale)
    return o, lse.reshape(q.shape[:3]), (cq, ck, seed, offset)


def cudnn_pairs_backward(q, k, v, do, scale: float, block: int):
    """The blocked backward with the cuDNN op: its forward over the row for the output and log-sum-exp, then its
    backward per (query block, key block) pair given their slices (megatrain's pair loop, blockwise_backward)."""
    o, lse, (cq, ck, seed, offset) = _cudnn_forward(q, k, v, scale)
    no_bias = None  # (a Tensor argument: None reaches the op as an undefined tensor, as autograd passes it)

    def pair(do_i, q_i, k_j, v_j, o_i, lse_i, causal):
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            do_i, q_i, k_j, v_j, o_i, lse_i.unsqueeze(-1), seed, offset, no_bias, cq, ck, q_i.shape[2],
            k_j.shape[2], 0.0, causal, scale=scale)

    return blockwise_backward(do, q, k, v, o, lse, block, pair)


def _flash_placeholders(q, k, v, scale: float):
    """What the flash backward takes besides the output and log-sum-exp (cumulative lengths, rng state)."""
    _, _, cq, ck, _, _, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
        q[:, :, :128], k[:, :, :128], v[:, :, :128], 0.0, True, False, scale=scale)
    return cq, ck, seed, offset


def _flash_pair(scale: float, cq, ck, seed, offset):
    def pair(do_i, q_i, k_j, v_j, o_i, lse_i, causal):
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do_i, q_i, k_j, v_j, o_i, lse_i, cq, ck, q_i.shape[2], k_j.shape[2], 0.0, causal, seed, offset,
            scale=scale)
    return pair


def flash_pairs_backward(q, k, v, do, scale: float, block: int):
    """The flash op's forward over the row and its backward per block pair (the engine's kernels before cuDNN)."""
    o, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return blockwise_backward(do, q, k, v, o, lse, block, _flash_pair(scale, *_flash_placeholders(q, k, v, scale)))


def cudnn_forward_flash_pairs(q, k, v, do, scale: float, block: int):
    """The cuDNN op's forward (its output and log-sum-exp) and the flash op's backward per block pair: whether the
    two kernels' log-sum-exp agree (the forward is 3 of a blocked layer's 5 attention passes)."""
    o, lse, _ = _cudnn_forward(q, k, v, scale)
    return blockwise_backward(do, q, k, v, o, lse, block, _flash_pair(scale, *_flash_placeholders(q, k, v, scale)))


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def row(T: int, block: int, reps: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, T, n, D, device="cuda", generator=g).to(torch.bfloat16).transpose(1, 2)
               for n in (H, KH, KH))
    do = (torch.randn(1, T, H, D, device="cuda", generator=g) * 0.1).to(torch.bfloat16).transpose(1, 2)
    scale = D ** -0.5
    fwd_flops = 2.0 * T * T * H * D  # causal: T²/2 pairs, 4 FLOPs each per head dim
    out = {"tokens": T, "block": block, "engine_kernel": blocked_kernel(q, k, v, scale)}
    try:
        out["sdpa_backend"] = int(torch._fused_sdp_choice(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    except Exception as e:  # the private probe may move between versions
        out["sdpa_backend"] = f"unknown ({type(e).__name__})"
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def sdpa_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def sdpa_both():
        o = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
        torch.autograd.grad(o, leaves, do)

    def flash_fwd():
        torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)

    def blocked_both():
        o = blockwise_causal(*leaves, scale, block)
        torch.autograd.grad(o, leaves, do)

    def cudnn_fwd():
        torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)

    for name, fn in (("sdpa_fwd", sdpa_fwd), ("sdpa_fwd_bwd", sdpa_both), ("flash_fwd", flash_fwd),
                     ("blocked_fwd_bwd", blocked_both), ("cudnn_fwd", cudnn_fwd)):
        try:
            out[f"{name}_s"] = timed(fn, reps)
        except Exception as e:
            out[f"{name}_s"] = None
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
        torch.cuda.empty_cache()
    o = blockwise_causal(*leaves, scale, block)
    want = torch.autograd.grad(o, leaves, do)  # the engine's blocked backward: what the variants are held against
    del o
    for name, fn in (("flash_pairs", flash_pairs_backward), ("cudnn_pairs", cudnn_pairs_backward),
                     ("cudnn_fwd_flash_pairs", cudnn_forward_flash_pairs)):
        try:
            got = fn(q, k, v, do, scale, block)
            out.update({f"{name}_d{n}_rel": rel(a, b) for n, a, b in zip("qkv", got, want)})
            del got
            out[f"{name}_fwd_bwd_s"] = timed(lambda: fn(q, k, v, do, scale, block), reps)
        except Exception as e:
            out[f"{name}_fwd_bwd_s"] = None
            out[f"{name}_error"] = "".join(traceback.format_exception_only(type(e), e))[:400]
        torch.cuda.empty_cache()
    for name in ("sdpa_fwd", "flash_fwd", "cudnn_fwd"):
        s = out.get(f"{name}_s")
        out[f"{name}_tflops"] = fwd_flops / s / 1e12 if s else None
    for name in ("sdpa_fwd_bwd", "blocked_fwd_bwd", "flash_pairs_fwd_bwd", "cudnn_pairs_fwd_bwd",
                 "cudnn_fwd_flash_pairs_fwd_bwd"):
        s = out.get(f"{name}_s")
        out[f"{name}_tflops"] = 3.5 * fwd_flops / s / 1e12 if s else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[131072, 262144])
    ap.add_argument("--block", type=int, default=65536)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("blocked_attention: needs CUDA", file=sys.stderr)
        return 2
    rows = []
    for T in args.seqs:
        rows.append(row(T, args.block, args.reps))
        print(rows[-1], flush=True)
    write_json(args.json, {"machine": machine(), "git": git_rev(), "command": " ".join(sys.argv), "results": rows})
    print(table(rows, ["tokens", "sdpa_backend", "engine_kernel", "sdpa_fwd_tflops", "flash_fwd_tflops",
                       "cudnn_fwd_tflops", "sdpa_fwd_bwd_tflops", "blocked_fwd_bwd_tflops",
                       "flash_pairs_fwd_bwd_tflops", "cudnn_pairs_fwd_bwd_tflops",
                       "cudnn_fwd_flash_pairs_fwd_bwd_tflops", "flash_pairs_dq_rel", "cudnn_pairs_dq_rel"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
