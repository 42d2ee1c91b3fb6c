"""GPU equivalence (issue 2): megatrain on CUDA against an in-GPU transformers + torch.optim.AdamW reference.

    python bench/gpu_equivalence.py --json bench/results/gpu_equivalence.json

A ~100M-parameter Llama-shaped model, 20 steps of 4 unequal, right-padded micro-batches:
  bf16: megatrain bf16 (bf16 streamed weights, fp32 master + Adam on the CPU, the overlapped optimizer thread)
        vs transformers with fp32 master weights on the GPU, bf16 autocast, fused GPU AdamW;
  fp32: megatrain fp32 vs transformers fp32 (TF32 off): checks the CUDA stream/slot/landing-buffer path exactly.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table, write_json  # noqa: E402
from megatrain.runtime.engine import Engine, MicroBatch  # noqa: E402
from megatrain.models import get_adapter, load_hf_config  # noqa: E402
from megatrain.runtime.optimizer_pipeline import OptimizerPipeline  # noqa: E402
from megatrain.runtime.adamw import CpuAdamW, clip_coefficient  # noqa: E402
from megatrain.runtime.store import HostStore  # noqa: E402

LR, WD, MAX_NORM, STEPS = 3e-4, 0.1, 1.0, 20


def make_model(path: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def batches(step: int, vocab: int = 32000):
    g = torch.Generator().manual_seed(step)
    out = []
    for T in (512, 384, 256, 448):
        start = torch.randint(1, vocab, (8, 1), generator=g)
        stride = torch.randint(1, 7, (8, 1), generator=g)
        ids = 1 + (start + stride * torch.arange(T)) % (vocab - 1)
        labels = ids.clone()
        for r in range(8):
            real = int(torch.randint(T // 2, T + 1, (1,), generator=g))
            ids[r, real:], labels[r, real:] = 0, -100
        out.append((ids, labels))
    return out


def reference(path: str, precision: str) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").cuda()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                            lr=LR, fused=True)
    losses = []
    for step in range(STEPS):
        bs = batches(step)
        n = sum(int((l[:, 1:] != -100).sum()) for _, l in bs)
        total = 0.0
        for ids, labels in bs:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                out = model(input_ids=ids.cuda(), labels=labels.cuda(), num_items_in_batch=n)
            out.loss.backward()
            total += out.loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    params = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    del model, opt
    torch.cuda.empty_cache()
    return losses, params


def megatrain(path: str, precision: str) -> list[float]:
    adapter = get_adapter(load_hf_config(path))
    store = HostStore(adapter, torch.bfloat16 if precision == "bf16" else torch.float32)
    store.load_safetensors(path)
    store.pin()
    engine = Engine(store, adapter, torch.device("cuda"))
    pipeline = OptimizerPipeline(store, CpuAdamW(weight_decay=WD), torch.device("cuda"))
    engine.wait_for_update = pipeline.wait_for_update
    losses = []
    for step in range(STEPS):
        mbs = [MicroBatch.from_labels(ids, labels) for ids, labels in batches(step)]
        out = engine.train_step(mbs, pipeline)
        norm = math.sqrt(out.grad_sq_norm.item())
        losses.append(out.loss_sum.item())
        pipeline.finish_step(lr=LR, clip_coef=clip_coefficient(norm, MAX_NORM))
    pipeline.drain()
    pipeline.close()
    params = {s.hf_name: v.clone() for t in store.tiles for s, v in zip(t.unit.specs, t.views(t.master).values())}
    store.unpin()
    return losses, params


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    d = tempfile.mkdtemp()
    n_params = make_model(d)
    rows, result = [], {"params": n_params, "steps": STEPS, "lr": LR}
    for precision in ("fp32", "bf16"):
        ref_losses, ref_params = reference(d, precision)
        mt_losses, mt_params = megatrain(d, precision)
        rel = [abs(a - b) / abs(b) for a, b in zip(mt_losses, ref_losses)]
        prel = max(((mt_params[k] - ref_params[k]).norm() / ref_params[k].norm()).item() for k in mt_params)
        row = {"precision": precision, "loss_first": ref_losses[0], "loss_last_ref": ref_losses[-1],
               "loss_last_mt": mt_losses[-1], "max_rel_loss_diff": max(rel), "mean_rel_loss_diff": sum(rel) / len(rel),
               "max_abs_loss_diff": max(abs(a - b) for a, b in zip(mt_losses, ref_losses)),
               "worst_param_rel_diff": prel}
        rows.append(row)
        result[precision] = {**row, "ref_losses": ref_losses, "megatrain_losses": mt_losses}
        print(precision, [f"{a:.4f}/{b:.4f}" for a, b in zip(mt_losses, ref_losses)], flush=True)
    write_json(args.json, {"command": " ".join(sys.argv), "result": result})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
