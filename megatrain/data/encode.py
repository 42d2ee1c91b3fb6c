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

from ..errors import TOO_DEEP, MegatrainError
from .formats import RowError, to_sample
from .sources import ERR_COL, RAW_COL, ROW_COL, SURROGATE_ESCAPE, RawPart, check_strings_utf8, invalid_text
from .template import IGNORE, EncodeOptions, encode_many
from .workers import forking_map
from .tokenizer import tokenizer_fingerprint

ENCODER_VERSION = "3"  # bump when the encoding of a row changes


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
    """One raw row -> its tokenised columns (encode_rows of a batch of one)."""
    out = encode_rows({k: [raw[k]] for k in raw}, [index], tok=tok, fmt=fmt, columns=columns, roles=roles,
                      blank_ok=blank_ok, opts=opts)
    return {k: v[0] for k, v in out.items()}


def encode_rows(batch, indices: list[int], *, tok, fmt: str, columns: dict, roles: dict, blank_ok: bool,
                opts: EncodeOptions, threads: bool = False) -> dict:
    """A batch of raw rows (column -> values) -> their tokenised columns (column -> values), the rows' texts
    tokenised together (template.encode_many; threads: on this process's cores). Module level, so `map` can send it
    to worker processes."""
    cols = {k: batch[k] for k in batch}
    rows, samples = [], []
    for j, index in enumerate(indices):
        row_no, row, err = read_row({k: v[j] for k, v in cols.items()}, index)
        sample = None
        if not err:
            try:
                sample = to_sample(row, fmt, columns, roles, blank_ok)
            except Exception as e:
                err = _why(e)
        rows.append((row_no, err))
        samples.append(None if err else sample)
    out = {k: [] for k in _COLUMNS}
    for (row_no, err), sample, enc in zip(rows, samples, encode_many(tok, samples, opts, threads)):
        if isinstance(enc, Exception):
            err = _why(enc)
        if err or sample is None:  # a bad row, or a blank line of a text file (not a row)
            ids, labels, cut = [], [], 0
        else:
            ids, labels, cut = enc
        for k, v in zip(_COLUMNS, (ids, labels, row_no, err, len(ids), len(labels) - labels.count(IGNORE), cut)):
            out[k].append(v)
    return out


_COLUMNS = ("input_ids", "labels", "row", "error", "length", "num_targets", "cut_chars")


def _why(e: Exception) -> str:
    """A row's error: a RowError's message; anything else a strange row provokes (the template, the tokenizer)
    named by its type and first line."""
    return str(e) if isinstance(e, RowError) else f"{type(e).__name__}: {e}".splitlines()[0]


def each_row(batch, indices: list[int], *, encoder, names: list[str], **kwargs) -> dict:
    """A batch of raw rows (column -> values) -> encoder(raw row, index, **kwargs)'s columns `names`, row by row."""
    cols = {k: batch[k] for k in batch}
    out = {k: [] for k in names}
    for j, index in enumerate(indices):
        r = encoder({k: v[j] for k, v in cols.items()}, index, **kwargs)
        for k in names:
            out[k].append(r[k])
    return out


def read_row(raw: dict, index: int) -> tuple[int, object, str]:
    """A raw row -> (its row number, the row, "" or why it cannot be read: bytes that are not UTF-8, bad JSON,
    nesting deeper than the parser recurses, an escaped UTF-16 surrogate without its pair: not a character, which no
    tokenizer takes)."""
    if RAW_COL not in raw:
        return index + 1, dict(raw), ""  # datasets hands a lazy mapping
    if raw.get(ERR_COL):
        return raw[ROW_COL], None, raw[ERR_COL]
    text = raw[RAW_COL]
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        return raw[ROW_COL], None, f"malformed JSON: {e.msg} (column {e.colno})"
    except RecursionError:
        return raw[ROW_COL], None, f"malformed JSON: {TOO_DEEP}"
    bad = invalid_text(json.dumps(row, ensure_ascii=False)) if SURROGATE_ESCAPE.search(text) else None
    return (raw[ROW_COL], None, bad) if bad else (raw[ROW_COL], row, "")


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
    version: the encoder's, in the cache key. Default: encode_row's columns, by encode_rows a
    batch at a time (the Rust tokenizer on this process's cores when it maps alone); another encoder row by row
    within each batch (each_row)."""
    default = encoder is None
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
    feats = features()
    fn, fn_kwargs = (encode_rows, dict(kwargs, threads=nproc is None)) if default else \
        (each_row, dict(kwargs, encoder=encoder, names=list(feats)))
    try:
        with forking_map():
            return ds.map(fn, with_indices=True, batched=True, fn_kwargs=fn_kwargs, remove_columns=ds.column_names,
                          features=feats, cache_file_name=str(out), load_from_cache_file=True, new_fingerprint=fp,
                          num_proc=nproc, desc=f"Tokenising {part.file.name}")
    except Exception as e:  # a stop (a signal's exception) raised while the pool ran: datasets' clean-up raises
        stop = _stop_within(e)  # its own error (a TimeoutError) over it; the stop is what happened
        if stop is not None:
            raise stop from None
        raise


def _stop_within(e: BaseException) -> BaseException | None:
    """The exception that is not an error (KeyboardInterrupt, a signal's stop) an error was raised while handling."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if not isinstance(e, Exception):
            return e
        e = e.__cause__ or e.__context__
    return None


def cached(out: Path) -> bool:
    """Whether `map` will read the tokens of `out` from the cache: the file, or the shards that several processes
    wrote (datasets names them <stem>_<rank>_of_<n>.arrow)."""
    return out.exists() or any(out.parent.glob(f"{out.stem}_00000_of_*{out.suffix}"))
