"""Raw parts -> tokenised parts, with `datasets.map` (progress bar, optional processes, cached on disk).

The cache file's name is a fingerprint of everything that changes the tokens: the part's content identity, the
tokenizer (vocabulary, special tokens, chat template), the format with its columns and roles, the loss-mask
options, and this code's version. Same inputs: the second run reads the Arrow file and tokenises nothing. The
length limit, over-long policy, packing and bad-row policy are applied after the cache (examples.py), so changing
them does not re-tokenise.

Row problems never raise inside `map`: each output row carries `error` ("" when fine), and the caller decides
(stop at the first bad row, or skip and count).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from ..errors import MegatrainError
from .formats import RowError, to_sample
from .sources import ERR_COL, RAW_COL, ROW_COL, RawPart, check_strings_utf8
from .template import IGNORE, EncodeOptions, encode_counted
from .tokenizer import tokenizer_fingerprint

ENCODER_VERSION = "2"  # bump when the encoding of a row changes


def _features():
    import datasets

    return datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32")),
        "row": datasets.Value("int64"),
        "error": datasets.Value("string"),
        "length": datasets.Value("int32"),
        "num_targets": datasets.Value("int32"),
        "cut_chars": datasets.Value("int64"),  # characters left untokenised (EncodeOptions.max_tokens)
    })


def encode_row(raw: dict, index: int, *, tok, fmt: str, columns: dict, roles: dict, blank_ok: bool,
               opts: EncodeOptions) -> dict:
    """One raw row -> its tokenised columns. Module level, so `map` can send it to worker processes."""
    row_no, row, err = read_row(raw, index)
    if err:
        return _bad(row_no, err)
    try:
        sample = to_sample(row, fmt, columns, roles, blank_ok)
        if sample is None:  # a blank line of a text file: not a row
            return {"input_ids": [], "labels": [], "row": row_no, "error": "", "length": 0, "num_targets": 0,
                    "cut_chars": 0}
        ids, labels, cut = encode_counted(tok, sample, opts)
    except RowError as e:
        return _bad(row_no, str(e))
    except Exception as e:  # anything else a strange row provokes (the template, the tokenizer): name it
        return _bad(row_no, f"{type(e).__name__}: {e}".splitlines()[0])
    return {"input_ids": ids, "labels": labels, "row": row_no, "error": "", "length": len(ids),
            "num_targets": len(labels) - labels.count(IGNORE), "cut_chars": cut}


def read_row(raw: dict, index: int) -> tuple[int, object, str]:
    """A raw row -> (its row number, the row, "" or why it cannot be read: bytes that are not UTF-8, bad JSON)."""
    if RAW_COL not in raw:
        return index + 1, dict(raw), ""  # datasets hands a lazy mapping
    if raw.get(ERR_COL):
        return raw[ROW_COL], None, raw[ERR_COL]
    try:
        return raw[ROW_COL], json.loads(raw[RAW_COL]), ""
    except json.JSONDecodeError as e:
        return raw[ROW_COL], None, f"malformed JSON: {e.msg} (column {e.colno})"


def _bad(row_no: int, msg: str) -> dict:
    return {"input_ids": [], "labels": [], "row": row_no, "error": msg, "length": 0, "num_targets": 0, "cut_chars": 0}


def cache_root(cfg) -> str:
    import datasets

    return str(Path(cfg.cache_dir).expanduser()) if cfg.cache_dir else str(datasets.config.HF_DATASETS_CACHE)


ROWS_PER_PROCESS = 4096  # a process of its own costs about a second to start: worth it from this many rows on


def processes(num_proc: int | None, rows: int) -> int | None:
    """Processes that tokenise `rows` rows (None: this one). data.num_proc as given; unset, one per
    ROWS_PER_PROCESS rows up to the cores this process may use. Either way at least two rows each."""
    if num_proc is None:
        num_proc = min(len(os.sched_getaffinity(0)), rows // ROWS_PER_PROCESS)
    return num_proc if num_proc > 1 and rows >= 2 * num_proc else None


def tokenise(part: RawPart, tok, opts: EncodeOptions, root: str, num_proc: int | None, fail_fast: bool,
             encoder=None, features=None, version: str = ENCODER_VERSION):
    """The tokenised dataset of one raw part (from the cache when it is there). encoder(raw, index, **kwargs) -> the
    columns of `features()` with at least row, error, length and cut_chars (preference.py's pairs have their own);
    version: the encoder's, in the cache key. Default: encode_row and its columns."""
    encoder, features = encoder or encode_row, features or _features
    src = part.source
    if src.format not in ("text", "prompt_completion", "preference", "prompt") and not tok.chat_template:
        raise MegatrainError(f"{src.key}: format '{src.format}' is rendered with the tokenizer's chat template, "
                             f"but the tokenizer has none; set data.chat_template")
    kwargs = dict(tok=tok, fmt=src.format, columns=src.columns, roles=src.roles,
                  blank_ok=part.file.suffix.lower() == ".txt", opts=opts)
    key = json.dumps({"part": part.identity, "tok": tokenizer_fingerprint(tok), "fmt": src.format,
                      "columns": src.columns, "roles": src.roles, "blank_ok": kwargs["blank_ok"],
                      "opts": asdict(opts), "v": version}, sort_keys=True)
    fp = hashlib.sha256(key.encode()).hexdigest()[:20]
    out = Path(root) / "megatrain" / f"tokens-{fp}.arrow"
    ds = part.dataset
    done = cached(out)
    if RAW_COL not in ds.column_names and not done:  # read by datasets, not by our reader: check the bytes
        check_strings_utf8(part)
    if fail_fast and len(ds) and not done:  # a wrong format or column shows on row 1: stop before mapping
        first = encoder(ds[0], 0, **kwargs)
        if first["error"]:
            raise MegatrainError(f"{part.where(first['row'])}: {first['error']} "
                                 f"(set data.skip_bad_rows: true to skip and count such rows)")
    out.parent.mkdir(parents=True, exist_ok=True)
    nproc = processes(num_proc, len(ds))
    return ds.map(encoder, with_indices=True, fn_kwargs=kwargs, remove_columns=ds.column_names,
                  features=features(), cache_file_name=str(out), load_from_cache_file=True, new_fingerprint=fp,
                  num_proc=nproc, desc=f"Tokenising {part.file.name}")


def cached(out: Path) -> bool:
    """Whether `map` will read the tokens of `out` from the cache: the file, or the shards that several processes
    wrote (datasets names them <stem>_<rank>_of_<n>.arrow)."""
    return out.exists() or any(out.parent.glob(f"{out.stem}_00000_of_*{out.suffix}"))
