"""Preference pairs -> tokens: every layout (strings, message lists with a system message and several turns, the
implicit prompt, LLaMA-Factory ranking entries), the completion mask token by token against the template's own
rendering, truncation order and counts, and bad rows with their one-line errors or skipped and counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_fixtures.helpers import config, tokenizer, trained_texts, write_jsonl

from megatrain.data import build_pair_loader, build_train_loader, is_preference, preview, validate_inputs
from megatrain.data.preference_examples import build_pairs
from megatrain.data.template import IGNORE
from megatrain.errors import MegatrainError

SYSTEM = "Be brief."
TURNS = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "Name a colour."}]


def _msg(role, content):
    return {"role": role, "content": content}


def _pairs(tmp_path, rows, name="p.jsonl", tok=None, **kw):
    path = write_jsonl(tmp_path / name, rows)
    kw.setdefault("format", "preference")
    return build_pairs(config(tmp_path, path=str(path), **kw), tok or tokenizer())


def _expected_side(tok, prompt: list[dict], completion: list[dict]):
    """ids and labels of one side written out from the template's own rendering: each assistant reply of the
    completion spans the characters between the render before it (with the generation prompt) and the render
    with it; a token of the rendered whole that overlaps such a span carries its id as label."""
    msgs = prompt + completion
    render = lambda m, gen=False: tok.apply_chat_template(m, tokenize=False, add_generation_prompt=gen)  # noqa: E731
    spans = [(len(render(msgs[:i], True)), len(render(msgs[: i + 1])))
             for i in range(len(prompt), len(msgs)) if msgs[i]["role"] == "assistant"]
    enc = tok(render(msgs), add_special_tokens=False, return_offsets_mapping=True)
    labels = [i if any(s < b and e > a for a, b in spans) else IGNORE
              for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])]
    labels[0] = IGNORE
    return enc["input_ids"], labels


def test_completion_mask_token_by_token_against_the_template(tmp_path):
    tok = tokenizer()
    prompt = [_msg("system", SYSTEM)] + TURNS
    chosen = [_msg("assistant", "Blue.")]
    rejected = [_msg("assistant", "Green."), _msg("user", "Another?"), _msg("assistant", "Red.")]
    pairs = _pairs(tmp_path, [{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
    (c_ids, c_lab), (r_ids, r_lab) = pairs.get(0)
    for (ids, lab), completion in (((c_ids, c_lab), chosen), ((r_ids, r_lab), rejected)):
        want_ids, want_labels = _expected_side(tok, prompt, completion)
        assert ids.tolist() == want_ids and lab.tolist() == want_labels
    assert trained_texts(tok, c_ids, c_lab) == ["Blue.<|im_end|>\n"]
    assert trained_texts(tok, r_ids, r_lab) == ["Green.<|im_end|>\n", "Red.<|im_end|>\n"]  # not the user turn
    assert tok.decode(c_ids).startswith(f"<s><|im_start|>system\n{SYSTEM}")  # the row's system message, kept


def _reference(tmp_path, prompt, chosen="Blue.", rejected="Green."):
    """The pair written as explicit message lists: what every other layout must give."""
    row = {"prompt": prompt, "chosen": [_msg("assistant", chosen)], "rejected": [_msg("assistant", rejected)]}
    return _pairs(tmp_path, [row], name="ref.jsonl").get(0)


def _same(a, b):
    return all(np.array_equal(x, y) for sa, sb in zip(a, b) for x, y in zip(sa, sb))


def test_every_layout_gives_the_tokens_of_the_explicit_messages(tmp_path):
    turns = [_msg("system", SYSTEM)] + TURNS
    want = _reference(tmp_path, turns)
    strings = _pairs(tmp_path, [{"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Green."}],
                     name="s.jsonl").get(0)
    assert _same(strings, _reference(tmp_path, [_msg("user", "Name a colour.")]))
    system_column = _pairs(tmp_path, [{"prompt": TURNS, "system": SYSTEM, "chosen": _msg("assistant", "Blue."),
                                       "rejected": "Green."}], name="sc.jsonl").get(0)
    assert _same(system_column, want)
    implicit = {"chosen": turns + [_msg("assistant", "Blue.")], "rejected": turns + [_msg("assistant", "Green.")]}
    assert _same(_pairs(tmp_path, [implicit], name="i.jsonl").get(0), want)  # TRL's implicit prompt
    assert _same(_pairs(tmp_path, [{**implicit, "prompt": "Name a colour."}], name="u.jsonl").get(0), want)
    remapped = {"q": TURNS, "good": "Blue.", "bad": "Green.", "sys": SYSTEM}
    got = _pairs(tmp_path, [remapped], name="r.jsonl", columns={"prompt": "q", "chosen": "good", "rejected": "bad",
                                                                "system": "sys"}).get(0)
    assert _same(got, want)


def _registry(tmp_path, entries: dict, files: dict) -> str:
    for name, rows in files.items():
        (tmp_path / name).write_text(json.dumps(rows))
    (tmp_path / "dataset_info.json").write_text(json.dumps(entries))
    return str(tmp_path)


def test_llama_factory_ranking_entries_alpaca_and_sharegpt(tmp_path):
    turns = [_msg("system", SYSTEM), _msg("user", "Hello!"), _msg("assistant", "Hi."),
             _msg("user", "Name a colour.\nOne word.")]
    want = _reference(tmp_path, turns)
    alpaca = [{"instruction": "Name a colour.", "input": "One word.", "chosen": "Blue.", "rejected": "Green.",
               "history": [["Hello!", "Hi."]], "sys": SYSTEM}]
    sharegpt = [{"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "Hi."},
                                   {"from": "human", "value": "Name a colour.\nOne word."}],
                 "system": SYSTEM, "chosen": {"from": "gpt", "value": "Blue."},
                 "rejected": {"from": "gpt", "value": "Green."}}]
    tagged = [{"turns": [{"who": "me", "text": t["content"]} if t["role"] == "user" else {"who": "it", "text": t[
        "content"]} for t in TURNS], "system": SYSTEM, "c": {"who": "it", "text": "Blue."},
               "r": {"who": "it", "text": "Green."}}]
    tagged[0]["turns"][-1]["text"] = "Name a colour.\nOne word."
    reg = _registry(tmp_path, {
        "dpo_alpaca": {"file_name": "a.json", "ranking": True, "columns": {
            "prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
            "history": "history", "system": "sys"}},
        "dpo_sharegpt": {"file_name": "s.json", "ranking": True, "formatting": "sharegpt", "columns": {
            "messages": "conversations", "chosen": "chosen", "rejected": "rejected", "system": "system"}},
        "dpo_tagged": {"file_name": "t.json", "ranking": True, "formatting": "sharegpt",
                       "columns": {"messages": "turns", "chosen": "c", "rejected": "r", "system": "system"},
                       "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "me", "assistant_tag": "it"}},
        "sft": {"file_name": "a.json"}}, {"a.json": alpaca, "s.json": sharegpt, "t.json": tagged})
    for name in ("dpo_alpaca", "dpo_sharegpt", "dpo_tagged"):
        cfg = config(tmp_path, dataset_info=reg, datasets=[name])
        assert is_preference(cfg)  # data.format is left at its default: the registry says it
        assert _same(build_pairs(cfg, tokenizer()).get(0), want), name
    sft = config(tmp_path, dataset_info=reg, datasets=["sft"])
    assert not is_preference(sft) and not is_preference(config(tmp_path, path="x.jsonl"))
    with pytest.raises(MegatrainError, match=r"data.datasets\[1\]: format 'alpaca' is not preference data"):
        build_pairs(config(tmp_path, dataset_info=reg, datasets=["dpo_alpaca", "sft"]), tokenizer())
    with pytest.raises(MegatrainError, match="data.packing: preference pairs are not packed"):
        validate_inputs(config(tmp_path, dataset_info=reg, datasets=["dpo_sharegpt"], packing=True))


def test_plain_concatenation_without_a_chat_template(tmp_path):
    tok = tokenizer()
    tok.chat_template = None
    (c_ids, c_lab), (r_ids, r_lab) = _pairs(tmp_path, [{"prompt": "Two plus three is", "chosen": " five.",
                                                        "rejected": " six."}], tok=tok).get(0)
    whole = tok("Two plus three is five.")["input_ids"] + [tok.eos_token_id]
    assert c_ids.tolist() == whole
    assert trained_texts(tok, c_ids, c_lab) == [" five.</s>"] and trained_texts(tok, r_ids, r_lab) == [" six.</s>"]
    with pytest.raises(MegatrainError, match=r"p.jsonl:1: message lists, a system prompt or history are rendered "
                                             r"with the chat template, but the tokenizer has none"):
        _pairs(tmp_path, [{"prompt": [_msg("user", "Hi")], "chosen": "a", "rejected": "b"}], tok=tok)


def _long_rows():
    long_prompt = "Once upon a time there was a small model that learned to talk. " * 6
    return [{"prompt": long_prompt, "chosen": "Blue.", "rejected": "Green, said the model."},
            {"prompt": "Name a colour.", "chosen": "Blue. " * 30, "rejected": "Green."},
            {"prompt": "Hello!", "chosen": "Hi.", "rejected": "Hello."}]


def test_overlong_pairs_cut_the_prompt_left_first_then_the_completion_end_and_count_it(tmp_path):
    S = 48
    whole = _pairs(tmp_path, _long_rows(), name="w.jsonl", max_seq_len=4096)
    cut = _pairs(tmp_path, _long_rows(), name="c.jsonl", max_seq_len=S)
    c = cut.counts
    assert (c.truncated, c.prompt_cut, c.completion_cut, c.dropped) == (2, 2, 1, 0)
    for k in range(3):
        sides_w, sides_c = whole.get(k), cut.get(k)
        assert all(len(ids) <= S for ids, _ in sides_c)
        if k == 2:  # short: untouched
            assert _same(sides_w, sides_c)
            continue
        starts = []
        for (wi, wl), (ci, cl) in zip(sides_w, sides_c):
            p = int(np.flatnonzero(wl != IGNORE)[0])  # the whole side's prompt length
            q = int(np.flatnonzero(cl != IGNORE)[0])  # prompt tokens kept
            assert 1 <= q < p and np.array_equal(ci[:q], wi[p - q: p])  # the prompt's end kept, its start cut
            n = len(ci) - q
            assert np.array_equal(ci[q:], wi[p: p + n]) and np.array_equal(cl[q:], wl[p: p + n])
            starts.append((p - q, q, len(wi) - p))
        (_, qc, nc), (_, qr, nr) = starts
        assert qc == qr  # both sides keep the same end of the prompt
        if k == 0:  # the prompt is cut just enough for the longer completion, which stays whole
            assert qc == S - max(nc, nr) and all(len(ids) - q == n for (ids, _), (_, q, n) in zip(sides_c, starts))
        else:  # a completion longer than S: one prompt token left, then the completion cut at its end
            assert qc == 1 and len(sides_c[0][0]) == S and len(sides_c[1][0]) == 1 + nr
    summary = build_pair_loader(config(tmp_path, path=str(tmp_path / "c.jsonl"), format="preference",
                                       max_seq_len=S), tokenizer(), seed=0, micro_batch_size=1,
                                grad_accum_steps=1).summary()
    assert (f"over-long pairs (a side > max_seq_len={S}): 2 truncated (2 with the prompt cut from its left, 1 with a "
            f"completion cut at its end), 0 dropped") in summary
    assert f"tokens: {c.tokens:,} ({c.targets:,} with loss" in summary
    assert c.tokens == sum(len(ids) for k in range(3) for ids, _ in cut.get(k))
    assert c.targets == sum(int((lab[1:] != IGNORE).sum()) for k in range(3) for _, lab in cut.get(k))
    drop = _pairs(tmp_path, _long_rows(), name="d.jsonl", max_seq_len=S, overlong="drop")
    assert len(drop) == 1 and drop.counts.dropped == 2 and _same(drop.get(0), whole.get(2))


def test_a_huge_prompt_is_tokenised_only_as_far_as_truncation_keeps(tmp_path):
    rows = [{"prompt": "the quick brown fox " * 6000, "chosen": "Blue.", "rejected": "Green."}]
    pairs = _pairs(tmp_path, rows, max_seq_len=64)
    assert pairs.counts.cut == 1 and pairs.counts.prompt_cut == 1
    (ids, lab), _ = pairs.get(0)
    tok = tokenizer()
    assert len(ids) == 64 and tok.decode(ids).endswith("the quick brown fox <|im_end|>\n<|im_start|>assistant\n"
                                                       "Blue.<|im_end|>\n")


BAD_ROWS = [
    ({"prompt": "Hi", "rejected": "b"}, r"missing column 'chosen' needed by format 'preference'"),
    ({"chosen": "a", "rejected": "b"}, r"missing column 'prompt' needed by format 'preference'"),
    ({"prompt": "Hi", "chosen": "Blue.", "rejected": "Blue."}, r"chosen and rejected are identical"),
    ({"prompt": "Hi", "chosen": [_msg("assistant", "x")], "rejected": "x"}, r"chosen and rejected are identical"),
    ({"prompt": "Hi", "chosen": "  ", "rejected": "b"}, r"empty completion \(column 'chosen'\)"),
    ({"prompt": "Hi", "chosen": "a", "rejected": [_msg("assistant", "")]}, r"empty completion \(column 'rejected'\)"),
    ({"prompt": "Hi", "chosen": 3, "rejected": "b"},
     r"column 'chosen' must be a string, a message or a list of messages, got int"),
    ({"prompt": 5, "chosen": "a", "rejected": "b"}, r"column 'prompt' must be a string or a list of messages"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, r"empty prompt \(column 'prompt'\)"),
    ({"prompt": [], "chosen": "a", "rejected": "b"}, r"empty prompt \(column 'prompt'\)"),
    ({"prompt": [_msg("user", "Hi")], "chosen": [_msg("user", "a")], "rejected": "b"},
     r"column 'chosen': the completion has no assistant message"),
    ({"prompt": "Hi", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"},
     r"column 'chosen': unknown role 'bot' in message 1"),
    ({"prompt": [{"role": "user", "content": 3}], "chosen": "a", "rejected": "b"},
     r"column 'prompt': message 1: content must be a string"),
    (["a", "b"], r"expected an object with the columns of format 'preference', got list"),
]
GOOD = {"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Green."}


@pytest.mark.parametrize("bad, message", BAD_ROWS, ids=range(len(BAD_ROWS)))
def test_bad_row_one_line_naming_file_and_row(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "p.jsonl", [GOOD, GOOD, bad])
    with pytest.raises(MegatrainError) as e:
        build_pair_loader(config(tmp_path, path=str(path), format="preference"), tokenizer(), seed=0,
                          micro_batch_size=1, grad_accum_steps=1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}:3: ") and "skip_bad_rows" in msg
    assert __import__("re").search(message, msg), msg


def test_bad_rows_skipped_and_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r, _ in BAD_ROWS[:5]) + "{not json\n" + json.dumps(GOOD) + "\n"
                    + json.dumps({**GOOD, "chosen": "Red."}) + "\n")
    loader = build_pair_loader(config(tmp_path, path=str(path), format="preference", skip_bad_rows=True),
                               tokenizer(), seed=0, micro_batch_size=2, grad_accum_steps=1)
    assert len(loader.examples) == 2 and loader.examples.counts.bad == 6 and loader.examples.counts.rows == 8
    s = loader.summary()
    assert "rows: 8 read, 6 bad rows skipped" in s and f"  skipped: {path}:1: missing column 'chosen'" in s
    assert sorted(loader.next_step()[0]["pair_ids"].tolist()) == [0, 1]
    assert [loader.examples.where(k) for k in range(2)] == [f"{path}:7", f"{path}:8"]


def test_config_errors_and_the_wrong_loader(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", [GOOD]))
    for kw, message in (({"packing": True}, "data.packing: preference pairs are not packed"),
                        ({"train_on_prompt": True}, "data.train_on_prompt: preference pairs carry loss on their "
                                                    "completions only")):
        with pytest.raises(ValueError, match=message):
            config(tmp_path, path=path, format="preference", **kw)
    with pytest.raises(MegatrainError, match=r"data.path: preference pairs \(format 'preference'\) train with a "
                                             r"preference objective"):
        build_train_loader(config(tmp_path, path=path, format="preference"), tokenizer(), seed=0,
                           micro_batch_size=1, grad_accum_steps=1)
    sft = str(write_jsonl(tmp_path / "t.jsonl", [{"text": "hello"}]))
    with pytest.raises(MegatrainError, match="data.path: format 'text' is not preference data"):
        build_pair_loader(config(tmp_path, path=sft), tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)
    with pytest.raises(MegatrainError, match=r"data.eval_datasets\[0\]: format 'text' is not preference data "
                                             r"\(data.datasets\[0\] is\)"):
        validate_inputs(config(tmp_path, datasets=[{"path": path, "format": "preference"}],
                               eval_datasets=[{"path": sft, "format": "text"}]))
    bad = str(write_jsonl(tmp_path / "b.jsonl", [{**GOOD, "rejected": GOOD["chosen"]}] * 2))
    with pytest.raises(MegatrainError, match="data: no usable training example: 2 rows read, 2 bad"):
        build_pair_loader(config(tmp_path, path=bad, format="preference", skip_bad_rows=True), tokenizer(), seed=0,
                          micro_batch_size=1, grad_accum_steps=1)


def test_preview_shows_both_sides_of_a_pair_with_the_prompt_masked(tmp_path):
    path = str(write_jsonl(tmp_path / "p.jsonl", [GOOD]))
    out = preview(config(tmp_path, path=path, format="preference"), tokenizer(), 1)
    assert f"--- chosen of pair 1 of 1: {path}:1 (preference)" in out
    assert f"--- rejected of pair 1 of 1: {path}:1 (preference)" in out
    assert "⟧Blue.<|im_end|>" in out and "⟧Green.<|im_end|>" in out and "pairs: 1 from 1 source" in out
