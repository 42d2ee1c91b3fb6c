"""Shared helpers of the data tests (tests/test_data*.py): the tiny tokenizer, configs, files, dumps."""

from __future__ import annotations

import json
from pathlib import Path

from megatrain.data import DataConfig, load_tokenizer
from megatrain.data.template import IGNORE

FIXTURES = Path(__file__).parent
TOKENIZER = FIXTURES / "tokenizer"
FORMATS = FIXTURES / "formats"
GOLDEN = FIXTURES / "golden"


def tokenizer():
    """A fresh copy each time: the loader may set data.chat_template on the object it is given."""
    return load_tokenizer(TOKENIZER)


def config(tmp_path, **kw) -> DataConfig:
    """A DataConfig whose datasets cache lives in the test's own folder."""
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(**kw)


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(*turns: str, system: str | None = None) -> dict:
    """A messages-format row from alternating user/assistant texts."""
    msgs = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    return {"messages": msgs}


def masked_text(tok, ids, labels) -> str:
    """The example's text with the parts that carry no loss inside [[ ]]."""
    out, run, trained = [], [], None
    for i, lab in zip(list(ids), list(labels)):
        t = lab != IGNORE
        if run and t != trained:
            out.append(tok.decode(run) if trained else "[[" + tok.decode(run) + "]]")
            run = []
        run.append(int(i))
        trained = t
    if run:
        out.append(tok.decode(run) if trained else "[[" + tok.decode(run) + "]]")
    return "".join(out)


def trained_texts(tok, ids, labels) -> list[str]:
    """The maximal runs of labelled tokens, decoded."""
    runs, run = [], []
    for i, lab in zip(list(ids), list(labels)):
        if lab != IGNORE:
            run.append(int(i))
        elif run:
            runs.append(tok.decode(run))
            run = []
    if run:
        runs.append(tok.decode(run))
    return runs
