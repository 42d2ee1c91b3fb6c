"""Long context on CPU: an 8,192-token sequence equals transformers + torch AdamW at 1e-5 with the MLP tiled, a long
packed row equals its documents run one by one, and the data pipeline tokenises, packs and previews a 512k-token
document."""

import time
import tracemalloc

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir
from data_fixtures.helpers import config, tokenizer
from megatrain.data import build_train_loader, preview
from megatrain.data.template import IGNORE
from megatrain.runtime import Placement
from reference import Megatrain, reference_optimizer, reference_step, rel

TOL = 1e-5


def long_batch(T: int, vocab: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (1, T), generator=g)
    labels = ids.clone()
    labels[0, :37] = -100  # a masked prompt
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones(1, T, dtype=torch.long)}


@pytest.mark.parametrize("family,rope", [
    ("llama", None),  # tiny_hf_config's llama3 scaling (original context 32): every position beyond it is scaled
    ("qwen2", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024, "rope_theta": 1e4}),
], ids=["llama3-rope", "qwen2-yarn"])
def test_an_8k_sequence_trains_like_transformers(tmp_path, family, rope):
    """One 8,192-token row per step, 2 steps, the layer over tiles of 1,024 tokens and checkpoints every 2 layers:
    loss, every gradient and every updated weight within 1e-5 of transformers (SDPA) + torch AdamW."""
    model = make_model_dir(tmp_path, family, seed=7, layers=2)
    if rope is not None:  # the same weights under another rope scaling
        model.config.rope_parameters = rope
        model.config.max_position_embeddings = 8192
        model.save_pretrained(tmp_path, safe_serialization=True)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    if rope is not None:
        assert ref.config.rope_parameters["rope_type"] == "yarn"
    two_long_steps_like_transformers(ref, Megatrain(tmp_path, placement=Placement(seq_tile=1024, checkpoint_every=2)))


def two_long_steps_like_transformers(ref, mt: Megatrain) -> None:
    """Two steps of one 8,192-token row each: loss, every gradient and every updated weight of `mt` within TOL of
    the transformers model `ref` + torch AdamW."""
    opt = reference_optimizer(ref)
    for step in range(2):
        batches = [long_batch(8192, 97, seed=step)]
        ref_loss, ref_grads = reference_step(ref, opt, batches)
        loss, grads = mt.step(batches)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), step
        for name, g in grads.items():
            assert rel(g, ref_grads[name]) <= TOL, (step, name, rel(g, ref_grads[name]))
    ref_params = dict(ref.named_parameters())
    for name, p in mt.params().items():
        assert rel(p, ref_params[name].detach()) <= TOL, f"updated {name}"
    mt.close()


def test_a_long_packed_row_equals_its_documents(tmp_path):
    """A 3,000-token row packing documents of 1,100, 1,400 and 500 tokens (positions restart, each document's first
    label -100, as data/packing.py writes them) against the same documents as three micro-batches of one step: the
    same loss and gradients, up to the order of the sums over tokens (1e-6), with the MLP tiled by 256 tokens over
    the packed row. Attention that crossed a document boundary would be off by far more."""
    make_model_dir(tmp_path, "qwen3", tied=True, seed=9, layers=2)
    g = torch.Generator().manual_seed(4)
    lengths = [1100, 1400, 500]
    docs = [torch.randint(3, 97, (n,), generator=g) for n in lengths]
    labels = [d.clone() for d in docs]
    for lab in labels:
        lab[0] = -100
    packed = {"input_ids": torch.cat(docs)[None], "labels": torch.cat(labels)[None],
              "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    alone = [{"input_ids": d[None], "labels": lab[None]} for d, lab in zip(docs, labels)]

    def run(batches, placement):
        from megatrain.runtime import MicroBatch

        mt = Megatrain(tmp_path, placement=placement)
        mbs = [MicroBatch.from_labels(b["input_ids"], b["labels"], b.get("position_ids")) for b in batches]
        out = mt.engine.train_step(mbs)
        grads = {s.hf_name: g.clone() for i, t in enumerate(mt.store.tiles)
                 for s, g in zip(t.unit.specs, t.views(mt.pipeline.gradient(i)).values())}
        mt.close()
        return out.loss_sum.item(), out.num_targets, grads

    loss_p, n_p, grads_p = run([packed], Placement(seq_tile=256))
    loss_a, n_a, grads_a = run(alone, Placement())
    assert n_p == n_a == sum(lengths) - 3
    assert abs(loss_p - loss_a) <= 1e-6 * loss_a
    for name, ga in grads_a.items():
        assert rel(grads_p[name], ga) <= 1e-6, (name, rel(grads_p[name], ga))
    # the same row read as one document (attention across the boundaries) is another model's loss
    crossing = {"input_ids": packed["input_ids"], "labels": packed["labels"]}
    loss_x, _, _ = run([crossing], Placement(seq_tile=256))
    assert abs(loss_x - loss_a) > 1e-4 * loss_a


DOC_TOKENS = 524_288


def test_a_512k_token_document_is_tokenised_packed_and_previewed(tmp_path):
    """A text file whose first row is one document of ~520k tokens (the tiny BPE tokenizer of the data tests), and
    a few short ones, at data.max_seq_len 524288 with packing: the long document starts a row, token for token what
    the tokenizer makes of it; building a step allocates a few int64 copies of that row and nothing per token in
    Python (the tokens stay in the memory-mapped Arrow file); `megatrain data --preview` shows its first and last
    tokens and says how many it leaves out."""
    tok = tokenizer()
    words = np.random.default_rng(0).choice("the quick brown fox jumps over lazy dog cat sat on mat".split(),
                                            size=250_000)
    text = " ".join(words.tolist())
    n_long = len(tok(text)["input_ids"]) + 1  # + EOS (data.add_eos)
    assert 500_000 < n_long <= DOC_TOKENS
    short = [f"{i} the cat sat on the mat" for i in range(5)]
    path = tmp_path / "long.jsonl"
    import json

    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in [text] + short))
    cfg = config(tmp_path, path=str(path), max_seq_len=DOC_TOKENS, packing=True)
    t0 = time.time()
    loader = build_train_loader(cfg, tok, seed=0, micro_batch_size=1, grad_accum_steps=1)
    tracemalloc.start()
    rows = [loader.next_step()[0] for _ in range(2)]  # an epoch holds one or two rows
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert time.time() - t0 < 120
    long_row = next(b for b in rows if b["input_ids"].shape[1] >= n_long)  # best fit: the short ones may join it
    assert long_row["input_ids"].shape[1] <= DOC_TOKENS  # padded to the batch's longest row, at most max_seq_len
    expected = tok(text)["input_ids"] + [tok.eos_token_id]
    ids, labels = long_row["input_ids"][0, :n_long], long_row["labels"][0, :n_long]
    assert ids.tolist() == expected
    assert torch.equal(long_row["position_ids"][0, :n_long], torch.arange(n_long))
    assert labels[0] == IGNORE and (labels[1:] == ids[1:]).all()
    # Python-side allocations of two steps: the row's two columns read from Arrow and made int64, the batches' four
    # int64 arrays (measured 88 B/token); no Python object per token (a list of ints alone is 36 B/token)
    assert peak < 100 * n_long, peak

    out = preview(cfg, tok, 1)
    lines = out.splitlines()
    assert len(lines) < 1000
    assert f"-- {n_long} tokens, {n_long - 1} with loss" in out
    assert f"{n_long - 512:,} tokens, {n_long - 512:,} with loss) ..." in out
    assert lines[-1].startswith("packing (best_fit): ")
    last = [ln for ln in lines if ln.strip().startswith(str(n_long - 1) + " ")]
    assert last and last[0].endswith("loss")  # the last token's row of the table


# ---- the planner at length (H200 probe, CUDA defaults: compiled layers, no memory keys) -------------------------
PLAN_HOST_GIB = 125  # what the H100 and H200 machines have free


def long_plan(name: str, seq: int, gpu_gib: float | None = None, compile: bool = True, clipping: bool = True):
    from pathlib import Path

    from transformers import AutoConfig

    from megatrain.models import get_adapter
    from megatrain.planner import Workload, make_plan
    from megatrain.planner.placement import FREE_ALL
    from megatrain.planner.profile import GiB, load_profile

    root = Path(__file__).resolve().parents[1]
    prof = load_profile(root / "bench" / "results" / "probe-h200" / "profile.json")
    adapter = get_adapter(AutoConfig.from_pretrained(root / "bench" / "model-configs" / name))
    return make_plan(adapter, Workload((1,), seq, compile=compile, clipping=clipping), prof, suggest=False,
                     gpu_limit=gpu_gib * GiB if gpu_gib else float(prof.gpu_total_bytes),
                     host_available=PLAN_HOST_GIB * GiB, choose_keys=FREE_ALL)


def test_qwen_7b_fits_an_h200_from_32k_to_512k_tokens():
    """Qwen2.5-7B, one sequence per step (bench/plan_long_context.py prints the table;
    bench/results/qwen2.5-7b-long-context-h200-cli, the runs): every length tiles the layer (memory.seq_tile: at
    32k-128k to
    make room for the layers that keep their attention, from 256k on because the whole layer does not fit) and keeps
    some layers' attention for the backward (memory.reuse_attention); 512k also runs the attention's backward over
    blocks (memory.attn_block: at SDPA's speed since it calls cuDNN's kernels) or rebuilds K-blocks; 512k within
    the issue's 600 s."""
    from megatrain.planner.profile import GiB

    steps = {}
    for seq in (32768, 65536, 131072, 262144, 524288):
        p = long_plan("qwen2.5-7b", seq)
        assert p.fits, (seq, p.problems)
        assert p.host_total <= PLAN_HOST_GIB * GiB and p.gpu_needed <= 139.8 * GiB
        assert p.placement.seq_tile > 0 and p.placement.reuse_attention > 0, (seq, p.placement_keys)
        bounded = p.placement.checkpoint_every > 1 or p.placement.attn_block > 0  # K-blocks or blocked attention
        assert bounded == (seq >= 524288), (seq, p.placement_keys)
        steps[seq] = p.step_s
    assert steps[524288] <= 600, steps
    assert all(steps[a] < steps[b] for a, b in zip(sorted(steps), sorted(steps)[1:]))


def test_llama_8b_at_128k_on_an_h200():
    p = long_plan("llama-3.1-8b", 131072)
    assert p.fits and p.step_s <= 45, (p.problems, p.step_s)


def test_llama_8b_longest_runs_fit_with_the_attention_backward_in_blocks():
    """Llama-3.1-8B with 125 GiB of host RAM. At 512k on an 80 GB H100 a layer boundary is 4 GiB and the fused
    attention backward of the tiled layer 36 GiB: nothing fits until the attention's backward runs over blocks
    (memory.attn_block: 14 GiB less); then blocks of layers and spilled inputs fit it, clipping on. At 1M on the H200
    the same fits without clipping (no gradient waits for the norm); with it only by sending gradients to host (at
    the margin of GPU and host: 139.6 of 139.8 GiB, 124 of 125) or not at all: the plan says which and how long a
    step takes."""
    from megatrain.planner.profile import GiB

    p = long_plan("llama-3.1-8b", 524288, 78.0)
    assert p.fits, p.problems
    assert p.placement.attn_block == 65536 and p.placement.seq_tile == 8192, p.placement_keys
    assert p.gpu_needed <= 78.0 * GiB and p.host_total <= PLAN_HOST_GIB * GiB
    assert "with the attention's backward over blocks of 65536 tokens" in p.why
    clipped = long_plan("llama-3.1-8b", 1048576)  # the gradients waiting for the norm: to host, or no fit
    assert (clipped.fits and clipped.placement.grads_to_host > 0) or (not clipped.fits and clipped.problems)
    free = long_plan("llama-3.1-8b", 1048576, clipping=False)
    assert free.fits and free.placement.attn_block == 65536, free.problems
    assert 2400 < free.step_s < 4800, free.step_s  # stated: ~3,240 s a step (5,250 with the flash op's kernels)


@pytest.mark.parametrize("model,layers,sizes,seq,placement", [
    ("llama-3.1-8b", 3, [1], 32768, Placement(seq_tile=8192)),
    ("qwen2.5-7b", 4, [2, 1], 8192, Placement(seq_tile=4096, checkpoint_every=2)),
    ("qwen2.5-7b", 5, [1], 65536, Placement(seq_tile=8192, checkpoint_every=3, spill_layers=3, grads_to_host=2)),
], ids=str)
def test_tiled_gpu_phases_match_the_engine(model, layers, sizes, seq, placement):
    """The planner's GPU peak of a tiled run against the real Engine on the meta device (test_plan's check)."""
    from test_plan import adapter_of, engine_peak_on_meta

    from megatrain.planner import Workload
    from megatrain.planner.memory import gpu_phases

    adapter = adapter_of(model, layers)
    real = engine_peak_on_meta(adapter, sizes, seq, placement=placement)
    w = Workload(tuple(sizes), seq, device="cpu", placement=placement)
    predicted = max(sum(c.values()) for _, c in gpu_phases(adapter, adapter.units(), w, []))
    assert abs(predicted - real) <= 0.03 * real, (predicted / 2**30, real / 2**30)
