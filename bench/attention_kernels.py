"""The attention kernels megatrain's layers run on CUDA, timed at each family's shape: SDPA's causal kernel
(plain unpacked rows), the variable-length flash kernel (models/varlen.py: packed rows, sliding windows) and
FlexAttention (a score SDPA cannot apply: Gemma 2's soft-capping, gpt-oss's sinks; before, also packed rows and
windows), through megatrain's own functions (models/attention.py: causal_attention, sink_attention; the contexts
attention_context builds).

    python bench/attention_kernels.py [--json OUT.json] [--reps 5] [--quick] [--cases NAME,...]
    python bench/attention_kernels.py --softcap [--bwd-sweep [tiles|flags]] [--json OUT.json] [--reps 5]

(--quick: no kernel_options sweep; --cases: only the shapes named. The JSON is rewritten after every case: a run cut
short keeps what it timed. --softcap: only Gemma 2's capped attention, before and now: softcap_paths; --bwd-sweep
adds other backward tiles or kernel flags.)

Two kinds of case:
    one row per document  every row one document (FLOPs as a plain causal row, or a window's): each kernel against
                          SDPA's at the same FLOPs
    packed                rows of documents 200-3,000 tokens long (seeded; one shape 50-600, long rows 8,192-24,000
                          and 32,768-98,304), as SFT packing makes them: the varlen kernel, FlexAttention with the
                          document block mask (and, at head_dim 256, with other kernel_options), and the plain causal
                          row of the same shape beside them (what the packed row costs against an unpacked one)

Each kernel's rate per executed FLOP as a share of SDPA's over plain rows of the same head_dim and length, against
the span its rows attend over (rate_vs_sdpa_*), and SDPA's own rates are what the planner times a layer's other
kernel at (kernel_time.kernel_extra): printed last as calibration.KERNEL_RATE and calibration.SDPA_RATE.

Per case: forward alone (no autograd) and forward + backward, milliseconds and TFLOP/s by the FLOPs executed
(forward 2·span·heads·head_dim per token, span = T for causal rows, 2W - W²/T with a window W, the sum of the
documents' for packed rows; backward 2.5x the forward), and for packed rows the exactness of the varlen output
against FlexAttention's. A table last.
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
from megatrain.models.attention import (attention_context, causal_attention, flex_attention,  # noqa: E402
                                        flex_kernel_options, sink_attention, softcap_score)

# (family, heads, kv_heads, head_dim, rows, tokens per row, window, score, packed documents' lengths): real
# configs' attention shapes
SHAPES = [
    ("llama-3.1-8b", 32, 8, 128, 8, 4096, None, "plain", (200, 3000)),
    ("llama-3.1-8b short docs", 32, 8, 128, 8, 4096, None, "plain", (50, 600)),
    ("qwen2.5-7b", 28, 4, 128, 8, 4096, None, "plain", (200, 3000)),
    ("gemma-2-9b", 16, 8, 256, 8, 4096, None, "softcap", (200, 3000)),
    ("gemma-3-27b sliding", 32, 16, 128, 8, 4096, 1024, "plain", (200, 3000)),
    ("gpt-oss-120b", 64, 8, 64, 8, 4096, None, "sinks", (200, 3000)),
    ("gpt-oss-120b sliding", 64, 8, 64, 8, 4096, 128, "sinks", (200, 3000)),
    ("llama-3.1-8b 32k", 32, 8, 128, 1, 32768, None, "plain", (8192, 24000)),
    ("llama-3.1-8b 128k", 32, 8, 128, 1, 131072, None, "plain", (8192, 24000)),
    ("qwen2.5-7b 128k long docs", 28, 4, 128, 1, 131072, None, "plain", (32768, 98304)),
]
# FlexAttention's kernel_options tried at head_dim 256 (its defaults there run at a third of flash's rate)
FLEX_OPTIONS = [None, {"BLOCK_M": 64, "BLOCK_N": 64}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8},
                {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2}, {"USE_TMA": True}, {"ROWS_GUARANTEED_SAFE": True}]
# --bwd-sweep: the soft-capped backward's tiles (M1 x N1: the dK/dV pass's query x key blocks, M2 x N2: dQ's),
# warps and stages tried beside megatrain's (the backward is ~5x its forward at head_dim 256)
BWD_SWEEP = [(m1, n1, m2, n2, w, st) for m1, n1, m2, n2, w, st in (
    (32, 64, 64, 32, 4, 2), (32, 64, 64, 32, 8, 2), (32, 128, 128, 32, 8, 2), (64, 128, 128, 64, 8, 1),
    (64, 64, 64, 64, 4, 2), (64, 64, 64, 64, 8, 3), (64, 64, 64, 64, 8, 1), (32, 64, 64, 32, 4, 3),
    (128, 64, 64, 128, 8, 1), (32, 32, 32, 32, 4, 2), (32, 32, 32, 32, 4, 3), (16, 64, 64, 16, 4, 2))]
# --bwd-sweep flags: kernel flags over megatrain's tiles (Hopper's tensor-memory accelerator for the loads; not
# PRESCALE_QK, which hands score_mod a score scaled by 1/ln 2)
BWD_FLAGS = [{"USE_TMA": True}, {"bwd_USE_TMA": True}, {"fwd_USE_TMA": True}]
CAP = 50.0


def span(T: int, window: int | None) -> float:
    return float(T) if window is None or T <= window else 2.0 * window - window * window / T


def doc_span(lengths: list[int], window: int | None) -> float:
    """Tokens-weighted span of rows made of these documents: sum over documents of L·span(L), per token."""
    return sum(L * span(L, window) for L in lengths) / sum(lengths)


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


def documents(B: int, T: int, seed: int, lo: int, hi: int) -> tuple[torch.Tensor, list[int]]:
    """position_ids [B, T] of rows packed with documents of lo-hi tokens (seeded), and the documents' lengths."""
    g = torch.Generator().manual_seed(seed)
    pos, lengths = torch.empty(B, T, dtype=torch.long), []
    for b in range(B):
        t = 0
        while t < T:
            n = min(int(torch.randint(lo, hi + 1, (1,), generator=g)), T - t)
            pos[b, t:t + n] = torch.arange(n)
            lengths.append(n)
            t += n
    return pos, lengths


def case(name, kernel, h, kvh, d, B, T, window, reps, score, packed, docs, options=None):
    """One timing: `kernel` "flash" (SDPA's causal), "varlen" or "flex" (with `score`), over plain causal rows or
    rows packed with documents."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, h, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    k = torch.randn(B, T, kvh, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    v = torch.randn(B, T, kvh, d, device=dev, dtype=torch.bfloat16, generator=g).transpose(1, 2).requires_grad_()
    if packed:
        pos, lengths = documents(B, T, 0, *docs)
        pos = pos.to(dev)
    else:
        pos, lengths = torch.arange(T, device=dev).expand(B, T), [T] * B
    cos = torch.ones(B, T, d, device=dev, dtype=torch.bfloat16)
    # varlen over unpacked rows: one segment per row (positions 0..T-1 read as one document each); flash beside
    # packed rows: the plain causal row of the same shape
    ctx = attention_context(pos if kernel != "flash" else torch.arange(T, device=dev).expand(B, T), cos, cos,
                            packed=(packed and kernel != "flash") or kernel == "varlen", window=window,
                            force_mask=kernel == "flex", flex_options=flex_kernel_options(score, d, dev)
                            if kernel == "flex" and score == "softcap" else None)
    if kernel == "varlen" and options:
        ctx.with_attn_block(options["attn_block"])
    assert (kernel == "varlen") == ctx.varlen and (kernel == "flex") == (ctx.block_mask is not None), kernel
    scale = d ** -0.5
    sinks = torch.randn(h, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)

    softcap = softcap_score(CAP)  # Gemma 2's, as its layers run it

    def attend():
        if kernel == "flex" and options:
            return flex_attention()(q, k, v, score_mod=softcap if score == "softcap" else None,
                                    block_mask=ctx.block_mask, scale=scale, enable_gqa=kvh != h,
                                    kernel_options=options)
        if kernel == "flex" and score == "sinks":
            return sink_attention(q, k, v, sinks, ctx, scale)
        return causal_attention(q, k, v, ctx, scale, score_mod=softcap if kernel == "flex" and score == "softcap"
                                else None)

    def fwd():
        with torch.no_grad():
            attend()

    dout = torch.randn(B, h, T, d, device=dev, dtype=torch.bfloat16, generator=g)

    def fwd_bwd():
        attend().backward(dout)

    fwd_s, both_s = timed(fwd, reps), timed(fwd_bwd, reps)
    flops = 2.0 * doc_span(lengths, window) * h * d * B * T
    row = {"case": name, "rows_are": "packed" if packed else "one doc", "kernel": kernel + (
        "" if kernel != "flex" or score == "plain" else f"+{score}"), "options": options, "heads": h,
        "kv_heads": kvh, "head_dim": d, "rows": B, "tokens": T, "window": window, "documents": len(lengths),
        "span": doc_span(lengths, window),
        "forward_ms": fwd_s * 1e3, "fwd_bwd_ms": both_s * 1e3, "forward_tflops": flops / fwd_s / 1e12,
        "fwd_bwd_tflops": 3.5 * flops / both_s / 1e12, "backward_tflops": 2.5 * flops / (both_s - fwd_s) / 1e12}
    if packed and kernel == "varlen":  # the output against FlexAttention's with the document mask
        with torch.no_grad():
            fctx = attention_context(pos, cos, cos, packed=True, window=window, force_mask=True)
            ref = causal_attention(q, k, v, fctx, scale)
            row["max_abs_vs_flex"] = float((attend().float() - ref.float()).abs().max())
    del q, k, v, dout, ctx
    torch.cuda.synchronize()
    return row


def softcap_paths(reps: int, bwd_sweep: str | None = None) -> list[dict]:
    """Gemma 2's capped attention at its shape (rows packed with 200-3,000-token documents, and rows of one document)
    three ways: as megatrain ran it before (cap·tanh on FlexAttention's default kernel options), the sigmoid form
    (softcap_score) on the defaults, and megatrain's path (the sigmoid form with flex_kernel_options). Forward and
    forward + backward times, and each output's largest error against float64 math (cap·tanh) over row 0's first
    two documents (its one document, unpacked). Queries scaled so the scores reach the cap's bend (|s| up to ~100
    before the cap of 50). bwd_sweep "tiles": megatrain's forward options with each BWD_SWEEP backward beside them
    (packed rows), "flags": megatrain's options with each of BWD_FLAGS; each one's gradients against megatrain's
    path's (grad_rel_vs_tuned: the largest difference over the largest gradient)."""
    name, h, kvh, d, B, T, _, _, docs = next(s for s in SHAPES if s[7] == "softcap")
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = (torch.randn(B, T, h, d, device=dev, generator=g) * 4).bfloat16().transpose(1, 2).requires_grad_()
    k, v = (torch.randn(B, T, kvh, d, device=dev, generator=g).bfloat16().transpose(1, 2).requires_grad_()
            for _ in range(2))
    dout = torch.randn(B, h, T, d, device=dev, dtype=torch.bfloat16, generator=g)
    scale, cos = d ** -0.5, torch.ones(B, T, d, device=dev, dtype=torch.bfloat16)

    def tanh_cap(sc, b, hh, qi, ki):
        return torch.tanh(sc / CAP) * CAP

    out = []
    tuned = flex_kernel_options("softcap", d, dev)
    for packed in (True, False):
        pos, lengths = documents(B, T, 0, *docs) if packed else (torch.arange(T).expand(B, T), [T] * B)
        ctx = attention_context(pos.to(dev), cos, cos, packed=packed, window=None, force_mask=True, head_dim=d)
        ref = []
        with torch.no_grad():  # float64 truth over row 0's first two documents
            lo = 0
            for n in lengths[:2 if packed else 1]:  # (row 0 holds the first documents)
                qq = q[0, :, lo:lo + n].double()
                kk, vv = (t[0, :, lo:lo + n].double().repeat_interleave(h // kvh, 0) for t in (k, v))
                sc = (CAP * torch.tanh(qq @ kk.transpose(1, 2) * scale / CAP)).masked_fill(
                    ~torch.ones(n, n, dtype=torch.bool, device=dev).tril(), float("-inf"))
                ref.append((lo, n, torch.softmax(sc, -1) @ vv))
                lo += n
        paths = [("tanh, defaults (before)", tanh_cap, None), ("sigmoid, defaults", softcap_score(CAP), None),
                 ("sigmoid, tuned (megatrain)", softcap_score(CAP), tuned)]
        if bwd_sweep == "tiles" and packed and tuned:
            paths += [(f"sigmoid, bwd {m1}x{n1} {m2}x{n2} w{w} s{st}", softcap_score(CAP), dict(
                tuned, bwd_BLOCK_M1=m1, bwd_BLOCK_N1=n1, bwd_BLOCK_M2=m2, bwd_BLOCK_N2=n2, bwd_num_warps=w,
                bwd_num_stages=st)) for m1, n1, m2, n2, w, st in BWD_SWEEP]
        if bwd_sweep == "flags" and packed and tuned:
            paths += [(f"sigmoid, tuned + {' '.join(f)}", softcap_score(CAP), dict(tuned, **f)) for f in BWD_FLAGS]
        grads_tuned = None
        for path, score_mod, options in paths:
            def attend():
                return flex_attention()(q, k, v, score_mod=score_mod, block_mask=ctx.block_mask, scale=scale,
                                        enable_gqa=True, kernel_options=options)

            def fwd():
                with torch.no_grad():
                    attend()

            def fwd_bwd():
                attend().backward(dout)

            try:
                f, fb = timed(fwd, reps), timed(fwd_bwd, reps)
            except Exception as e:  # tiles the kernel refuses (shared memory)
                print(f"{name} {path}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                out.append({"case": name, "rows_are": "packed" if packed else "one doc", "path": path,
                            "options": options, "error": str(e)[:300]})
                q.grad = k.grad = v.grad = None
                torch.cuda.empty_cache()
                continue
            q.grad = k.grad = v.grad = None
            attend().backward(dout)
            grads = [t.grad.float() for t in (q, k, v)]
            q.grad = k.grad = v.grad = None
            if options is tuned:
                grads_tuned = grads
            rel = None if grads_tuned is None else max(float((a - b).abs().max() / b.abs().max())
                                                       for a, b in zip(grads, grads_tuned))
            with torch.no_grad():
                o = attend()
            err = max(float((o[0, :, lo:lo + n].double() - r).abs().max()) for lo, n, r in ref)
            out.append({"case": name, "rows_are": "packed" if packed else "one doc", "path": path,
                        "options": options, "documents": len(lengths), "forward_ms": f * 1e3,
                        "fwd_bwd_ms": fb * 1e3, "max_abs_vs_float64": err, "grad_rel_vs_tuned": rel})
            print(f"{name} {out[-1]['rows_are']:<8} {path:<28} fwd {f * 1e3:7.2f} ms  fwd+bwd {fb * 1e3:7.2f} ms  "
                  f"vs float64 {err:.3g}", flush=True)
        first = [r for r in out if r["rows_are"] == out[-1]["rows_are"] and "error" not in r]
        for r in first:
            r["speedup_vs_before_fwd"] = first[0]["forward_ms"] / r["forward_ms"]
            r["speedup_vs_before_fwd_bwd"] = first[0]["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    return out


def runs_for(name: str, T: int, window, score: str, quick: bool):
    """(kernel, score, packed, options) timed for one shape."""
    out = []
    for packed in (False, True):
        if window is None:
            out.append(("flash", "plain", packed, None))  # packed: the plain row of the same shape, beside it
        if score in ("plain", "softcap"):  # (Gemma 2 without its cap: what the cap costs)
            out.append(("varlen", "plain", packed, None))
        if T > 32768:  # long rows: the backward over blocks of 65,536 (memory.attn_block)
            out.append(("varlen", "plain", packed, {"attn_block": 65536}))
        if T <= 32768 or score != "plain" or packed:
            out.append(("flex", "plain", packed, None))
        if score != "plain":
            out.append(("flex", score, packed, None))
        if score == "softcap" and packed and not quick:
            out += [("flex", score, True, o) for o in FLEX_OPTIONS[1:]]
    return out


def kernel_rate(rows: list[dict]) -> dict:
    """calibration.KERNEL_RATE from the timings: per (kernel, score, head_dim), (span, forward rate, forward +
    backward rate) points by span, each rate per executed FLOP as a share of SDPA's over plain rows of the same
    head_dim and length (points within 5% of a span averaged)."""
    groups: dict = {}
    for r in rows:
        if "error" in r or r["options"] or r["kernel"] == "flash" or r.get("rate_vs_sdpa_fwd") is None:
            continue
        kernel, _, score = r["kernel"].partition("+")
        groups.setdefault((kernel, score or "plain", r["head_dim"]), []).append(
            (r["span"], r["rate_vs_sdpa_fwd"], r["rate_vs_sdpa_fwd_bwd"]))
    out = {}
    for key, pts in sorted(groups.items()):
        merged: list[list] = []
        for span, f, fb in sorted(pts):
            if merged and span <= merged[-1][0][-1] * 1.05:
                merged[-1][0].append(span), merged[-1][1].append(f), merged[-1][2].append(fb)
            else:
                merged.append([[span], [f], [fb]])
        out[key] = tuple((round(sum(s) / len(s)), round(sum(f) / len(f), 3), round(sum(b) / len(b), 3))
                         for s, f, b in merged)
    return out


def sdpa_rate(rows: list[dict]) -> dict:
    """calibration.SDPA_RATE from the timings: per head_dim, (tokens per row, forward FLOP/s, forward + backward
    FLOP/s) of SDPA's causal kernel over plain rows (several shapes of one length averaged)."""
    by: dict = {}
    for r in rows:
        if "error" not in r and r["kernel"] == "flash" and r["rows_are"] == "one doc":
            by.setdefault(r["head_dim"], {}).setdefault(r["tokens"], []).append(
                (r["forward_tflops"], r["fwd_bwd_tflops"]))
    return {d: tuple((T, round(sum(f for f, _ in v) / len(v)) * 1e12, round(sum(b for _, b in v) / len(v)) * 1e12)
                     for T, v in sorted(ts.items())) for d, ts in sorted(by.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="no kernel_options sweep (compiling it takes most time)")
    ap.add_argument("--softcap", action="store_true",
                    help="only Gemma 2's capped attention: before, the sigmoid form, megatrain's tuned path")
    ap.add_argument("--cases", help="only the shapes whose names contain one of these (comma-separated)")
    ap.add_argument("--bwd-sweep", nargs="?", const="tiles", choices=["tiles", "flags"],
                    help="with --softcap: BWD_SWEEP's backward tiles, or BWD_FLAGS over megatrain's, beside it")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("attention_kernels: needs CUDA", file=sys.stderr)
        return 2
    if args.softcap:
        rows = softcap_paths(args.reps, args.bwd_sweep)
        write_json(args.json, {"machine": machine(), "git": git_rev(), "command": " ".join(sys.argv),
                               "softcap": rows, "complete": True})
        print(table([r for r in rows if "error" not in r],
                    ["case", "rows_are", "path", "documents", "forward_ms", "fwd_bwd_ms", "speedup_vs_before_fwd",
                     "speedup_vs_before_fwd_bwd", "max_abs_vs_float64", "grad_rel_vs_tuned"]))
        return 0
    rows, bases, seen = [], {}, set()
    wanted = args.cases.split(",") if args.cases else None
    for name, h, kvh, d, B, T, window, score, docs in SHAPES:
        if wanted and not any(w in name for w in wanted):
            continue
        base = {}
        one_doc_done = (h, kvh, d, B, T, window, score) in seen  # the same shape's one-document rows timed before
        seen.add((h, kvh, d, B, T, window, score))
        for kernel, kind, packed, options in runs_for(name, T, window, score, args.quick):
            if one_doc_done and not packed:
                continue
            try:
                r = case(name, kernel, h, kvh, d, B, T, window, args.reps, kind, packed, docs, options)
            except Exception as e:  # a kernel_options set the kernel refuses (shared memory), or an OOM
                print(f"{name:<22} {kernel} {kind} packed={packed} {options}: {type(e).__name__}: {str(e)[:200]}",
                      flush=True)
                rows.append({"case": name, "kernel": kernel, "options": options, "error": str(e)[:300]})
                torch.cuda.empty_cache()
                continue
            if kernel == "flash" and not packed:
                base = bases[(d, T)] = r
            r["vs_flash_fwd"] = r["forward_ms"] / base["forward_ms"] if base else None
            r["vs_flash_fwd_bwd"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"] if base else None
            sdpa = bases.get((d, T))  # SDPA over plain rows of this head_dim and length: the planner's rate
            r["rate_vs_sdpa_fwd"] = r["forward_tflops"] / sdpa["forward_tflops"] if sdpa else None
            r["rate_vs_sdpa_fwd_bwd"] = r["fwd_bwd_tflops"] / sdpa["fwd_bwd_tflops"] if sdpa else None
            rows.append(r)
            write_json(args.json, {"machine": machine(), "git": git_rev(), "command": " ".join(sys.argv),
                                   "results": rows, "complete": False})
            print(f"{name:<22} {r['rows_are']:<8} {r['kernel']:<14} {str(options or ''):<40} span {r['span']:7.0f} "
                  f"fwd {r['forward_ms']:8.2f} ms {r['forward_tflops']:6.0f} TF/s  fwd+bwd {r['fwd_bwd_ms']:8.2f} ms "
                  f"{r['fwd_bwd_tflops']:6.0f} TF/s" +
                  (f"  vs flex {r['max_abs_vs_flex']:.3g}" if "max_abs_vs_flex" in r else ""), flush=True)
            torch.cuda.empty_cache()
    rates = {"|".join(map(str, k)): v for k, v in kernel_rate(rows).items()}
    write_json(args.json, {"machine": machine(), "git": git_rev(), "command": " ".join(sys.argv), "results": rows,
                           "complete": True, "kernel_rate": rates, "sdpa_rate": sdpa_rate(rows)})
    print(table([r for r in rows if "error" not in r],
                ["case", "rows_are", "kernel", "head_dim", "rows", "tokens", "window", "documents", "forward_ms",
                 "fwd_bwd_ms", "forward_tflops", "fwd_bwd_tflops", "vs_flash_fwd_bwd"]))
    print("calibration.KERNEL_RATE =", kernel_rate(rows))
    print("calibration.SDPA_RATE =", sdpa_rate(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
