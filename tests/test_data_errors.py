"""Bad input: one-line MegatrainErrors that name the file, the row and what is wrong; or, with
data.skip_bad_rows, rows skipped and counted; and nothing usable left is an error before training starts."""

from __future__ import annotations

import json

import pytest
from data_fixtures.helpers import chat, config, tokenizer, write_jsonl

from megatrain.data import build_eval_batches, build_train_loader, load_tokenizer, preview, validate_inputs
from megatrain.errors import MegatrainError


def _error(cfg, tok=None) -> str:
    with pytest.raises(MegatrainError) as e:
        build_train_loader(cfg, tok or tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def _file(tmp_path, lines: list[str], name="d.jsonl"):
    f = tmp_path / name
    f.write_text("\n".join(lines) + "\n")
    return str(f)


GOOD = json.dumps(chat("Name a colour.", "Blue."))


@pytest.mark.parametrize("bad, message", [
    ('{"messages": [', r"d.jsonl:3: malformed JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]}),
     r"d.jsonl:3: unknown role 'bot' in message 2 .*map it with data.roles"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  "}]}),
     r"d.jsonl:3: empty assistant turn \(message 2\)"),
    (json.dumps({"conversation": []}), r"d.jsonl:3: missing column 'messages' needed by format 'messages'"),
    (json.dumps({"messages": [{"role": "user", "content": "Hi"}]}), r"d.jsonl:3: the conversation has no assistant"),
    (json.dumps({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}),
     r"d.jsonl:3: message 1: content must be a string"),
    ('[1, 2]', r"d.jsonl:3: expected an object with the columns of format 'messages', got list"),
])
def test_bad_row_names_file_line_and_problem(tmp_path, bad, message):
    path = _file(tmp_path, [GOOD, "", bad, GOOD])  # line 2 is blank: row numbers are line numbers
    msg = _error(config(tmp_path, path=path, format="messages"))
    assert msg.startswith(str(tmp_path)) and "skip_bad_rows" in msg
    assert __import__("re").search(message, msg), msg


def test_missing_alpaca_column_names_the_mapped_column(tmp_path):
    path = _file(tmp_path, [json.dumps({"q": "Name a colour.", "answer": "Blue."})])
    msg = _error(config(tmp_path, path=path, format="alpaca", columns={"instruction": "q"}))
    assert "d.jsonl:1: missing column 'output' needed by format 'alpaca'" in msg


def test_malformed_json_array_names_its_line(tmp_path):
    path = _file(tmp_path, ["[", GOOD + ",", GOOD + ",,", "]"], name="d.json")
    assert "d.json:3: malformed JSON" in _error(config(tmp_path, path=path, format="messages"))


def test_skip_bad_rows_skips_and_counts(tmp_path):
    bad_role = json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "x"}]})
    path = _file(tmp_path, [GOOD, "{oops", GOOD, bad_role, GOOD])
    cfg = config(tmp_path, path=path, format="messages", skip_bad_rows=True)
    loader = build_train_loader(cfg, tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)
    assert len(loader.examples) == 3 and loader.examples.counts.bad == 2
    summary = loader.summary()
    assert "2 bad rows skipped" in summary
    assert "d.jsonl:2: malformed JSON" in summary and "d.jsonl:4: unknown role 'bot'" in summary


def test_nothing_left_after_filtering_is_an_error(tmp_path):
    path = _file(tmp_path, [GOOD, GOOD])
    msg = _error(config(tmp_path, path=path, format="messages", max_seq_len=8, overlong="drop"))
    assert msg.startswith("data: no usable training example: 2 rows read") and "2 dropped" in msg
    # truncation that cuts every reply away leaves nothing to learn either
    msg = _error(config(tmp_path, path=path, format="messages", max_seq_len=8))
    assert "2 without any token to learn" in msg
    only_bad = _file(tmp_path, ["{", "{"], name="bad.jsonl")
    assert "2 bad" in _error(config(tmp_path, path=only_bad, format="messages", skip_bad_rows=True))


def test_validate_inputs_names_the_key_and_file(tmp_path):
    def err(**kw):
        with pytest.raises(MegatrainError) as e:
            validate_inputs(config(tmp_path, **kw))
        return str(e.value)

    assert err() .startswith("data.path: no training data given")
    assert "data.path: " in err(path=str(tmp_path / "missing.jsonl")) and "does not exist" in err(
        path=str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    assert err(path=str(tmp_path / "empty.jsonl")) == f"data.path: file {tmp_path / 'empty.jsonl'} is empty"
    (tmp_path / "nodata").mkdir()
    assert "holds no data files" in err(path=str(tmp_path / "nodata"))
    (tmp_path / "x.xml").write_text("<a/>")
    assert "unsupported file type '.xml'" in err(path=str(tmp_path / "x.xml"))
    good = write_jsonl(tmp_path / "g.jsonl", [{"text": "a"}])
    assert err(path=str(good), eval_path=str(tmp_path / "nope.jsonl")).startswith("data.eval_path: ")
    assert err(datasets=[{"path": str(good)}, {"path": str(tmp_path / "nope")}]).startswith("data.datasets[1]: ")
    assert "data.chat_template: file" in err(path=str(good), chat_template="missing.jinja")


def test_chat_format_without_chat_template_is_an_error(tmp_path):
    tok = tokenizer()
    tok.chat_template = None
    path = _file(tmp_path, [GOOD])
    msg = _error(config(tmp_path, path=path, format="messages"), tok)
    assert msg.startswith("data.path: format 'messages' is rendered with the tokenizer's chat template") and \
        "data.chat_template" in msg


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(MegatrainError, match="tokenizer: directory .*nowhere does not exist"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(MegatrainError, match="holds no tokenizer files"):
        load_tokenizer(tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(MegatrainError, match="tokenizer: cannot load the tokenizer in"):
        load_tokenizer(tmp_path / "broken")


def test_eval_and_preview_report_the_same_errors(tmp_path):
    path = _file(tmp_path, [GOOD, "{oops"])
    with pytest.raises(MegatrainError, match="d.jsonl:2: malformed JSON"):
        build_eval_batches(config(tmp_path, path=path, format="messages", eval_fraction=0.5), tokenizer(),
                           micro_batch_size=1)
    with pytest.raises(MegatrainError, match="d.jsonl:2: malformed JSON"):
        preview(config(tmp_path, path=path, format="messages"), tokenizer(), 1)
