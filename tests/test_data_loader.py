"""The loader as the trainer sees it: batch layout, over-long examples, the evaluation set, summary and preview."""

from __future__ import annotations

import numpy as np
import torch
from data_fixtures.helpers import FORMATS, chat, config, tokenizer, write_jsonl

from megatrain.data import build_eval_batches, build_train_loader, preview
from megatrain.data.template import IGNORE

WORDS = "the quick brown fox jumps over the lazy dog".split()


def _texts(n: int, seed: int = 0, longest: int = 12) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"text": f"{i} " + " ".join(rng.choice(WORDS, size=int(rng.integers(1, longest))))} for i in range(n)]


def test_batches_have_the_documented_layout(tmp_path):
    tok = tokenizer()
    path = write_jsonl(tmp_path / "t.jsonl", _texts(10))
    loader = build_train_loader(config(tmp_path, path=str(path)), tok, seed=0, micro_batch_size=3,
                                grad_accum_steps=2)
    step = loader.next_step()
    assert len(step) == 2
    for b in step:
        assert set(b) == {"input_ids", "labels", "position_ids", "attention_mask", "num_real_tokens"}
        assert all(v.dtype == torch.int64 and v.device.type == "cpu" for v in b.values())
        B, T = b["input_ids"].shape
        assert B == 3 and b["labels"].shape == b["position_ids"].shape == (B, T)
        pad = b["input_ids"] == tok.pad_token_id
        assert (b["labels"][pad] == IGNORE).all()  # padding never carries loss ...
        assert b["num_real_tokens"].item() == int((~pad).sum())  # ... and is not counted as tokens
        assert torch.equal(b["attention_mask"], (~pad).long())  # ... and is masked out of router statistics
        for r in range(B):  # right padding, one document per row without packing
            n = int((~pad[r]).sum())
            assert not pad[r, :n].any() and pad[r, n:].all()
            assert (b["position_ids"][r] == torch.arange(T)).all()


def test_overlong_examples_are_truncated_dropped_or_split_and_counted(tmp_path):
    tok = tokenizer()
    rows = _texts(6, longest=4) + [{"text": "the quick brown fox jumps over the lazy dog " * 4}]
    path = str(write_jsonl(tmp_path / "t.jsonl", rows))

    def build(**kw):
        return build_train_loader(config(tmp_path, path=path, max_seq_len=16, **kw), tok, seed=0,
                                  micro_batch_size=1, grad_accum_steps=1)

    trunc, drop, split = build(), build(overlong="drop"), build(overlong="split")
    assert trunc.examples.counts.truncated == 1 and len(trunc.examples) == 7
    assert trunc.examples.lengths.max() == 16
    assert drop.examples.counts.dropped == 1 and len(drop.examples) == 6
    assert split.examples.counts.split == 1 and len(split.examples) > 7 and split.examples.lengths.max() == 16
    long_ids = np.concatenate([split.examples.get(k)[0] for k in range(6, len(split.examples))])
    assert len(long_ids) == len(tok(rows[-1]["text"])["input_ids"]) + 1  # the pieces are the document, all of it
    assert "1 truncated, 0 dropped" in trunc.summary() and "0 truncated, 1 dropped" in drop.summary()


def test_eval_fraction_holds_out_a_fixed_disjoint_share(tmp_path):
    tok = tokenizer()
    path = str(write_jsonl(tmp_path / "t.jsonl", _texts(40)))
    cfg = config(tmp_path, path=path, eval_fraction=0.25)

    def first_words(batches):
        return sorted(tok.decode(row[1:3].tolist()).split()[0] for b in batches for row in b["input_ids"])

    eval_batches = build_eval_batches(cfg, tok, micro_batch_size=4)
    held = first_words(eval_batches)
    assert len(held) == 10
    loader = build_train_loader(cfg, tok, seed=5, micro_batch_size=5, grad_accum_steps=6)
    trained = first_words(loader.next_step())
    assert len(trained) == 30 and not set(held) & set(trained)
    assert sorted(held + trained, key=int) == [str(i) for i in range(40)]
    assert first_words(build_eval_batches(cfg, tok, micro_batch_size=3)) == held  # fixed, whatever the batch
    assert "10 held out for evaluation" in loader.summary()


def test_eval_file_and_no_eval(tmp_path):
    tok = tokenizer()
    train = str(write_jsonl(tmp_path / "t.jsonl", _texts(8)))
    ev = str(write_jsonl(tmp_path / "e.jsonl", _texts(5, seed=1)))
    assert build_eval_batches(config(tmp_path, path=train), tok, micro_batch_size=2) is None
    batches = build_eval_batches(config(tmp_path, path=train, eval_path=ev), tok, micro_batch_size=2)
    assert sum(b["input_ids"].shape[0] for b in batches) == 5
    packed = build_eval_batches(config(tmp_path, path=train, eval_path=ev, packing=True, max_seq_len=64), tok,
                                micro_batch_size=2)
    starts = sum(int(((b["position_ids"] == 0) & b["attention_mask"].bool()).sum()) for b in packed)
    assert starts == 5  # every example once, packed (a padding piece restarts its positions too: not an example)


def test_eval_data_reports_its_counts(tmp_path):
    """Held-out rows skipped, truncated or dropped are said, as training rows are."""
    tok = tokenizer()
    train = str(write_jsonl(tmp_path / "t.jsonl", _texts(8)))
    ev = write_jsonl(tmp_path / "e.jsonl", _texts(3, seed=1) + [{"text": "word " * 200}])
    ev.write_text(ev.read_text() + "{not json\n")
    batches = build_eval_batches(config(tmp_path, path=train, eval_path=str(ev), skip_bad_rows=True,
                                        max_seq_len=32), tok, micro_batch_size=2)
    assert "examples: 4 from 1 source" in batches.summary
    assert "1 bad rows skipped" in batches.summary and "e.jsonl:5" in batches.summary
    assert "2 truncated" in batches.summary  # the long row and one of the three


def test_summary_reports_counts_tokens_and_efficiency(tmp_path):
    tok = tokenizer()
    a = write_jsonl(tmp_path / "a.jsonl", _texts(12))
    b = write_jsonl(tmp_path / "b.jsonl", [chat("Name a colour.", "Blue.")] * 3)
    cfg = config(tmp_path, datasets=[{"path": str(a)}, {"path": str(b), "format": "messages", "weight": 2}],
                 packing=True, max_seq_len=128)
    s = build_train_loader(cfg, tok, seed=0, micro_batch_size=2, grad_accum_steps=1).summary()
    assert "examples: 15 from 2 sources [a.jsonl (text): 12, b.jsonl (messages): 3 -> 6/epoch]" in s
    assert "tokens: " in s and "with loss" in s and "packing efficiency: " in s
    assert "0 truncated, 0 dropped" in s and "0 bad rows skipped" in s


def test_preview_shows_tokens_beside_labels_and_statistics(tmp_path):
    tok = tokenizer()
    cfg = config(tmp_path, path=str(FORMATS / "alpaca.json"), format="alpaca", max_seq_len=128)
    out = preview(cfg, tok, 2)
    assert "example 1 of 3: " in out and "example 2 of 3: " in out and "example 3 of 3" not in out
    assert "\u27e6<s><|im_start|>system\n" in out  # the prompt is visibly masked in the text view
    lines = out.splitlines()
    masked = [ln for ln in lines if ln.endswith("masked")]
    trained = [ln for ln in lines if ln.endswith("loss")]
    assert any("'<|im_start|>'" in ln for ln in masked) and any("'<|im_end|>'" in ln for ln in trained)
    assert "--- statistics" in out and "examples: 3" in out and "length min" in out
    assert "packing (best_fit, if data.packing were true)" in out
