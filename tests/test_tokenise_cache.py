"""Tokenising fast: JSON lines read a block at a time (cache_raw.py) give sources._json_rows's rows, and the examples
each row's encoding (encode_rows); a restarted run on several processes reads both caches and tokenises nothing."""

from __future__ import annotations

import numpy as np
import pytest
from data_fixtures.helpers import config, tokenizer, write_jsonl

import megatrain.data.cache_raw as cache_raw
import megatrain.data.encode as encode_mod
from megatrain.data.config import DEFAULT_COLUMNS
from megatrain.data.examples import build_examples
from megatrain.data.sources import ERR_COL, RAW_COL, ROW_COL, _json_rows
from megatrain.data.template import EncodeOptions
from megatrain.data.tokenizer import row_tokens

TRICKY = (b'{"a": 1}\n\n   \n{"a": 2}\r\n{"a": "\xc3\xa9"}\n\x0c\n{"bad\xff": 1}\n\xc2\xa0\n{oops\n\r\n'
          b'{"a": 3}\r\r\n{"x": "y"}')


@pytest.mark.parametrize("block", [5, 16, 1 << 20])
@pytest.mark.parametrize("tail", [b"", b"\n", b"\n\n"])
@pytest.mark.parametrize("body", [TRICKY, TRICKY.replace(b"\xff", b"")])
def test_block_reader_gives_the_rows_of_the_line_reader(tmp_path, monkeypatch, block, tail, body):
    """Blank lines, CR LF, bytes that are not UTF-8 in one line, a no-break space, a last line without its end;
    blocks smaller than a line; a block of valid UTF-8 (Arrow's path) and one that is not (line by line)."""
    f = tmp_path / "x.jsonl"
    f.write_bytes(body + tail)
    monkeypatch.setattr(cache_raw, "BLOCK_BYTES", block)
    got = [r for data, line in cache_raw.blocks(f) for r in cache_raw._table(data, line).to_pylist()]
    assert got == list(_json_rows(str(f)))
    out = tmp_path / "x.arrow"
    cache_raw.write_rows(f, out)
    import datasets

    assert datasets.Dataset.from_file(str(out)).to_list() == got


def _rows(n: int, seed: int = 0, bad: int | None = None) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = "the quick brown fox jumps over a lazy dog what is capital of france paris".split()
    say = lambda k: " ".join(rng.choice(words, size=k))  # noqa: E731
    rows = [{"instruction": say(int(rng.integers(1, 8))), "input": say(int(rng.integers(0, 5))),
             "output": say(int(rng.integers(1, 20)))} for _ in range(n)]
    if bad is not None:
        rows[bad] = {"instruction": "no output column"}  # a bad row: skipped and counted
    return rows


def test_restart_on_several_processes_tokenises_nothing_and_gives_the_same_examples(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "a.jsonl", _rows(300))
    cfg = config(tmp_path, path=str(path), format="alpaca", num_proc=2, max_seq_len=64)
    first = build_examples(cfg, tokenizer(), "train")
    assert list((tmp_path / "cache" / "megatrain").glob("tokens-*_00001_of_00002.arrow"))  # two processes wrote

    def never(*a, **kw):
        raise AssertionError("tokenised or read again")

    monkeypatch.setattr(encode_mod, "encode_rows", never)  # the map's batches, and encode_row (a batch of one:
    monkeypatch.setattr(encode_mod, "encode_row", never)  # the first-row check before mapping)
    monkeypatch.setattr(cache_raw, "write_rows", never)
    again = build_examples(cfg, tokenizer(), "train")
    assert again.counts == first.counts and first.counts.rows == 300
    for k in ("part", "row", "start", "end", "source"):
        assert np.array_equal(getattr(again, k), getattr(first, k))
    assert all(all(np.array_equal(a, b) for a, b in zip(first.get(k), again.get(k))) for k in range(len(first)))


def test_examples_are_each_rows_own_encoding(tmp_path):
    rows = _rows(50, seed=1, bad=7)
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    tok = tokenizer()
    ex = build_examples(config(tmp_path, path=str(path), format="alpaca", skip_bad_rows=True, max_seq_len=4096), tok,
                        "train")
    opts = EncodeOptions(max_tokens=row_tokens(4096))
    kw = dict(tok=tok, fmt="alpaca", columns=DEFAULT_COLUMNS["alpaca"], roles={}, blank_ok=False, opts=opts)
    import json

    want = {}
    for i, r in enumerate(rows):
        enc = encode_mod.encode_row({ROW_COL: i + 1, RAW_COL: json.dumps(r), ERR_COL: ""}, i, **kw)
        if not enc["error"]:
            want[i + 1] = enc
    assert len(ex) == len(want) == 49
    tokens = ex.parts[0].tokens
    for k in range(len(ex)):
        enc = want[tokens[int(ex.row[k])]["row"]]
        ids, labels = ex.get(k)
        assert ids.tolist() == enc["input_ids"] and labels.tolist() == enc["labels"]
