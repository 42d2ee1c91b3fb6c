"""Packing: rows respect max_seq_len, documents stay apart (positions, labels), and a packed row trains exactly
as its documents would separately."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_model_dir
from data_fixtures.helpers import chat, config, tokenizer, write_jsonl

from megatrain.data import build_train_loader
from megatrain.data.packing import collate, pack_best_fit, pack_greedy
from megatrain.data.template import IGNORE

ROWS = [chat("Hello! How are you?", "I am fine, thank you."),
        chat("Name a colour.", "Blue.", "Name another.", "Green."),
        {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                      {"role": "user", "content": "Add two and three."},
                      {"role": "assistant", "content": "Two plus three is five."}]}]


@pytest.mark.parametrize("pack", [pack_best_fit, pack_greedy])
def test_packers_place_every_document_once_within_capacity(pack):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=500)
    order = rng.permutation(500)
    rows = pack(order, lengths, 128)
    assert sorted(k for r in rows for k in r) == list(range(500))
    assert all(lengths[r].sum() <= 128 for r in rows)


def test_best_fit_packs_tighter_than_greedy():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 1000, size=2000)
    order = rng.permutation(2000)
    best, greedy = pack_best_fit(order, lengths, 1024), pack_greedy(order, lengths, 1024)
    assert len(best) < len(greedy)
    assert lengths.sum() / (len(best) * 1024) > 0.97  # best-fit decreasing leaves almost no room


def test_collate_restarts_positions_and_masks_document_starts_and_padding():
    a = (np.array([1, 10, 11, 12]), np.array([IGNORE, 10, 11, 12]))
    b = (np.array([1, 20, 21]), np.array([IGNORE, IGNORE, 21]))
    c = (np.array([1, 30]), np.array([31, 30]))  # a label at its first token is removed
    batch = collate([[a, b], [c]], pad_id=0)
    assert batch["input_ids"].tolist() == [[1, 10, 11, 12, 1, 20, 21], [1, 30, 0, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]]  # unpacked: continued
    assert collate([[a, b], [c]], pad_id=0, packed=True)["position_ids"].tolist()[1] == [0, 1, 0, 1, 2, 3, 4]
    assert batch["labels"].tolist() == [[IGNORE, 10, 11, 12, IGNORE, IGNORE, 21],
                                        [IGNORE, 30, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert batch["num_real_tokens"].item() == 9 and batch["num_real_tokens"].dim() == 0
    assert all(t.dtype == torch.int64 for t in batch.values())
    padded = collate([[a, b], [c]], pad_id=0, length=9, packed=True)  # packed rows: padded to max_seq_len, whatever they hold
    assert padded["input_ids"][:, :7].tolist() == batch["input_ids"].tolist() and padded["input_ids"].shape[1] == 9
    assert padded["labels"][:, 7:].eq(IGNORE).all() and padded["num_real_tokens"].item() == 9


def test_padding_is_segments_of_at_most_pad_piece_tokens(monkeypatch):
    """A row's padding restarts its positions every PAD_PIECE tokens, so the varlen kernel's segments (and the CPU's
    and FlexAttention's document ids) cut it into pieces of at most PAD_PIECE: attention over padding costs
    PAD_PIECE / 2 a pad token, not the square of the padding joined to the last document."""
    from megatrain.data import packing
    from megatrain.models.varlen import segments

    monkeypatch.setattr(packing, "PAD_PIECE", 4)
    doc = (np.arange(1, 6), np.arange(1, 6))
    batch = collate([[doc], []], pad_id=0, length=15, packed=True)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1],
                                              [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    cu, longest = segments(batch["position_ids"])
    assert cu.tolist() == [0, 5, 9, 13, 15, 19, 23, 27, 30] and longest == 5
    assert packing.pad_work(np.array([10, 0, 4])).tolist() == [4 * 4 + 4 * 4 + 2 * 2, 0, 16]


def test_packed_span_counts_each_segments_work_over_the_rows_tokens(monkeypatch):
    """sampler.packed_span, the span the planner counts a packed row's tokens at: (sum of the documents' squared
    lengths + the padding pieces') / (rows x row length), over every row of every micro-batch of the plan."""
    from megatrain.data import packing
    from megatrain.data.sampler import packed_span

    monkeypatch.setattr(packing, "PAD_PIECE", 4)
    lengths = np.array([3, 5, 2, 10, 7])
    plan = [[[0, 1], [3]], [[2, 4]]]  # rows of 16: 8 + 8 padding, 10 + 6, 9 + 7
    want = (9 + 25 + 2 * 16) + (100 + 16 + 4) + (4 + 49 + 16 + 9)
    assert packed_span(plan, lengths, 16) == pytest.approx(want / (3 * 16))
    assert packed_span([], lengths, 16) == 0.0
    assert packed_span([[[3]]], lengths, 10) == 10.0  # a full row: its length


def test_packed_loader_rows_hold_several_documents_within_max_seq_len(tmp_path):
    tok = tokenizer()
    rows = ROWS * 10
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", rows)), format="messages", packing=True,
                 max_seq_len=256)
    loader = build_train_loader(cfg, tok, seed=0, micro_batch_size=2, grad_accum_steps=3)
    docs = 0
    for mb in loader.next_step():
        assert mb["input_ids"].shape[1] == 256  # packed rows have one length: one compiled shape
        starts_all = (mb["position_ids"] == 0) & mb["attention_mask"].bool()  # (padding restarts too: not a document)
        real = mb["labels"].ne(IGNORE) | starts_all
        docs += int(starts_all.sum())
        for b in range(mb["input_ids"].shape[0]):  # every document starts with BOS and an unlabelled position
            starts = torch.nonzero(starts_all[b]).flatten()
            assert (mb["input_ids"][b, starts] == tok.bos_token_id).all()
            assert (mb["labels"][b, starts] == IGNORE).all()
        assert real.any()
    assert docs > 6  # more documents than rows: they were packed
    assert "packing efficiency" in loader.summary()


def _engine(model_dir):
    from megatrain.runtime.engine import CollectGrads, Engine
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime.store import HostStore

    ad = get_adapter(load_hf_config(model_dir))
    st = HostStore(ad, torch.float32)
    st.load_safetensors(model_dir)
    sink = CollectGrads()
    return Engine(st, ad, torch.device("cpu"), sink), sink


def _run(engine, sink, ids, labels, positions):
    """Sum of token losses and of gradients (the engine divides both by the number of targets)."""
    from megatrain.runtime.engine import MicroBatch

    mb = MicroBatch.from_labels(ids, labels, positions)
    sink.grads.clear()
    out = engine.train_step([mb])
    n = mb.num_targets
    return float(out.loss_sum) * n, {u: g * n for u, g in sink.grads.items()}, n


@pytest.mark.parametrize("family,pad_piece", [("llama", None), ("qwen2", None), ("llama", 16)])
def test_packed_row_loss_and_grads_equal_the_sum_over_its_documents(tmp_path, family, pad_piece, monkeypatch):
    """The contamination test: a row packed by the loader trains exactly as its documents run one by one. If any
    attention crossed a document border, or a document's last token predicted the next one's first, this breaks.
    pad_piece: the padding in many pieces (packing.PAD_PIECE), each a segment of its own."""
    from megatrain.data import packing

    if pad_piece:
        monkeypatch.setattr(packing, "PAD_PIECE", pad_piece)
    tok = tokenizer()
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", ROWS)), format="messages", packing=True,
                 max_seq_len=512)
    batch = build_train_loader(cfg, tok, seed=0, micro_batch_size=1, grad_accum_steps=1).next_step()[0]
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    real = batch["num_real_tokens"].item()
    starts = torch.nonzero(pos[0, :real] == 0).flatten().tolist()
    assert len(starts) == 3 and ids.shape[1] == 512 and real < 512  # one row, three documents, then padding
    assert int((pos[0, real:] == 0).sum()) == -(-(512 - real) // packing.PAD_PIECE)  # the padding's pieces

    d = tmp_path / "model"
    make_model_dir(d, family, layers=2, vocab=len(tok))
    engine, sink = _engine(d)
    packed_loss, packed_grads, packed_n = _run(engine, sink, ids, labels, pos)

    bounds = starts + [real]  # the padding after the last document takes no loss and no real token sees it
    loss_sum, grads_sum, n_sum = 0.0, None, 0
    for s, e in zip(bounds[:-1], bounds[1:]):
        loss, grads, n = _run(engine, sink, ids[:, s:e], labels[:, s:e], pos[:, s:e])
        assert (pos[0, s:e] == torch.arange(e - s)).all()
        loss_sum, n_sum = loss_sum + loss, n_sum + n
        grads_sum = grads if grads_sum is None else {u: grads_sum[u] + g for u, g in grads.items()}
    assert packed_n == n_sum
    assert packed_loss == pytest.approx(loss_sum, rel=1e-5)
    for u, g in packed_grads.items():
        torch.testing.assert_close(g, grads_sum[u], rtol=1e-4, atol=1e-5)

    # the test has teeth: the same row without document boundaries (attention across documents) differs
    leaky_loss, _, _ = _run(engine, sink, ids, labels, torch.arange(ids.shape[1])[None])
    assert abs(leaky_loss - loss_sum) > 1e-3 * abs(loss_sum)


def test_a_steps_attention_span_is_its_documents():
    """PreparedStep.attn_len, what MFU counts attention over: sum(d²)/sum(d) over a packed step's documents (the
    padding after them not counted), the row's length for full plain rows."""
    from megatrain.run.prefetch import PreparedStep, prepare_step

    doc = lambda n: (np.arange(1, n + 1), np.arange(1, n + 1))  # noqa: E731
    packed = [collate([[doc(3), doc(5)], [doc(4)]], pad_id=0, length=10, packed=True)]
    step = PreparedStep(packed, prepare_step(packed, pin=False), {})
    assert step.attn_len == pytest.approx((9 + 25 + 16) / (3 + 5 + 4))
    plain = [collate([[doc(6)], [doc(6)]], pad_id=0)]
    assert PreparedStep(plain, prepare_step(plain, pin=False), {}).attn_len == 6
