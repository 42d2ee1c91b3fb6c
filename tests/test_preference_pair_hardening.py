"""Pairs that would train something other than what the data says are refused or dropped, and counted: chosen and
rejected conditioned on different prompts (a row error), a pair cut to identical sides by max_seq_len (dropped, its
own summary line), sides the chat template renders alike (a row error); over-long pairs keep the same prompt end on
both sides, each completion cut only as far as its own side needs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from data_fixtures.helpers import config, tokenizer, write_jsonl

from megatrain.data import build_pair_loader
from megatrain.data.preference_examples import build_pairs
from megatrain.data.template import IGNORE
from megatrain.errors import MegatrainError

GOOD = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Green."}
DIFFERENT = r"chosen and rejected have different prompts"


def _msg(role, content):
    return {"role": role, "content": content}


def _loader(tmp_path, rows, name="p.jsonl", tok=None, **kw):
    path = write_jsonl(tmp_path / name, rows)
    cfg = config(tmp_path, path=str(path), format="preference", **kw)
    return build_pair_loader(cfg, tok or tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)


def _pairs(tmp_path, rows, name="p.jsonl", tok=None, **kw):
    path = write_jsonl(tmp_path / name, rows)
    return build_pairs(config(tmp_path, path=str(path), format="preference", **kw), tok or tokenizer())


def _same(a, b):
    return all(np.array_equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def _prompt_len(labels) -> int:
    return int(np.flatnonzero(labels != IGNORE)[0])


DIFFERENT_PROMPTS = [
    # a string prompt beside message lists whose user turns differ (/tmp/redteam-pref d/diff_prompts_str.jsonl)
    {"prompt": "reverse ab", "chosen": [_msg("user", "reverse ab"), _msg("assistant", "ba")],
     "rejected": [_msg("user", "say hi"), _msg("assistant", "hi")]},
    # only the chosen side carries a user turn (d/diff_prompts_short.jsonl)
    {"prompt": "reverse ab", "chosen": [_msg("user", "reverse xyz please"), _msg("assistant", "ba")],
     "rejected": [_msg("assistant", "ab")]},
    # no prompt column: nothing shared, the sides start with different user turns
    {"chosen": [_msg("user", "reverse ab"), _msg("assistant", "ba")],
     "rejected": [_msg("user", "say hi"), _msg("assistant", "hi")]},
    # an explicit message-list prompt, then a user turn on one side only
    {"prompt": [_msg("user", "reverse ab")], "chosen": [_msg("user", "something else"), _msg("assistant", "ba")],
     "rejected": [_msg("assistant", "ab")]},
    # an explicit message-list prompt, then different user turns on each side
    {"prompt": [_msg("user", "reverse ab")], "chosen": [_msg("user", "one"), _msg("assistant", "ba")],
     "rejected": [_msg("user", "two"), _msg("assistant", "ab")]},
    # the implicit prompt (the longest common prefix) ends on a shared reply; the next user turns differ
    {"chosen": [_msg("user", "Hi"), _msg("assistant", "Hello."), _msg("user", "Name a colour."),
                _msg("assistant", "Blue.")],
     "rejected": [_msg("user", "Hi"), _msg("assistant", "Hello."), _msg("user", "Name a fruit."),
                  _msg("assistant", "Apple.")]},
    # a message list on one side, a string (the assistant reply) on the other
    {"prompt": "reverse ab", "chosen": [_msg("user", "reverse ab"), _msg("assistant", "ba")], "rejected": "ab"},
    # a system message before one side's reply only
    {"prompt": [_msg("user", "reverse ab")], "chosen": [_msg("system", "Be rude."), _msg("assistant", "no")],
     "rejected": [_msg("assistant", "ba")]},
]


@pytest.mark.parametrize("bad", DIFFERENT_PROMPTS, ids=range(len(DIFFERENT_PROMPTS)))
def test_sides_with_different_prompts_are_a_row_error(tmp_path, bad):
    path = tmp_path / "p.jsonl"
    with pytest.raises(MegatrainError) as e:
        _loader(tmp_path, [GOOD, GOOD, bad])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}:3: ") and "skip_bad_rows" in msg
    assert re.search(DIFFERENT, msg), msg


def test_different_prompts_skipped_and_counted(tmp_path):
    rows = DIFFERENT_PROMPTS + [GOOD]
    loader = _loader(tmp_path, rows, skip_bad_rows=True)
    path = tmp_path / "p.jsonl"
    assert len(loader.examples) == 1 and loader.examples.counts.bad == len(DIFFERENT_PROMPTS)
    s = loader.summary()
    assert f"rows: {len(rows)} read, {len(DIFFERENT_PROMPTS)} bad rows skipped" in s
    assert f"  skipped: {path}:1: chosen and rejected have different prompts" in s
    assert loader.examples.where(0) == f"{path}:{len(rows)}"


def test_shared_prompts_in_every_layout_are_still_pairs(tmp_path):
    turns = [_msg("user", "Hi"), _msg("assistant", "Hello."), _msg("user", "Name a colour.")]
    want = _pairs(tmp_path, [{"prompt": turns, "chosen": [_msg("assistant", "Blue.")],
                              "rejected": [_msg("assistant", "Green.")]}], name="ref.jsonl").get(0)
    layouts = {
        # the implicit prompt, multi-turn (TRL's longest common prefix)
        "implicit": {"chosen": turns + [_msg("assistant", "Blue.")], "rejected": turns + [_msg("assistant", "Green.")]},
        # ultrafeedback_binarized: a string prompt beside full conversations
        "ultrafeedback": {"prompt": "Name a colour.", "chosen": turns + [_msg("assistant", "Blue.")],
                          "rejected": turns + [_msg("assistant", "Green.")]},
        # an explicit prompt continued by the same turns on both sides
        "continued": {"prompt": turns[:2], "chosen": turns[2:] + [_msg("assistant", "Blue.")],
                      "rejected": turns[2:] + [_msg("assistant", "Green.")]},
    }
    for name, row in layouts.items():
        assert _same(_pairs(tmp_path, [row], name=f"{name}.jsonl").get(0), want), name
    # a string prompt beside replies that start with the assistant: the string is the user turn
    got = _pairs(tmp_path, [{"prompt": "Name a colour.", "chosen": [_msg("assistant", "Blue.")],
                             "rejected": [_msg("assistant", "Green.")]}], name="s.jsonl").get(0)
    assert _same(got, _pairs(tmp_path, [GOOD], name="g.jsonl").get(0))


def test_overlong_pair_keeps_the_same_prompt_and_cuts_each_completion_only_as_far_as_it_needs(tmp_path):
    S = 48
    prompt = "Once upon a time there was a small model. " * 2
    rows = [{"prompt": prompt, "chosen": "Blue.", "rejected": "Green, said the model, green as grass."},
            {"prompt": prompt, "chosen": "Red.", "rejected": "Green " * 20}]
    whole = _pairs(tmp_path, rows, name="w.jsonl", max_seq_len=4096)
    cut = _pairs(tmp_path, rows, name="c.jsonl", max_seq_len=S)
    for k in range(2):
        (wc, wcl), (wr, wrl) = whole.get(k)
        (cc, ccl), (cr, crl) = cut.get(k)
        pc, pr, qc, qr = _prompt_len(wcl), _prompt_len(wrl), _prompt_len(ccl), _prompt_len(crl)
        assert pc == pr and np.array_equal(wc[:pc], wr[:pr])  # the same prompt on both sides
        assert qc == qr and np.array_equal(cc[:qc], cr[:qr])  # cut identically: the same prompt tokens kept
        assert np.array_equal(cc[:qc], wc[pc - qc: pc])  # its end
        assert np.array_equal(cc[qc:], wc[pc:])  # the short chosen completion whole
        n_r = len(wr) - pr
        if k == 0:  # the prompt cut just enough for the longer completion, which stays whole
            assert len(cr) == S and qr == S - n_r and np.array_equal(cr[qr:], wr[pr:])
        else:  # one prompt token left, then the long completion cut at its end only as far as its side needs
            assert qr == 1 and len(cr) == S and np.array_equal(cr[1:], wr[pr: pr + S - 1])
            assert len(cc) == 1 + len(wc) - pc
    assert (cut.counts.truncated, cut.counts.prompt_cut, cut.counts.completion_cut) == (2, 2, 1)


SAME_AFTER_CUT = {"prompt": "reverse ab", "chosen": "b" * 40 + "a", "rejected": "b" * 40 + "c"}


def test_pairs_identical_after_truncation_are_dropped_and_counted(tmp_path):
    S = 32
    rows = [SAME_AFTER_CUT, GOOD, SAME_AFTER_CUT, {**SAME_AFTER_CUT, "rejected": "c" + "b" * 40}]
    loader = _loader(tmp_path, rows, max_seq_len=S)
    pairs, path = loader.examples, tmp_path / "p.jsonl"
    assert len(pairs) == 2 and pairs.counts.identical_cut == 2 and pairs.counts.examples == 2
    assert [pairs.where(k) for k in range(2)] == [f"{path}:2", f"{path}:4"]
    (c, _), (r, _) = pairs.get(1)
    assert not np.array_equal(c, r)  # differs within max_seq_len: kept, truncated
    c = pairs.counts  # the dropped pairs are not among the trained pairs' cuts
    assert (c.truncated, c.prompt_cut, c.completion_cut) == (2, 2, 1)
    assert pairs.counts.tokens == sum(len(ids) for k in range(2) for ids, _ in pairs.get(k))
    assert pairs.counts.targets == sum(int((lab != IGNORE).sum()) for k in range(2) for _, lab in pairs.get(k))
    s = loader.summary()
    assert f"pairs identical after truncation to max_seq_len={S}: 2 dropped" in s
    assert sorted(loader.next_step()[0]["pair_ids"].tolist() + loader.next_step()[0]["pair_ids"].tolist()) == [0, 1]
    assert "identical after truncation" not in _loader(tmp_path, [GOOD], name="g.jsonl", max_seq_len=S).summary()


def test_nothing_left_but_pairs_identical_after_truncation_says_so(tmp_path):
    with pytest.raises(MegatrainError, match=r"no usable training example: 3 rows read.*3 pairs identical after "
                                             r"truncation to max_seq_len=32"):
        _loader(tmp_path, [SAME_AFTER_CUT] * 3, max_seq_len=32)
    assert len(_pairs(tmp_path, [SAME_AFTER_CUT] * 3, name="l.jsonl", max_seq_len=64)) == 3  # long enough: kept


def test_sides_the_template_renders_alike_are_a_row_error(tmp_path):
    tok = tokenizer()
    tok.chat_template = tok.chat_template.replace("m['content']", "m['content'] | trim")
    rows = [GOOD, {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Blue.  "}]
    with pytest.raises(MegatrainError, match=r"p.jsonl:2: chosen and rejected give the same tokens"):
        _loader(tmp_path, rows, tok=tok)
    loader = _loader(tmp_path, rows, tok=tok, skip_bad_rows=True, name="s.jsonl")
    assert len(loader.examples) == 1 and loader.examples.counts.bad == 1
