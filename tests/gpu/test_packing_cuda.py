"""GPU test of packed rows (issue 4): FlexAttention with a document block mask on CUDA.

    python3 -m pytest -q -m gpu tests/gpu/test_packing_cuda.py     (MEGATRAIN_GPU_RESULTS=DIR: JSON there)

1. Contamination, fp32: the loss and gradients of a packed row equal the sums over its documents run one by one.
2. Memory at length: one row of 32,768 tokens through a 2-layer model, packed (8 documents) and unpacked (plain
   causal flash attention): packing may add nothing near the T x T boolean mask that must not be built (1 GiB).

The runtime is built as the trainer builds it (`build_runtime` on CUDA: slots, streams, the optimizer thread and its
pinned landing buffers). Each step's gradients are read from the optimizer pipeline before the step is handed to
it with lr = 0, which leaves every weight exactly as it was (AdamW's update and decay are both scaled by lr), so
all steps see the same model, as the checks need.
"""

from __future__ import annotations

import pytest
import torch
from gpu_results import write_result

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, HostStore, MicroBatch, Runtime, build_runtime

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def model_dir(path, layers: int, hidden: int) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(path))
    return str(path)


def runtime(d: str, dtype) -> Runtime:
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, dtype)
    store.load_safetensors(d)
    rt = build_runtime(store, "cuda", CpuAdamW())
    assert rt.engine.cuda and rt.pipeline.threaded and rt.pinned.registered_bytes > 0
    return rt


def step(rt: Runtime, rows) -> tuple[float, torch.Tensor]:
    out = rt.engine.train_step([MicroBatch.from_labels(i, l, p) for i, l, p in rows])
    n = out.num_targets
    grads = torch.cat([rt.pipeline.gradient(k).cpu() for k in range(len(rt.store.tiles))]) * n  # undo 1/n
    loss = out.loss_sum.item() * n
    rt.pipeline.finish_step(lr=0.0, clip_coef=1.0)  # the step completes as in training; the weights stay
    return loss, grads


@pytest.fixture(scope="module")
def record():
    """The JSON of bench/gpu_packing.py (one row per check), written at the end."""
    rows = []
    yield rows
    write_result("gpu_packing", __file__, rows)


@pytest.fixture
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def test_packed_row_equals_its_documents_one_by_one(tmp_path, record, no_tf32):
    rt = runtime(model_dir(tmp_path, 3, 256), torch.float32)
    try:
        g = torch.Generator().manual_seed(1)
        lengths = [37, 150, 5, 64, 200]
        docs = [torch.randint(1, 4096, (n,), generator=g) for n in lengths]
        ids = torch.cat(docs)[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = ids.clone()
        labels[0, torch.cumsum(torch.tensor([0] + lengths[:-1]), 0)] = -100  # no document predicts the next one
        packed_loss, packed_grads = step(rt, [(ids, labels, pos)])
        sep_loss, sep_grads = 0.0, torch.zeros_like(packed_grads)
        for doc in docs:
            lab = doc[None].clone()
            lab[0, 0] = -100
            l, gr = step(rt, [(doc[None], lab, torch.arange(len(doc))[None])])
            sep_loss, sep_grads = sep_loss + l, sep_grads + gr
        rt.pipeline.drain()
    finally:
        rt.close()
    rel_loss = abs(packed_loss - sep_loss) / abs(sep_loss)
    rel_grad = ((packed_grads - sep_grads).norm() / sep_grads.norm()).item()
    row = {"check": "packed row == its documents one by one (fp32)", "rel_loss_diff": rel_loss,
           "rel_grad_diff": rel_grad, "ok": rel_loss < 1e-5 and rel_grad < 1e-4}
    record.append(row)
    print(row)
    assert row["ok"], row


def test_packing_adds_no_quadratic_memory(tmp_path, record, no_tf32):
    """Peak step memory of one packed row against the same row unpacked (plain causal flash attention): packing
    must add no quadratic term. At 32,768 tokens a T x T boolean mask alone would be 1 GiB."""
    rt = runtime(model_dir(tmp_path, 2, 1024), torch.bfloat16)
    T, n_docs = 32768, 8
    try:
        ids = torch.randint(1, 4096, (1, T))
        labels = ids.clone()
        labels[0, ::T // n_docs] = -100
        peaks = {}
        for name, pos in (("unpacked", torch.arange(T)[None]),
                          ("packed", torch.arange(T // n_docs).repeat(n_docs)[None])):
            step(rt, [(ids, labels, pos)])  # compile / warm up
            rt.pipeline.drain()  # the last step's gradients are freed once its update is written
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(rt, [(ids, labels, pos)])
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**30
        rt.pipeline.drain()
    finally:
        rt.close()
    extra = peaks["packed"] - peaks["unpacked"]
    row = {"check": f"one row of {T} tokens, {n_docs} documents", "unpacked_peak_gib": peaks["unpacked"],
           "packed_peak_gib": peaks["packed"], "packing_extra_gib": extra, "txt_mask_gib": T * T / 2**30,
           "ok": extra < 0.25 * T * T / 2**30}
    record.append(row)
    print(row)
    assert row["ok"], row
