"""Kernel variants at the Llama-3.1-8B benchmark's shapes: the engine's LM head (chunk size, fused fp32
accumulation of the weight gradient, eager or Triton cross-entropy), the cross-entropy kernel alone against the
eager version, and the attention kernels (SDPA flash, cuDNN, FlexAttention).

    python bench/head_attn_variants.py --model bench/model-configs/llama-3.1-8b --micro 16 --seq 4096

Head variants run the engine's own LM-head loss (`megatrain.runtime.lmhead.head_loss`, with explicit
`HeadKernels`) on one micro-batch of random hidden states; each is compared with an fp32 reference of the same loss
and gradients (TF32 off). Without CUDA only the head part runs (a check of the script). Attention variants time
forward and forward + backward of causal GQA attention. Prints a table last and writes JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import hf_config, table, write_json  # noqa: E402
from megatrain.models import get_adapter  # noqa: E402
from megatrain.runtime import lmhead  # noqa: E402
from megatrain.runtime.lmhead import HeadKernels, head_loss  # noqa: E402


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke test of the head part only


def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    fn()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def head_reference(h, target_index, targets, norm_w, lm_w, adapter, chunk: int):
    """fp32 (TF32 off) loss sum, d hidden and LM-head weight gradient, scale 1/n."""
    H = h.shape[-1]
    x = h.reshape(-1, H).index_select(0, target_index).float().requires_grad_(True)
    w = lm_w.float().requires_grad_(True)
    xn = adapter.final_norm(norm_w.float(), x)
    n = x.shape[0]
    loss = torch.zeros((), device=h.device, dtype=torch.float64)
    dxn, dw = torch.zeros_like(xn), torch.zeros_like(w)
    xn_d = xn.detach()
    for a in range(0, n, chunk):
        xc = xn_d[a: a + chunk].requires_grad_(True)
        with torch.enable_grad():
            lc = F.cross_entropy(xc @ w.t(), targets[a: a + chunk], reduction="sum")
            gx, gw = torch.autograd.grad(lc / n, [xc, w])
        loss += lc.double()
        dxn[a: a + chunk] = gx
        dw += gw
    (dx,) = torch.autograd.grad(xn, [x], dxn)
    dh = torch.zeros(h.reshape(-1, H).shape, device=h.device)
    dh.index_copy_(0, target_index, dx)
    return loss, dh, dw


def head_variants(args, adapter) -> list[dict]:
    H, V = adapter.hidden_size, adapter.vocab_size
    dev, dtype = DEV, torch.bfloat16
    B, T = args.micro, args.seq
    n = B * (T - 1)
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(B, T, H, device=dev, generator=g).to(dtype)
    idx = torch.arange(B * T, device=dev).view(B, T)[:, :-1].reshape(-1)
    targets = torch.randint(0, V, (n,), device=dev, generator=g)
    norm_w = (1 + 0.1 * torch.randn(H, device=dev, generator=g)).to(dtype)
    lm_w = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dtype)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_loss, ref_dh, ref_dw = head_reference(h, idx, targets, norm_w, lm_w, adapter, 2048)
    rows = []
    default = lmhead.default_chunk(V)
    for chunk, fused, kernel in [(max(128, (1 << 28) // V), False, False), (default // 2, True, False),
                                 (default, True, False), (default, True, True)]:
        kernels = HeadKernels(fused_ce=kernel, fused_accumulate=fused)
        norm_g = torch.zeros(H, device=dev)
        lm_g = torch.zeros(V, H, device=dev)

        def run():
            return head_loss(adapter.final_norm, h, idx, targets, norm_w, lm_w, norm_g, lm_g, 1.0 / n, chunk,
                             kernels)

        loss, dh = run()
        lm_g.zero_()
        loss, dh = run()
        errs = {"loss_rel": abs(loss.item() * n - ref_loss.item()) / abs(ref_loss.item()),
                "dh_rel": rel(dh.reshape(-1, H), ref_dh), "dw_rel": rel(lm_g, ref_dw)}
        dt = timed(run, args.reps)
        rows.append({"what": f"head chunk {chunk}{' fused-acc' if fused else ''}{' triton-ce' if kernel else ''}",
                     "ms": dt * 1e3, "tflops": 6.0 * V * H * n / dt / 1e12, **errs,
                     "fused_refused": "; ".join(lmhead._fused_failed) or None,
                     "triton_refused": "; ".join(lmhead._triton_failed) or None})
        print(rows[-1], flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    return rows


def ce_kernel(args, adapter) -> list[dict]:
    """One chunk of logits: the Triton kernel against the eager cross-entropy (time, loss, gradient)."""
    from megatrain.runtime import ce_triton

    V, C = adapter.vocab_size, lmhead.default_chunk(adapter.vocab_size)
    g = torch.Generator(device=DEV).manual_seed(2)
    logits = (torch.randn(C, V, device=DEV, generator=g) * 3).to(torch.bfloat16)
    t = torch.randint(0, V, (C,), device=DEV, generator=g)
    t[::7] = -100
    scale = torch.tensor(1.0 / C, device=DEV)
    l_e, g_e = lmhead._ce_eager(logits.clone(), t, scale)
    l_k, g_k = ce_triton.ce_loss_and_grad_(logits.clone(), t, scale)
    work = logits.clone()
    rows = []
    for name, fn in (("eager", lambda: lmhead._ce_eager(work.copy_(logits), t, scale)),
                     ("triton", lambda: ce_triton.ce_loss_and_grad_(work.copy_(logits), t, scale)),
                     ("copy only", lambda: work.copy_(logits))):
        rows.append({"what": f"ce {name} {C}x{V}", "ms": timed(fn, args.reps) * 1e3})
    rows[1].update(loss_rel=abs(l_k.item() - l_e.item()) / abs(l_e.item()),
                   grad_max_diff=(g_k.float() - g_e.float()).abs().max().item(),
                   grad_max=g_e.float().abs().max().item())
    for r in rows:
        print(r, flush=True)
    return rows


def attention_variants(args, adapter) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, T = args.micro, args.seq
    Hq, Hk, D = adapter.num_heads, adapter.num_kv_heads, adapter.head_dim
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(1)
    q = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    k = torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    v = torch.randn(B, Hk, T, D, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    do = torch.randn(B, Hq, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    rep = Hq // Hk
    fwd_flops = 4.0 * B * Hq * T * T * D / 2  # causal: half the score matrix
    flex = torch.compile(flex_attention, dynamic=False)
    causal = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=dev, _compile=True)

    def expand(t):
        return t.repeat_interleave(rep, dim=1)

    variants = {
        "sdpa default, enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        "sdpa flash, kv expanded": lambda: _with(sdpa_kernel(SDPBackend.FLASH_ATTENTION),
                                                 lambda: F.scaled_dot_product_attention(q, expand(k), expand(v),
                                                                                        is_causal=True)),
        "sdpa cudnn, kv expanded": lambda: _with(sdpa_kernel(SDPBackend.CUDNN_ATTENTION),
                                                 lambda: F.scaled_dot_product_attention(q, expand(k), expand(v),
                                                                                        is_causal=True)),
        "flex compiled, causal mask": lambda: flex(q, k, v, block_mask=causal, enable_gqa=True),
    }
    ref = F.scaled_dot_product_attention(q.float(), expand(k).float(), expand(v).float(), is_causal=True)
    rows = []
    for name, fn in variants.items():
        try:
            with torch.no_grad():
                err = rel(fn(), ref)
                t_f = timed(fn, args.reps)

            def fb():
                out = fn()
                torch.autograd.grad(out, [q, k, v], do)

            t_fb = timed(fb, args.reps)
            rows.append({"what": f"attn {name}", "ms_fwd": t_f * 1e3, "ms_fwd_bwd": t_fb * 1e3,
                         "tflops_fwd": fwd_flops / t_f / 1e12, "tflops_fwd_bwd": 3.5 * fwd_flops / t_fb / 1e12,
                         "out_rel": err})
        except Exception as e:  # a backend that refuses these shapes
            rows.append({"what": f"attn {name}", "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(rows[-1], flush=True)
    return rows


def _with(ctx, fn):
    with ctx:
        return fn()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--parts", default="ce,head,attn", help="which variants: ce, head, attn")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    adapter = get_adapter(hf_config(args.model))
    cuda = DEV.type == "cuda"
    ce = ce_kernel(args, adapter) if cuda and "ce" in parts else []
    head = head_variants(args, adapter) if "head" in parts else []
    attn = attention_variants(args, adapter) if cuda and "attn" in parts else []
    write_json(args.json, {"command": " ".join(sys.argv), "result": {"ce": ce, "head": head, "attention": attn}})
    if head:
        print(table(head, ["what", "ms", "tflops", "loss_rel", "dh_rel", "dw_rel"]))
    if attn:
        print(table(attn, ["what", "ms_fwd", "ms_fwd_bwd", "tflops_fwd", "tflops_fwd_bwd", "out_rel", "error"]))
    if ce:
        print(table(ce, ["what", "ms", "loss_rel", "grad_max_diff", "grad_max"]))


if __name__ == "__main__":
    main()
