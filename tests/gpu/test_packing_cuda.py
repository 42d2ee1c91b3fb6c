"""GPU test of packed rows (issue 4): FlexAttention with a document block mask on CUDA.

1. Contamination, fp32: the loss and gradients of a packed row equal the sums over its documents run one by one.
2. Memory at length: one row of 32,768 tokens through a 2-layer model, packed (8 documents) and unpacked (plain
   causal flash attention): packing may add nothing near the T x T boolean mask that must not be built (1 GiB).

    python bench/gpu_packing.py --json OUT.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import table, write_json  # noqa: E402
from megatrain.runtime.engine import CollectGrads, Engine, MicroBatch  # noqa: E402
from megatrain.models import get_adapter, load_hf_config  # noqa: E402
from megatrain.runtime.store import HostStore  # noqa: E402


def model_dir(layers: int, hidden: int) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    d = tempfile.mkdtemp()
    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def engine(d: str, dtype) -> tuple[Engine, HostStore]:
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, dtype)
    store.load_safetensors(d)
    store.pin()
    return Engine(store, adapter, torch.device("cuda")), store


def step(eng: Engine, rows) -> tuple[float, torch.Tensor]:
    sink = CollectGrads()
    out = eng.train_step([MicroBatch.from_labels(i, l, p) for i, l, p in rows], sink)
    n = out.num_targets
    grads = torch.cat([sink.grads[k].cpu() for k in sorted(sink.grads)]) * n  # undo the 1/num_targets
    return out.loss_sum.item() * n, grads


def contamination() -> dict:
    d = model_dir(3, 256)
    eng, store = engine(d, torch.float32)
    g = torch.Generator().manual_seed(1)
    lengths = [37, 150, 5, 64, 200]
    docs = [torch.randint(1, 4096, (n,), generator=g) for n in lengths]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100  # no document predicts the next one
    packed_loss, packed_grads = step(eng, [(ids, labels, pos)])
    sep_loss, sep_grads = 0.0, torch.zeros_like(packed_grads)
    for doc in docs:
        lab = doc[None].clone()
        lab[0, 0] = -100
        l, gr = step(eng, [(doc[None], lab, torch.arange(len(doc))[None])])
        sep_loss, sep_grads = sep_loss + l, sep_grads + gr
    store.unpin()
    rel_loss = abs(packed_loss - sep_loss) / abs(sep_loss)
    rel_grad = ((packed_grads - sep_grads).norm() / sep_grads.norm()).item()
    return {"check": "packed row == its documents one by one (fp32)", "rel_loss_diff": rel_loss,
            "rel_grad_diff": rel_grad, "ok": rel_loss < 1e-5 and rel_grad < 1e-4}


def long_row() -> dict:
    """Peak step memory of one packed row against the same row unpacked (plain causal flash attention): packing
    must add no quadratic term. At 32,768 tokens a T x T boolean mask alone would be 1 GiB."""
    d = model_dir(2, 1024)
    eng, store = engine(d, torch.bfloat16)
    T, n_docs = 32768, 8
    ids = torch.randint(1, 4096, (1, T))
    labels = ids.clone()
    labels[0, ::T // n_docs] = -100
    peaks = {}
    for name, pos in (("unpacked", torch.arange(T)[None]), ("packed", torch.arange(T // n_docs).repeat(n_docs)[None])):
        step(eng, [(ids, labels, pos)])  # compile / warm up
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(eng, [(ids, labels, pos)])
        peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
    store.unpin()
    extra = peaks["packed"] - peaks["unpacked"]
    return {"check": f"one row of {T} tokens, {n_docs} documents", "unpacked_peak_gib": peaks["unpacked"],
            "packed_peak_gib": peaks["packed"], "packing_extra_gib": extra, "txt_mask_gib": T * T / 2**30,
            "ok": extra < 0.25 * T * T / 2**30}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = [contamination(), long_row()]
    write_json(args.json, {"command": " ".join(sys.argv), "result": rows})
    for r in rows:
        print(table([r], list(r)))
    if not all(r["ok"] for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
