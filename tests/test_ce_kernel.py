"""The CUDA cross-entropy kernel (megatrain.runtime.ce_triton) equals the eager version, run by Triton's CPU interpreter.

The kernel is what the engine's LM head uses on CUDA; on the GPU the same comparison runs at full size in
bench/head_attn_variants.py. Here: fp32 and bf16 logits, vocabularies below, at and above the kernel's block,
rows with target -100 (zero loss, zero gradient), a row-strided (non-contiguous) chunk. In fp32 the kernel and the
eager version are each held to float64 within fp32 rounding; in bf16 the kernel to the eager version.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton (the test extra) runs the kernel in its CPU interpreter")

SCRIPT = r"""
import json, sys, torch
from megatrain.runtime import ce_triton, lmhead
torch.manual_seed(0)
out = []
for dtype in (torch.float32, torch.bfloat16):
    for V in (1000, ce_triton.BLOCK, 2 * ce_triton.BLOCK + 7):
        n = 5
        base = (torch.randn(n, V + 3) * 4).to(dtype)
        logits = base[:, :V]  # rows strided by V + 3
        tail = base[:, V:].clone()
        t = torch.randint(0, V, (n,))
        t[1] = -100
        t[3] = V - 1
        scale = torch.tensor(0.37)
        # float64, before the kernel writes over the logits: (softmax - onehot) * scale, and each element's fp32
        # error scale: exp(x - lse) with x and lse rounded to fp32 is off by |g|·(|x| + |lse| + 1) units of 2^-24
        # (times a few), plus the rounding of the onehot's subtraction
        x64 = logits.double()
        lse64 = torch.logsumexp(x64, -1, keepdim=True)
        p64 = (x64 - lse64).exp()
        g64 = p64.clone()
        g64[torch.arange(n), t.clamp_min(0)] -= 1
        g64 *= 0.37 * (t >= 0).double()[:, None]
        unit = (p64 * 0.37 * (x64.abs() + lse64.abs() + 1) + 0.37) * 2**-24
        l_ref, g_ref = lmhead._ce_eager(logits.clone(), t, scale)
        l, g = ce_triton.ce_loss_and_grad_(logits, t, scale)
        gr = g_ref.float()
        out.append({"dtype": str(dtype), "V": V, "loss": float(l), "loss_ref": float(l_ref),
                    "max_diff": (g.float() - gr).abs().max().item(), "max_ref": gr.abs().max().item(),
                    "units_kernel": ((g.double() - g64).abs() / unit).max().item(),
                    "units_eager": ((g_ref.double() - g64).abs() / unit).max().item(),
                    "masked_row_max": g[1].float().abs().max().item(), "in_place": g.data_ptr() == logits.data_ptr(),
                    "untouched_tail": bool(torch.equal(base[:, V:], tail))})
print(json.dumps(out))
"""


def test_kernel_equals_eager_cross_entropy():
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    for row in rows:
        assert abs(row["loss"] - row["loss_ref"]) <= 1e-6 * abs(row["loss_ref"]), row
        if row["dtype"] == "torch.float32":
            # each against float64 within fp32 rounding (see `unit`; a few units: exp's, the sum's, lse's roundings)
            assert row["units_kernel"] <= 8 and row["units_eager"] <= 8, row
        else:  # at most one bf16 rounding step of the largest gradient element
            assert row["max_diff"] <= row["max_ref"] * 2**-7, row
        assert row["masked_row_max"] == 0.0, row
        assert row["in_place"] and row["untouched_tail"], row
