"""Sources: file types, folders, save_to_disk, dataset_info.json registries, the config's paths, and the cache
(a second run does not tokenise again; changed settings do)."""

from __future__ import annotations

import json

import pytest
import yaml
from data_fixtures.helpers import FORMATS, chat, config, tokenizer, trained_texts, write_jsonl

import megatrain.data.encode as encode_mod
from megatrain.data import build_train_loader, validate_inputs
from megatrain.data.examples import build_examples
from megatrain.errors import ConfigError, MegatrainError

ROWS = [chat("Name a colour.", "Blue."), chat("Name another.", "Green."), chat("Hello!", "I am fine.")]


def _replies(tok, ex) -> list[str]:
    return sorted(r for k in range(len(ex)) for r in trained_texts(tok, *ex.get(k)))


def test_parquet_csv_and_jsonl_give_the_same_examples(tmp_path):
    import pandas as pd

    tok = tokenizer()
    jsonl = write_jsonl(tmp_path / "c.jsonl", ROWS)
    pd.DataFrame(ROWS).to_parquet(tmp_path / "c.parquet")
    want = _replies(tok, build_examples(config(tmp_path, path=str(jsonl), format="messages"), tok))
    got = _replies(tok, build_examples(config(tmp_path, path=str(tmp_path / "c.parquet"), format="messages"), tok))
    assert got == want == ["Blue.<|im_end|>\n", "Green.<|im_end|>\n", "I am fine.<|im_end|>\n"]
    pd.DataFrame([{"q": "Name a colour.", "a": "Blue."}]).to_csv(tmp_path / "a.csv", index=False)
    ex = build_examples(config(tmp_path, path=str(tmp_path / "a.csv"), format="alpaca",
                               columns={"instruction": "q", "output": "a"}), tok)
    assert _replies(tok, ex) == ["Blue.<|im_end|>\n"]


def test_text_files_by_line_and_by_document(tmp_path):
    tok = tokenizer()
    f = tmp_path / "book.txt"
    f.write_text("The quick brown fox.\n\nThe lazy dog.\n")
    by_line = build_examples(config(tmp_path, path=str(f)), tok)
    assert len(by_line) == 2 and by_line.counts.rows == 2  # the blank line is not a row
    assert by_line.where(1).endswith("book.txt:3")  # rows of a text file are its line numbers
    whole = build_examples(config(tmp_path, path=str(f), sample_by="document"), tok)
    assert len(whole) == 1 and "fox.\n\nThe lazy" in tok.decode(whole.get(0)[0].tolist())


def test_text_paragraphs_and_documents_lose_their_surrounding_line_breaks(tmp_path):
    """A .txt sample's text is its words: the line breaks around a paragraph (three or more between two) or at a
    document's ends are the file's layout, the same for every sample, not text to learn."""
    tok = tokenizer()
    f = tmp_path / "book.txt"
    f.write_text("\nOne para.\n\n\nTwo para.\n\nThree para.\n")
    paras = build_examples(config(tmp_path, path=str(f), sample_by="paragraph"), tok)
    eos = tok.eos_token
    assert [tok.decode(paras.get(k)[0].tolist()) for k in range(len(paras))] == \
        [f"<s>One para.{eos}", f"<s>Two para.{eos}", f"<s>Three para.{eos}"]
    whole = build_examples(config(tmp_path, path=str(f), sample_by="document"), tok)
    assert tok.decode(whole.get(0)[0].tolist()) == f"<s>One para.\n\n\nTwo para.\n\nThree para.{eos}"


def test_a_folder_of_files_is_read_recursively(tmp_path):
    tok = tokenizer()
    write_jsonl(tmp_path / "d" / "a.jsonl", ROWS[:1])
    write_jsonl(tmp_path / "d" / "sub" / "b.jsonl", ROWS[1:])
    write_jsonl(tmp_path / "d" / ".hidden" / "c.jsonl", [{"bad": 1}])  # hidden: ignored
    ex = build_examples(config(tmp_path, path=str(tmp_path / "d"), format="messages"), tok)
    assert len(ex) == 3


def test_save_to_disk_directories(tmp_path):
    import datasets

    tok = tokenizer()
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    assert len(build_examples(config(tmp_path, path=str(tmp_path / "ds"), format="messages"), tok)) == 3
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                               "test": datasets.Dataset.from_list(ROWS[2:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(build_examples(config(tmp_path, path=str(tmp_path / "dd"), format="messages"), tok)) == 2
    assert len(build_examples(config(tmp_path, path=str(tmp_path / "dd"), format="messages", split="test"), tok)) == 1
    with pytest.raises(MegatrainError, match="has no split 'dev' .*train, test"):
        build_examples(config(tmp_path, path=str(tmp_path / "dd"), format="messages", split="dev"), tok)


def _registry(tmp_path):
    d = tmp_path / "reg"
    d.mkdir()
    (d / "alpaca_demo.json").write_text(json.dumps([{"question": "Name a colour.", "answer": "Blue."}]))
    write_jsonl(d / "glaive.jsonl", [{"conv": [{"speaker": "me", "words": "Hello!"},
                                               {"speaker": "ai", "words": "I am fine."}]}])
    write_jsonl(d / "c4_demo.jsonl", [{"text": "The quick brown fox."}])
    info = {
        "alpaca_demo": {"file_name": "alpaca_demo.json", "columns": {"prompt": "question", "response": "answer"}},
        "glaive_demo": {"file_name": "glaive.jsonl", "formatting": "sharegpt", "columns": {"messages": "conv"},
                        "tags": {"role_tag": "speaker", "content_tag": "words", "user_tag": "me",
                                 "assistant_tag": "ai"}},
        "c4_demo": {"file_name": "c4_demo.jsonl", "columns": {"prompt": "text"}},
        "remote": {"hf_hub_url": "someone/something"},
    }
    (d / "dataset_info.json").write_text(json.dumps(info))
    return d


def test_llama_factory_dataset_info_registry(tmp_path):
    tok = tokenizer()
    reg = _registry(tmp_path)
    cfg = config(tmp_path, dataset_info=str(reg), datasets=["alpaca_demo", "glaive_demo", "c4_demo"])
    validate_inputs(cfg)
    ex = build_examples(cfg, tok)
    assert [s.format for s in ex.sources] == ["alpaca", "sharegpt", "text"]
    assert _replies(tok, ex)[:2] == ["Blue.<|im_end|>\n", "I am fine.<|im_end|>\n"]
    assert "The quick brown fox.</s>" in _replies(tok, ex)
    with pytest.raises(MegatrainError, match="'glaive' is not in .*dataset_info.json; did you mean 'glaive_demo'"):
        validate_inputs(config(tmp_path, dataset_info=str(reg), datasets=["glaive"]))
    with pytest.raises(MegatrainError, match="'remote': has no local file_name \\(hf_hub_url\\)"):
        validate_inputs(config(tmp_path, dataset_info=str(reg), datasets=["remote"]))


def test_relative_paths_resolve_against_the_config_folder(tmp_path):
    from megatrain.config import load_config

    d = tmp_path / "project"
    write_jsonl(d / "data" / "a.jsonl", ROWS)
    _registry(d)
    raw = {"model": {"path": "m"}, "data": {"datasets": [{"path": "data/a.jsonl", "format": "messages"},
                                                         {"name": "c4_demo"}],
                                            "dataset_info": "reg", "eval_path": "data/a.jsonl"}}
    (d / "cfg.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(d / "cfg.yaml").data
    assert cfg.datasets[0].path == str(d / "data" / "a.jsonl") and cfg.dataset_info == str(d / "reg")
    assert cfg.eval_path == str(d / "data" / "a.jsonl")
    validate_inputs(cfg)


@pytest.mark.parametrize("data, message", [
    ({"path": "x", "format": "alpaca", "columns": {"answer": "a"}}, "data.columns: .*'answer' is not a column of "
                                                                     "format 'alpaca'"),
    ({"path": "x", "packingg": True}, "data.packingg: unknown key; did you mean 'data.packing'"),
    ({"path": "x", "format": "messages", "overlong": "split"}, "'split' .* is for format 'text' only"),
    ({"path": "x", "roles": {"bot": "robot"}}, "role 'bot' maps to 'robot'"),
    ({"path": "x", "datasets": ["y"]}, "give data.path or data.datasets, not both"),
    ({"datasets": [{"name": "a"}]}, "names dataset 'a' but data.dataset_info is not set"),
])
def test_config_mistakes_are_named(tmp_path, data, message):
    from megatrain.config import load_config

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"model": {"path": "m"}, "data": data}))
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / "cfg.yaml")


def test_second_run_reads_the_cache_and_changed_settings_retokenise(tmp_path, monkeypatch):
    calls = []
    real = encode_mod.encode_rows

    def counting(batch, indices, **kw):  # the rows the map encodes (encode_row, the first-row check, is one)
        calls.append(len(indices))
        return real(batch, indices, **kw)

    monkeypatch.setattr(encode_mod, "encode_rows", counting)
    path = str(FORMATS / "messages.jsonl")

    def build(**kw):
        calls.clear()
        build_train_loader(config(tmp_path, path=path, format="messages", **kw), tokenizer(), seed=0,
                           micro_batch_size=1, grad_accum_steps=1)
        return len(calls)

    assert build() > 0
    assert build() == 0  # the same inputs: read from the cache, nothing tokenised
    assert build(max_seq_len=40, packing=True) == 0  # applied after the cache
    assert build(mask_history=True) > 0  # changes labels: tokenised again
    tmpl = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}" \
           "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    assert build(chat_template=tmpl) > 0  # another template: tokenised again
    assert list((tmp_path / "cache" / "megatrain").glob("tokens-*.arrow"))


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".txt", ".parquet"])
def test_a_file_rewritten_with_its_size_and_times_kept_is_read_again(tmp_path, suffix):
    """A file's identity is more than its size and modification time: `touch -r`, `cp -p` or a restored mtime
    after an edit of the same length must not serve the old rows (their tokens or the datasets builder's)."""
    import os

    import pandas as pd

    path = tmp_path / f"d{suffix}"

    def write(word: str) -> None:
        text = f"The {word} sat on the mat."
        if suffix == ".jsonl":
            path.write_text(json.dumps({"text": text}) + "\n")
        elif suffix == ".csv":
            path.write_text(f"text\n{text}\n")
        elif suffix == ".txt":
            path.write_text(text + "\n")
        else:
            pd.DataFrame({"text": [text]}).to_parquet(path)

    def texts() -> list[str]:
        ex = build_examples(config(tmp_path, path=str(path), format="text"), tokenizer(), "train")
        return [tokenizer().decode(ex.get(k)[0]) for k in range(len(ex))]

    write("cat")
    assert any("cat" in t for t in texts())
    st = os.stat(path)
    write("dog")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    assert any("dog" in t for t in texts())
