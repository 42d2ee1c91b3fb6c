"""Formats -> tokens and labels: golden dumps per format, and which turns carry loss."""

from __future__ import annotations

import json
import os
import re

import pytest
from data_fixtures.helpers import FORMATS, GOLDEN, chat, config, masked_text, tokenizer, trained_texts, write_jsonl

from megatrain.data.examples import build_examples
from megatrain.data.template import IGNORE, EncodeOptions, encode
from megatrain.errors import MegatrainError

FILES = {"text": "text.jsonl", "alpaca": "alpaca.json", "sharegpt": "sharegpt.jsonl", "messages": "messages.jsonl",
         "prompt_completion": "prompt_completion.jsonl"}


def _dump(tok, ex) -> list[dict]:
    out = []
    for k in range(len(ex)):
        ids, labels = ex.get(k)
        out.append({"row": ex.where(k).rsplit("/", 1)[-1], "text": masked_text(tok, ids, labels),
                    "input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


@pytest.mark.parametrize("fmt", list(FILES))
def test_golden_token_label_dump(tmp_path, fmt):
    """Every format, rendered through the tokenizer's chat template, gives exactly the committed ids and labels.
    Regenerate with MEGATRAIN_UPDATE_GOLDEN=1 after an intended change, and read the diff."""
    tok = tokenizer()
    ex = build_examples(config(tmp_path, path=str(FORMATS / FILES[fmt]), format=fmt), tok)
    got = _dump(tok, ex)
    golden = GOLDEN / f"{fmt}.json"
    if os.environ.get("MEGATRAIN_UPDATE_GOLDEN"):
        golden.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    assert got == json.loads(golden.read_text())


def test_chat_tokens_are_what_apply_chat_template_gives(tmp_path):
    """The ids of a conversation are exactly the template's own tokenisation: the model is trained on the token
    sequence it will see at inference."""
    tok = tokenizer()
    ex = build_examples(config(tmp_path, path=str(FORMATS / "messages.jsonl"), format="messages"), tok)
    rows = [json.loads(line) for line in (FORMATS / "messages.jsonl").read_text().splitlines()]
    for k, row in enumerate(rows):
        ids, _ = ex.get(k)
        assert ids.tolist() == list(tok.apply_chat_template(row["messages"], tokenize=True, return_dict=False))


def test_every_assistant_turn_and_only_assistant_turns_carry_labels(tmp_path):
    tok = tokenizer()
    replies = ["I am fine, thank you.", "Waves fold into foam.", "Two plus three is five."]
    row = chat("Hello! How are you?", replies[0], "Write a haiku about the sea.", replies[1], "Add two and three.",
               replies[2], system="You are a helpful assistant.")
    ex = build_examples(config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="messages"), tok)
    ids, labels = ex.get(0)
    # each trained run is one assistant reply with the template's end of turn, nothing else
    assert trained_texts(tok, ids, labels) == [r + "<|im_end|>\n" for r in replies]
    masked = "".join(re.findall(r"\[\[(.*?)\]\]", masked_text(tok, ids, labels), flags=re.S))
    for text in ("You are a helpful assistant.", "Hello! How are you?", "Write a haiku about the sea.",
                 "Add two and three.", "<|im_start|>assistant\n"):
        assert text in masked  # system, user turns and the template's headers carry no loss
    # labels, where set, are the input ids themselves (unshifted)
    assert all(lab in (IGNORE, i) for i, lab in zip(ids.tolist(), labels.tolist()))


def test_mask_history_trains_only_the_last_reply(tmp_path):
    tok = tokenizer()
    row = chat("Name a colour.", "Blue.", "Name another.", "Green.")
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="messages", mask_history=True)
    ids, labels = build_examples(cfg, tok).get(0)
    assert trained_texts(tok, ids, labels) == ["Green.<|im_end|>\n"]


def test_train_on_prompt_labels_every_token_but_the_first(tmp_path):
    tok = tokenizer()
    row = chat("Name a colour.", "Blue.")
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="messages",
                 train_on_prompt=True)
    ids, labels = build_examples(cfg, tok).get(0)
    assert labels[0] == IGNORE and labels[1:].tolist() == ids[1:].tolist()


def test_sharegpt_roles_are_mappable(tmp_path):
    tok = tokenizer()
    row = {"dialog": [{"speaker": "asker", "text": "Name a colour."}, {"speaker": "bot", "text": "Blue."}]}
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="sharegpt",
                 columns={"messages": "dialog", "role": "speaker", "content": "text"},
                 roles={"asker": "user", "bot": "assistant"})
    ids, labels = build_examples(cfg, tok).get(0)
    assert trained_texts(tok, ids, labels) == ["Blue.<|im_end|>\n"]
    assert "<|im_start|>user\nName a colour." in tok.decode(ids.tolist())


def test_alpaca_columns_are_mappable(tmp_path):
    tok = tokenizer()
    row = {"q": "Name a colour.", "a": "Blue."}
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="alpaca",
                 columns={"instruction": "q", "output": "a"})
    ids, labels = build_examples(cfg, tok).get(0)
    assert trained_texts(tok, ids, labels) == ["Blue.<|im_end|>\n"]


def test_eos_is_whatever_the_template_writes(tmp_path):
    """A Llama-2 style template ends replies with the EOS token: it is labelled, as the template wrote it."""
    tok = tokenizer()
    tmpl = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + m['content'] + ' [/INST]' }}"
            "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
    row = chat("Name a colour.", "Blue.", "Name another.", "Green.")
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="messages", chat_template=tmpl)
    from megatrain.data import build_train_loader

    loader = build_train_loader(cfg, tok, seed=0, micro_batch_size=1, grad_accum_steps=1)
    ids, labels = loader.examples.get(0)
    assert trained_texts(tok, ids, labels) == [" Blue.</s>", " Green.</s>"]
    assert tok.chat_template == tmpl  # set on the run's tokenizer, so an export carries it


def test_text_gets_bos_from_the_tokenizer_and_eos_appended(tmp_path):
    tok = tokenizer()
    ids, labels = encode(tok, {"kind": "text", "text": "Blue."}, EncodeOptions())
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert labels[0] == IGNORE and labels[1:] == ids[1:]
    ids2, _ = encode(tok, {"kind": "text", "text": "Blue."}, EncodeOptions(add_eos=False))
    assert ids2 == ids[:-1]


def test_template_that_is_not_prefix_stable_is_an_error(tmp_path):
    """A template that renders earlier turns differently once more follow cannot be masked per turn: say so."""
    tok = tokenizer()
    tmpl = ("{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}{{ '<A>' + m['content'] }}"
            "{% else %}{{ '<' + m['role'] + '>' + m['content'] }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<A>' }}{% endif %}")
    row = chat("Name a colour.", "Blue.", "Name another.", "Green.")
    cfg = config(tmp_path, path=str(write_jsonl(tmp_path / "c.jsonl", [row])), format="messages", chat_template=tmpl)
    from megatrain.data import build_train_loader

    with pytest.raises(MegatrainError, match=r"c.jsonl:1: the chat template is not prefix-stable"):
        build_train_loader(cfg, tok, seed=0, micro_batch_size=1, grad_accum_steps=1)
