"""The pair loader as the trainer sees it: batch layout (rows interleaved chosen, rejected; pair ids), the seeded
order grouped by length, exact resume mid-epoch, rank shares, evaluation and every-pair batches, the cache."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_fixtures.helpers import config, tokenizer, write_jsonl

import megatrain.data.preference_examples as pref_examples
from megatrain.data import (all_pair_batches, build_pair_eval_batches, build_pair_loader, build_train_loader,
                            pair_fingerprint)
from megatrain.data.preference_examples import build_pairs
from megatrain.data.template import IGNORE
from megatrain.errors import MegatrainError

WORDS = "the quick brown fox jumps over the lazy dog".split()


def _rows(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(rng.choice(WORDS, size=int(rng.integers(1, k))))

    return [{"prompt": f"{i} {words(12)}", "chosen": f"yes {words(8)}", "rejected": f"no {words(8)}"}
            for i in range(n)]


def _cfg(tmp_path, n=23, **kw):
    path = tmp_path / "p.jsonl"
    if not path.exists():
        write_jsonl(path, _rows(n))
    return config(tmp_path, path=str(path), format="preference", **kw)


def _loader(tmp_path, seed=0, P=2, G=2, rank=0, world=1, **kw):
    return build_pair_loader(_cfg(tmp_path, **kw), tokenizer(), seed=seed, micro_batch_size=P, grad_accum_steps=G,
                             rank=rank, world=world)


def _ids(step) -> list[list[int]]:
    return [b["pair_ids"].tolist() for b in step]


def test_batches_interleave_chosen_and_rejected_of_each_pair(tmp_path):
    loader = _loader(tmp_path, P=3, G=2)
    pairs, pad = loader.examples, tokenizer().pad_token_id
    step = loader.next_step()
    assert len(step) == 2
    for b in step:
        assert {"input_ids", "labels", "attention_mask", "pair_ids"} <= set(b)
        P = len(b["pair_ids"])
        assert P == 3 and b["input_ids"].shape[0] == 2 * P and b["pair_ids"].dtype == torch.int64
        assert all(v.dtype == torch.int64 for v in b.values())
        T = b["input_ids"].shape[1]
        for i, k in enumerate(b["pair_ids"].tolist()):
            for j, (ids, labels) in enumerate(pairs.get(k)):  # row 2i: chosen, 2i + 1: rejected
                r, n = 2 * i + j, len(ids)
                assert b["input_ids"][r, :n].tolist() == ids.tolist()
                assert b["labels"][r, :n].tolist() == labels.tolist()
                assert (b["input_ids"][r, n:] == pad).all() and (b["labels"][r, n:] == IGNORE).all()
                assert b["attention_mask"][r].tolist() == [1] * n + [0] * (T - n)
                assert (b["position_ids"][r] == torch.arange(T)).all()  # one sequence per row, never packed
        assert T == max(len(ids) for k in b["pair_ids"].tolist() for ids, _ in pairs.get(k))


def test_order_is_seeded_covers_every_pair_each_epoch_and_groups_by_length(tmp_path):
    n, P = 23, 2
    a, b, c = _loader(tmp_path, seed=1, P=P, G=1), _loader(tmp_path, seed=1, P=P, G=1), _loader(tmp_path, seed=2,
                                                                                                P=P, G=1)
    per_epoch = -(-n // P)
    ea = [_ids(a.next_step())[0] for _ in range(per_epoch)]
    assert ea == [_ids(b.next_step())[0] for _ in range(per_epoch)]
    assert ea != [_ids(c.next_step())[0] for _ in range(per_epoch)]
    assert sorted(k for mb in ea for k in mb) == list(range(n)) and a.epoch == 0
    e2 = [_ids(a.next_step())[0] for _ in range(per_epoch)]
    assert a.epoch == 1 and sorted(k for mb in e2 for k in mb) == list(range(n)) and e2 != ea
    lengths = a.examples.lengths

    def padded(plan):
        return sum(len(mb) * lengths[[k for row in mb for k in row]].max() for mb in plan)

    ungrouped = _loader(tmp_path, seed=1, P=4, G=1, group_by_length=False).sampler.plan
    grouped = _loader(tmp_path, seed=1, P=4, G=1).sampler.plan
    assert padded(grouped) < padded(ungrouped)
    assert grouped[0] and lengths[grouped[0][0][0]] == lengths.max()  # the longest pairs come first


def test_resume_mid_epoch_is_exact(tmp_path):
    run = _loader(tmp_path, seed=3, P=2, G=3)
    for _ in range(2):
        run.next_step()
    state = run.state_dict()
    assert state["pairs"] and state["cursor"] == 6
    resumed = _loader(tmp_path, seed=3, P=2, G=3)
    resumed.load_state_dict(state)
    for _ in range(5):  # across the epoch boundary (12 micro-batches an epoch)
        want, got = run.next_step(), resumed.next_step()
        assert _ids(got) == _ids(want)
        assert all(torch.equal(w[k], g[k]) for w, g in zip(want, got) for k in w)
    assert resumed.epoch == run.epoch == 1
    with pytest.raises(MegatrainError, match="micro_batch_size was 2 in the checkpoint and is 3 now"):
        _loader(tmp_path, seed=3, P=3, G=2).load_state_dict(state)
    sft = write_jsonl(tmp_path / "t.jsonl", [{"text": "a b c"}] * 4)
    sft_state = build_train_loader(config(tmp_path, path=str(sft)), tokenizer(), seed=0, micro_batch_size=1,
                                   grad_accum_steps=1).state_dict()
    with pytest.raises(MegatrainError, match="data order is of SFT examples"):
        _loader(tmp_path).load_state_dict(sft_state)


def test_rank_shares_are_disjoint_and_together_what_one_process_reads(tmp_path):
    whole = _loader(tmp_path, seed=4, P=2, G=4)
    ranks = [_loader(tmp_path, seed=4, P=2, G=2, rank=r, world=2) for r in range(2)]
    for _ in range(4):
        want = _ids(whole.next_step())
        shares = [_ids(r.next_step()) for r in ranks]
        assert shares[0] + shares[1] == want
        flat = [set(k for mb in s for k in mb) for s in shares]
        assert not flat[0] & flat[1]
    state = ranks[0].state_dict()
    assert state == {**ranks[1].state_dict(), "world_size": 2} and state["cursor"] == whole.state_dict()["cursor"]


def test_eval_and_every_pair_batches(tmp_path):
    cfg = _cfg(tmp_path, n=30, eval_fraction=0.2)
    tok = tokenizer()
    train = build_pair_loader(cfg, tok, seed=0, micro_batch_size=4, grad_accum_steps=1)
    evb = build_pair_eval_batches(cfg, tok, micro_batch_size=4)
    held = build_pairs(cfg, tok, "eval")
    assert sorted(k for b in evb for k in b["pair_ids"].tolist()) == list(range(len(held))) == list(range(6))
    assert len(train.examples) == 24 and "6 held out for evaluation" in train.summary()
    assert evb.summary.startswith("pairs: 6 from 1 source")  # the held-out set's own counts, said at the start

    def prompts(pairs):
        return {tok.decode(pairs.get(k)[0][0]).split("user\n")[1].split()[0] for k in range(len(pairs))}

    assert not prompts(held) & prompts(train.examples)
    assert prompts(held) | prompts(train.examples) == {str(i) for i in range(30)}
    every = all_pair_batches(cfg, tok, micro_batch_size=7)
    assert len(every) == 4 and [len(b["pair_ids"]) for b in every] == [7, 7, 7, 3]
    assert torch.cat([b["pair_ids"] for b in every]).tolist() == list(range(24))  # pair id order
    for b in every[-1:]:
        for i, k in enumerate(b["pair_ids"].tolist()):
            ids = train.examples.get(k)[1][0]
            assert b["input_ids"][2 * i + 1, :len(ids)].tolist() == ids.tolist()
    assert [b["pair_ids"].tolist() for b in all_pair_batches(cfg, tok, micro_batch_size=7, side="eval")] == \
        [list(range(6))]
    assert build_pair_eval_batches(_cfg(tmp_path), tok, micro_batch_size=2) is None
    assert all_pair_batches(_cfg(tmp_path), tok, micro_batch_size=2, side="eval") is None


def test_tokenised_once_then_read_from_the_cache_and_fingerprinted(tmp_path, monkeypatch):
    calls = []
    real = pref_examples.encode_pair_row

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(pref_examples, "encode_pair_row", counting)

    def build(**kw):
        calls.clear()
        loader = _loader(tmp_path, **kw)
        return len(calls), loader.fingerprint()

    n, fp = build()
    assert n > 0
    assert build() == (0, fp)  # the same inputs: read from the cache, nothing tokenised, the same pair ids
    assert pair_fingerprint(_cfg(tmp_path), tokenizer()) == fp
    n, fp_short = build(max_seq_len=20)
    assert n == 0 and fp_short != fp  # cut after the cache: no tokenising, but other tokens
    n, fp_hist = build(mask_history=True)
    assert n > 0 and fp_hist == fp  # tokenised again, to the same tokens (no history to mask): the same pairs
    tmpl = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}" \
           "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    assert build(chat_template=tmpl)[0] > 0


def test_processes_tokenise_the_same_pairs(tmp_path):
    one = _loader(tmp_path, n=23).examples
    two = build_pairs(_cfg(tmp_path, num_proc=2, cache_dir=str(tmp_path / "cache2")), tokenizer())
    assert len(one) == len(two) == 23
    assert all(np.array_equal(a, b) for k in range(23) for sa, sb in zip(one.get(k), two.get(k))
               for a, b in zip(sa, sb))


def test_the_fingerprint_follows_the_tokens_not_the_files(tmp_path):
    """The reference log-probs are keyed by it: the same pairs from a copied (or touched) file keep it; a pair
    whose tokens change does not."""
    import shutil

    fp = _loader(tmp_path).fingerprint()
    copy = tmp_path / "copy" / "p.jsonl"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "p.jsonl", copy)
    same = build_pair_loader(config(tmp_path, path=str(copy), format="preference"), tokenizer(), seed=0,
                             micro_batch_size=2, grad_accum_steps=2)
    assert same.fingerprint() == fp
    rows = [json.loads(x) for x in copy.read_text().splitlines()]
    rows[3]["chosen"] = rows[3]["chosen"] + " more"
    write_jsonl(copy, rows)
    changed = build_pair_loader(config(tmp_path, path=str(copy), format="preference"), tokenizer(), seed=0,
                                micro_batch_size=2, grad_accum_steps=2)
    assert changed.fingerprint() != fp
