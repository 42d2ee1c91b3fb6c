"""Input files read as the user wrote them, or refused in one line naming the culprit: CSV cells kept as text, files
without rows, documents nested deeper than Python's parsers go, a tokenizer without EOS, a chat template without a
generation prompt or with a syntax error, a byte order mark, LLaMA-Factory registry entries, data.max_seq_len past
the model's positions, and library log lines that would come before the error line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from data_fixtures.helpers import TOKENIZER, chat, config, tokenizer, write_jsonl

from megatrain.cli import main
from megatrain.config import load_config
from megatrain.data import build_train_loader, load_exact_match, preview, validate_inputs
from megatrain.errors import ConfigError, MegatrainError, load_json
from test_inputs import setup, write_config  # noqa: F401  (setup: a fixture)

PREFIX = "megatrain: error: "
DEEP = "nested too deeply for Python's parser"


def loader(cfg, tok=None):
    return build_train_loader(cfg, tok or tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)


def error(cfg, tok=None) -> str:
    with pytest.raises(MegatrainError) as e:
        loader(cfg, tok)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def raw_rows(ld) -> list[dict]:
    return ld.examples.parts[0].raw.dataset.to_list()


# ---- CSV cells are text, as written ---------------------------------------------------------------------------
def test_csv_cells_are_read_as_written(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("instruction,input,output\nabc,NA,cba\nhello,None,null\nwhat is 2+2,,4\nTrue,nan,007\n")
    ld = loader(config(tmp_path, path=str(f), format="alpaca"))
    assert raw_rows(ld) == [{"instruction": "abc", "input": "NA", "output": "cba"},
                            {"instruction": "hello", "input": "None", "output": "null"},
                            {"instruction": "what is 2+2", "input": "", "output": "4"},  # an empty cell: ""
                            {"instruction": "True", "input": "nan", "output": "007"}]
    assert ld.examples.counts.rows == 4 and len(ld.examples) == 4


# ---- files without rows: one error naming the file ------------------------------------------------------------
@pytest.mark.parametrize("name, content, fmt, why", [
    ("d.jsonl", "\n\n  \n", "alpaca", "holds no rows (only blank lines)"),
    ("d.json", "\n", "alpaca", "holds no rows (only blank lines)"),
    ("d.txt", "\n\n\n", "text", "holds no rows (only blank lines)"),
    ("d.csv", "instruction,input,output\n", "alpaca", "holds no rows (only its header)"),
])
def test_a_file_without_rows_names_the_file(tmp_path, name, content, fmt, why):
    f = tmp_path / name
    f.write_text(content)
    cfg = config(tmp_path, path=str(f), format=fmt)
    assert error(cfg) == f"data.path: file {f} {why}"
    if "blank" in why:  # refused with the cheap checks, before anything is written
        with pytest.raises(MegatrainError, match="holds no rows"):
            validate_inputs(cfg)


def test_an_empty_json_array_or_parquet_file_names_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "d.json"
    f.write_text("[\n]\n")
    assert error(config(tmp_path, path=str(f), format="alpaca")) == f"{f}: holds no rows (an empty JSON array)"
    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), p)
    assert error(config(tmp_path, path=str(p))) == f"data.path: file {p} holds no rows"


# ---- nesting deeper than the parsers recurse ------------------------------------------------------------------
def test_deeply_nested_json_names_the_file_or_row(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    f = tmp_path / "config.json"
    f.write_text(deep)
    with pytest.raises(MegatrainError) as e:
        load_json(f)
    assert str(e.value) == f"{f}: malformed JSON: {DEEP}"
    reg = tmp_path / "dataset_info.json"
    reg.write_text('{"x": ' + deep + "}")
    with pytest.raises(MegatrainError) as e:
        validate_inputs(config(tmp_path, dataset_info=str(reg), datasets=["x"]))
    assert str(e.value) == f"{reg}: malformed JSON: {DEEP}"
    arr = tmp_path / "a.json"
    arr.write_text(f"[{deep}]")
    assert error(config(tmp_path, path=str(arr))) == f"{arr}: malformed JSON: {DEEP}"
    lines = tmp_path / "d.jsonl"
    good = json.dumps(chat("Name a colour.", "Blue."))
    lines.write_text(f'{good}\n{{"messages": {deep}}}\n{good}\n')
    assert error(config(tmp_path, path=str(lines), format="messages")) == \
        f"{lines}:2: malformed JSON: {DEEP} (set data.skip_bad_rows: true to skip and count such rows)"
    ld = loader(config(tmp_path, path=str(lines), format="messages", skip_bad_rows=True))
    assert ld.examples.counts.bad == 1 and len(ld.examples) == 2


def test_deep_json_inside_a_row_or_the_exact_match_file(tmp_path):
    deep = "[" * 100_000 + "]" * 100_000
    f = write_jsonl(tmp_path / "d.jsonl", [{**chat("Name a colour.", "Blue."), "tools": deep}])
    assert error(config(tmp_path, path=str(f), format="messages")).startswith(
        f"{f}:1: tools column is not valid JSON: {DEEP}")
    em = tmp_path / "em.jsonl"
    em.write_text('{"instruction": "a", "output": "b"}\n' + deep + "\n")
    with pytest.raises(MegatrainError) as e:
        load_exact_match(str(em))
    assert str(e.value) == f"train.exact_match_path: {em}:2: malformed JSON: {DEEP}"
    em.write_text('{"instruction": "a \\udc00", "output": "b"}\n')
    with pytest.raises(MegatrainError) as e:
        load_exact_match(str(em))
    assert str(e.value) == (f"train.exact_match_path: {em}:1: 'instruction': invalid text: the escape \\udc00 is "
                            f"half of a UTF-16 surrogate pair, without its other half: not a character")


def test_deeply_nested_yaml_and_a_complex_key_name_the_file(tmp_path):
    p = tmp_path / "deep.yaml"
    p.write_text("model: {path: m}\nx: " + "[" * 10_000 + "\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value) == f"{p}: malformed YAML: {DEEP}"
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.path=m", "data.path=" + "[" * 10_000])
    assert str(e.value).startswith("command line: data.path: malformed YAML value '[[[") and \
        str(e.value).endswith(DEEP)
    k = tmp_path / "key.yaml"
    k.write_text("model: {path: m}\n? [a, b]\n: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config(k)
    assert str(e.value) == f"{k}:2: malformed YAML: found unhashable key"


# ---- the tokenizer: EOS, the chat template ------------------------------------------------------------------------
def test_add_eos_with_a_tokenizer_without_eos_is_refused_before_tokenising(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"text": "The quick fox."}])
    tok = tokenizer()
    tok.eos_token = None
    assert error(config(tmp_path, path=str(f)), tok) == (
        f"data.add_eos: the tokenizer in {TOKENIZER} has no eos_token, so the examples of format 'text' cannot end "
        f"with one; set data.add_eos: false (or give the tokenizer an eos_token)")
    assert not list((tmp_path / "cache").rglob("tokens-*"))  # nothing was tokenised
    ld = loader(config(tmp_path, path=str(f), add_eos=False), tok)
    assert len(ld.examples) == 1


NO_GENERATION_PROMPT = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def test_a_template_without_a_generation_prompt_is_one_warning_line(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [chat("Name a colour.", "Blue."), chat("Hi.", "Hello.")])
    ld = loader(config(tmp_path, path=str(f), format="messages", chat_template=NO_GENERATION_PROMPT))
    warnings = [ln for ln in ld.summary().splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "ignores add_generation_prompt" in warnings[0] and "data.chat_template" in warnings[0]
    shown = preview(config(tmp_path, path=str(f), format="messages", chat_template=NO_GENERATION_PROMPT),
                    tokenizer(), 0)
    assert shown.count("ignores add_generation_prompt") == 1
    assert "warning:" not in loader(config(tmp_path, path=str(f), format="messages")).summary()  # it writes one


def test_a_chat_template_syntax_error_names_the_template_not_a_row(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [chat("Name a colour.", "Blue.")])
    t = tmp_path / "t.jinja"
    t.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    assert error(config(tmp_path, path=str(f), format="messages", chat_template=str(t))) == \
        f"data.chat_template: {t}: line 2: not a valid Jinja template: unexpected '}}'"
    tok = tokenizer()
    tok.chat_template = 5  # a tokenizer_config.json's "chat_template": 5
    assert error(config(tmp_path, path=str(f), format="messages"), tok) == \
        f"tokenizer: the chat template in {TOKENIZER}: expected a Jinja template (a string), got int"
    e = tmp_path / "empty.jinja"
    e.write_text("\n")
    assert error(config(tmp_path, path=str(f), format="messages", chat_template=str(e))) == \
        f"data.chat_template: file {e} is empty"


# ---- text as written --------------------------------------------------------------------------------------------
def test_a_byte_order_mark_is_not_text(tmp_path):
    f = tmp_path / "d.txt"
    f.write_bytes(b"\xef\xbb\xbfhello world\nsecond line\n")
    ld = loader(config(tmp_path, path=str(f)))
    assert [r["text"] for r in raw_rows(ld)] == ["hello world", "second line"]


def test_a_lone_surrogate_is_one_rows_error(tmp_path):
    for name, content, where in (("d.jsonl", '{"text": "ok"}\n{"text": "a \\ud800 b"}\n', ":2"),
                                 ("d.json", '[{"text": "ok"}, {"text": "a \\ud800 b"}, {"text": "\\ud83d\\ude00"}]',
                                  " row 2")):
        f = tmp_path / name
        f.write_text(content)
        assert error(config(tmp_path, path=str(f))) == (
            f"{f}{where}: invalid text: the escape \\ud800 is half of a UTF-16 surrogate pair, without its other "
            f"half: not a character (set data.skip_bad_rows: true to skip and count such rows)")
        assert loader(config(tmp_path, path=str(f), skip_bad_rows=True)).examples.counts.bad == 1


def test_a_csv_row_with_extra_fields_names_its_line(tmp_path):
    f = tmp_path / "d.csv"
    f.write_text("instruction,input,output\nabc,,cba\nhello,,olleh,extra,more\n")
    assert error(config(tmp_path, path=str(f), format="alpaca")) == \
        f"data.path: cannot read {f}: Error tokenizing data. C error: Expected 3 fields in line 3, saw 5"


# ---- LLaMA-Factory registries: as strict as data.datasets -----------------------------------------------------
@pytest.mark.parametrize("entry, why", [
    ({"formatting": "openai"}, "formatting: 'openai' is not one of alpaca, sharegpt"),
    ({"num_samples": -3}, "num_samples: expected a whole number above 0, got -3"),
    ({"num_samples": "5"}, "num_samples: expected a whole number above 0, got '5'"),
    ({"num_samples": 2.5}, "num_samples: expected a whole number above 0, got 2.5"),
    ({"num_samples": True}, "num_samples: expected a whole number above 0, got True"),
    ({"columns": {"prompt": 5}}, "columns.prompt: expected a column name (a non-empty string), got 5"),
    ({"columns": ["prompt"]}, "columns: expected an object, got list"),
    ({"columns": {"images": "images"}}, "columns: 'images' is not read by megatrain (an alpaca entry's columns: "
                                        "prompt, query, response, system, history)"),
    ({"tags": {"role_tag": "from"}}, "tags: are read for sharegpt entries only (formatting: sharegpt)"),
    ({"formatting": "sharegpt", "tags": {"speaker": "from"}}, "tags: 'speaker' is not read by megatrain"),
    ({"ranking": "yes"}, "ranking: expected true or false, got 'yes'"),
    ({"split": 3}, "split: expected a split name (a non-empty string), got 3"),
])
def test_registry_entries_are_validated_like_inline_entries(tmp_path, entry, why):
    write_jsonl(tmp_path / "a.jsonl", [{"instruction": "a", "output": "b"}])
    reg = tmp_path / "dataset_info.json"
    reg.write_text(json.dumps({"d": {"file_name": "a.jsonl", **entry}}))
    with pytest.raises(MegatrainError) as e:
        validate_inputs(config(tmp_path, dataset_info=str(tmp_path), datasets=["d"]))
    assert str(e.value).startswith(f"{reg}: dataset 'd': {why}"), str(e.value)


# ---- the command line: max_seq_len, library log lines ----------------------------------------------------------
@pytest.mark.parametrize("command", ["plan", "data"])
def test_plan_and_data_refuse_max_seq_len_past_the_models_positions(setup, capsys, command):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    assert main([command, str(cfg), "data.max_seq_len=512"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"{PREFIX}data.max_seq_len: 512 exceeds the model's max_position_embeddings "
                                        f"(256)"]


def test_a_readers_log_line_does_not_precede_the_error(setup):
    """datasets logs a reader's failure before raising it (to the stderr its handler took when first configured: a
    process of its own shows it)."""
    tmp_path, model_dir, _ = setup
    f = tmp_path / "d.csv"
    f.write_text("text\nabc\nhello,extra\n")
    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "data", str(write_config(tmp_path, model_dir, f)),
                        "--preview", "0"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "Failed to read" not in r.stderr and r.stderr.count(PREFIX) == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (f"{PREFIX}data.path: cannot read {f}: Error tokenizing data. C "
                                                 f"error: Expected 1 fields in line 3, saw 2")
