"""Tokenizers whose own settings change what a row trains on: a post-processor that appends EOS (Llama's
add_eos_token), split_special_tokens; and conversations that open with an assistant turn."""

from __future__ import annotations

import json
import shutil

import pytest

from data_fixtures.helpers import TOKENIZER, config, write_jsonl
from megatrain.data import load_tokenizer
from megatrain.data.examples import build_examples
from megatrain.data.formats import RowError
from megatrain.data.preference_examples import build_pairs
from megatrain.data.prompts import build_prompts
from megatrain.data.template import IGNORE, EncodeOptions, encode
from megatrain.data.tokenizer import tokenizer_fingerprint


def eos_appending(tmp_path):
    """The fixture tokenizer with a post-processor writing `<s> $A </s>` (no chat template): plain text gets BOS
    and EOS from the tokenizer itself, as with Llama's add_eos_token."""
    d = tmp_path / "tok-eos"
    shutil.copytree(TOKENIZER, d)
    spec = json.loads((d / "tokenizer.json").read_text())
    bos, eos = spec["post_processor"]["single"][0]["SpecialToken"]["id"], "</s>"
    eos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == eos)
    spec["post_processor"]["single"].append({"SpecialToken": {"id": eos, "type_id": 0}})
    spec["post_processor"]["special_tokens"][eos] = {"id": eos, "ids": [eos_id], "tokens": [eos]}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = load_tokenizer(d)
    tok.chat_template = None
    assert tok("Five.")["input_ids"][-1] == tok.eos_token_id == eos_id and bos == tok.bos_token
    return tok


def test_completion_ends_in_a_trained_eos_when_the_tokenizer_appends_it(tmp_path):
    tok = eos_appending(tmp_path)
    data = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "Add two and three.", "completion": " Five."}])
    for train_on_prompt in (False, True):
        ex = build_examples(config(tmp_path, path=str(data), format="prompt_completion",
                                   train_on_prompt=train_on_prompt), tok, "train")
        ids, labels = (x.tolist() for x in ex.get(0))
        assert ids.count(tok.eos_token_id) == 1 and ids[-1] == tok.eos_token_id
        assert labels[-1] == tok.eos_token_id  # the reply's end is learnt
        assert labels[0] == IGNORE


def test_preference_sides_end_in_a_trained_eos_when_the_tokenizer_appends_it(tmp_path):
    tok = eos_appending(tmp_path)
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Add two and three.", "chosen": " Five.",
                                              "rejected": " Six."}])
    pairs = build_pairs(config(tmp_path, path=str(data), format="preference"), tok)
    for ids, labels in pairs.get(0):
        ids, labels = ids.tolist(), labels.tolist()
        assert ids.count(tok.eos_token_id) == 1 and labels[-1] == tok.eos_token_id


def test_a_plain_prompt_does_not_end_in_the_eos_the_tokenizer_appends(tmp_path):
    tok = eos_appending(tmp_path)
    data = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "Add two and three.", "answer": "5"},
                                             {"prompt": "Say </s>", "answer": "ok"}])
    prompts = build_prompts(config(tmp_path, path=str(data), format="prompt"), tok)
    first, second = (list(prompts.get(k).ids) for k in (0, 1))
    assert first[0] == tok.bos_token_id and tok.eos_token_id not in first  # sampling starts after the prompt
    assert first == tok("Add two and three.")["input_ids"][:-1]
    assert second[-1] == tok.eos_token_id  # an EOS the prompt itself writes stays


def test_split_special_tokens_is_part_of_the_cache_key():
    a = load_tokenizer(TOKENIZER)
    b = load_tokenizer(TOKENIZER)
    b.split_special_tokens = True
    b._tokenizer.encode_special_tokens = True
    assert a("<s>x")["input_ids"] != b("<s>x")["input_ids"]
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(b)


def test_a_conversation_opening_with_a_trained_assistant_turn_is_refused_by_its_cause():
    tok = load_tokenizer(TOKENIZER)
    msgs = [{"role": "assistant", "content": "Hello first."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Reply."}]
    with pytest.raises(RowError, match="opens with an assistant turn"):
        encode(tok, {"kind": "chat", "messages": msgs, "tools": None, "loss_from": 0}, EncodeOptions())
    # untrained (history masked, or before loss_from), it is context: the later reply alone is learnt
    for sample, opts in (({"kind": "chat", "messages": msgs, "tools": None, "loss_from": 0},
                          EncodeOptions(mask_history=True)),
                         ({"kind": "chat", "messages": msgs, "tools": None, "loss_from": 1}, EncodeOptions())):
        ids, labels = encode(tok, sample, opts)
        trained = tok.decode([t for t in labels if t != IGNORE])
        assert "Reply." in trained and "Hello first." not in trained
        assert "Hello first." in tok.decode(ids)
