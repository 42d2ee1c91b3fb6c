"""Data rows whose bytes are not UTF-8: named by file and row (never decoded with replacement characters), or,
with data.skip_bad_rows, skipped and counted where our own reader reads them (JSON lines, JSON arrays)."""

from __future__ import annotations

import json

import pytest
from data_fixtures.helpers import chat, config, tokenizer

from megatrain.data import build_train_loader
from megatrain.errors import MegatrainError

GOOD = json.dumps(chat("Name a colour.", "Blue.")).encode()
BAD = b'{"messages": [{"role": "user", "content": "caf\xe9?"}, {"role": "assistant", "content": "Yes."}]}'


def loader(cfg):
    return build_train_loader(cfg, tokenizer(), seed=0, micro_batch_size=1, grad_accum_steps=1)


def error(cfg) -> str:
    with pytest.raises(MegatrainError) as e:
        loader(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_json_lines_row_not_utf8(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b"\n".join([GOOD, GOOD, BAD, GOOD]) + b"\n")
    msg = error(config(tmp_path, path=str(f), format="messages"))
    assert msg == (f"{f}:3: not valid UTF-8 (byte 0xe9 at column 47) "
                   f"(set data.skip_bad_rows: true to skip and count such rows)")
    ld = loader(config(tmp_path, path=str(f), format="messages", skip_bad_rows=True))
    assert len(ld.examples) == 3 and ld.examples.counts.bad == 1
    assert f"{f}:3: not valid UTF-8 (byte 0xe9 at column 47)" in ld.summary()
    # the first row is checked before tokenising: the same message
    f.write_bytes(b"\n".join([BAD, GOOD]) + b"\n")
    assert error(config(tmp_path, path=str(f), format="messages")).startswith(f"{f}:1: not valid UTF-8")


def test_json_array_item_not_utf8(tmp_path):
    f = tmp_path / "d.json"
    f.write_bytes(b"[\n" + GOOD + b",\n" + BAD + b",\n" + GOOD + b"\n]\n")
    msg = error(config(tmp_path, path=str(f), format="messages"))
    assert msg == (f"{f} row 2: not valid UTF-8 (byte 0xe9 on line 3) "
                   f"(set data.skip_bad_rows: true to skip and count such rows)")
    ld = loader(config(tmp_path, path=str(f), format="messages", skip_bad_rows=True))
    assert len(ld.examples) == 2 and ld.examples.counts.bad == 1
    # a stray byte outside any string: the array cannot be parsed, so the file is named with the line
    f.write_bytes(b"[\n" + GOOD + b",\n\xff" + GOOD + b"\n]\n")
    msg = error(config(tmp_path, path=str(f), format="messages", skip_bad_rows=True))
    assert msg == f"{f}:3: not valid UTF-8 (byte 0xff at column 1, byte offset {len(GOOD) + 4}); save the file as " \
                  "UTF-8"


@pytest.mark.parametrize("name, content, line, col", [
    ("a.txt", b"The quick fox.\nThe caf\xe9 dog.\n", 2, 8),
    ("a.csv", b"text\nThe quick fox.\nThe caf\xe9 dog.\n", 3, 8),
])
def test_text_and_csv_not_utf8(tmp_path, name, content, line, col):
    f = tmp_path / name
    f.write_bytes(content)
    for skip in (False, True):
        msg = error(config(tmp_path, path=str(f), skip_bad_rows=skip))
        assert msg.startswith(f"{f}:{line}: not valid UTF-8 (byte 0xe9 at column {col}, byte offset "), msg
        assert msg.endswith("; save the file as UTF-8")


def test_parquet_string_not_utf8(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = [b"The quick fox.", b"The lazy dog.", b"The caf\xe9 dog."]
    raw = pa.array(values, type=pa.binary())
    # a string column whose bytes are not UTF-8 (some writers produce such files; pyarrow reads them unchecked)
    col = pa.Array.from_buffers(pa.string(), len(values), raw.buffers())
    f = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": col}), f)
    msg = error(config(tmp_path, path=str(f)))
    assert msg == f"{f} row 3: column 'text' is not valid UTF-8; save the file as UTF-8"
