"""JSON-lines files -> their raw Arrow part, a block of lines at a time (sources.py's rows, written without datasets'
generator).

`sources._json_rows` defines the rows: one per line that is not blank (bytes.strip), numbered by line, its text without
the line end, or the reason its bytes are not UTF-8. Fed through `Dataset.from_generator`, datasets encodes and writes
them one row at a time: ~50 us a row, in one process (a million rows: most of a minute before tokenising starts). Here
a block of lines becomes one Arrow table with numpy and Arrow (a block that is not all UTF-8 falls back to the per-line
reading of sources), written into the cache folder under the part's identity (the same as sources.load_raw's); a
second run memory-maps the file. Blocks are cut from the bytes read without a copy and made into tables on a few
threads while the next are read. JSON arrays go through sources.load_raw as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .sources import ERR_COL, RAW_COL, ROW_COL, RawPart, Source, is_json_array, json_identity, load_raw, raw_features

BLOCK_BYTES = 1 << 26  # lines read and written at once
TABLE_THREADS = 4  # blocks made into tables at once


def _space() -> np.ndarray:
    t = np.zeros(256, np.uint8)
    t[list(b" \t\n\r\x0b\x0c")] = 1  # what bytes.strip() strips
    return t


SPACE = _space()


def read_part(src: Source, file: Path, cache_dir: str) -> RawPart:
    """sources.load_raw's RawPart of a file; JSON-lines files read by blocks (see the module docstring)."""
    if file.is_dir() or file.suffix.lower() not in (".json", ".jsonl"):
        return load_raw(src, file, cache_dir)
    if is_json_array(file):
        return load_raw(src, file, cache_dir)
    import datasets

    ident = json_identity(file)  # the part's identity as sources.load_raw makes it: changes with the file
    out = Path(cache_dir) / "megatrain" / f"raw-{ident}.arrow"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.stem}.{os.getpid()}.tmp")
        try:
            write_rows(file, tmp)
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    return RawPart(src, file, datasets.Dataset.from_file(str(out)), ident, True)


def write_rows(file: Path, out: Path) -> None:
    """The rows of a JSON-lines file (sources._json_rows's) as an Arrow file that datasets reads: blocks made into
    tables on TABLE_THREADS threads (numpy's and Arrow's passes over a block release the GIL), written in order."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    from datasets.arrow_writer import ArrowWriter

    writer = ArrowWriter(features=raw_features(), path=str(out))
    n = max(1, min(TABLE_THREADS, len(os.sched_getaffinity(0))))
    try:
        with ThreadPoolExecutor(n, thread_name_prefix="megatrain-raw") as pool:
            pending: deque = deque()
            for data, line in blocks(file):
                pending.append(pool.submit(_table, data, line))
                if len(pending) > n:  # at most n + 1 blocks read ahead of the writer
                    writer.write_table(pending.popleft().result())
            while pending:
                writer.write_table(pending.popleft().result())
        writer.finalize()
    finally:
        writer.close()


def blocks(file: Path):
    """(whole lines, the first one's number) of a file, about BLOCK_BYTES at a time (the last line may lack its end):
    each block cut after its last line end without a copy (a memoryview), the file read again from there."""
    line = 1
    with open(file, "rb") as fh:
        while True:
            block = fh.read(BLOCK_BYTES)
            if not block:
                return
            cut = block.rfind(b"\n") + 1
            while not cut:  # a line longer than the block: read on to its end, or the file's
                more = fh.read(BLOCK_BYTES)
                if not more:
                    cut = len(block)  # the file's last line, without its end
                    break
                if (end := more.rfind(b"\n")) >= 0:
                    cut = len(block) + end + 1
                block += more
            if cut < len(block):
                fh.seek(cut - len(block), os.SEEK_CUR)
            yield memoryview(block)[:cut], line
            line += block.count(b"\n", 0, cut)


def _table(data: bytes | memoryview, first: int):
    """The rows of whole lines `data`, the first being line `first`, as an Arrow table: the lines cut out of the
    bytes as they are, checked to be UTF-8 by Arrow (a block that is not goes line by line: _slow_table)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if bytes(data[-1:]) != b"\n":
        data = bytes(data) + b"\n"
    if len(data) >= 1 << 31:  # a line of 2 GB or more: past 32-bit offsets
        return _slow_table(data, first)
    buf = np.frombuffer(data, np.uint8)
    ends = np.flatnonzero(buf == 10)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lines = pa.StringArray.from_buffers(len(starts), pa.py_buffer(np.append(starts, len(buf)).astype(np.int32)),
                                        pa.py_buffer(data))
    try:
        lines.validate(full=True)
    except pa.ArrowInvalid:
        return _slow_table(data, first)
    inked = SPACE[buf[starts]] == 0  # most lines start with a byte that bytes.strip() keeps; the others are read
    for i in np.flatnonzero(~inked).tolist():
        inked[i] = bool(bytes(data[starts[i]: ends[i]]).strip())
    text = pc.binary_slice(lines.view(pa.binary()), 0, -1).view(pa.string())  # the line end cut off
    keep = np.flatnonzero(inked)
    if len(keep) < len(starts):
        text = text.filter(pa.array(inked))
    if (buf[ends[keep] - 1] == 13).any():  # CR LF line ends (or more CRs): as str.rstrip("\r\n")
        text = pc.utf8_rtrim(text, characters="\r")
    return pa.table({ROW_COL: pa.array(first + keep, pa.int64()), RAW_COL: text,
                     ERR_COL: pa.array([""] * len(keep), pa.string())})


def _slow_table(data: bytes | memoryview, first: int):
    """Line by line, as sources._json_rows: a line that is not UTF-8 becomes a row holding the reason."""
    import pyarrow as pa

    rows, raws, errs = [], [], []
    for n, b in enumerate(_lines(data), first):
        if not b.strip():
            continue
        try:
            raws.append(b.decode("utf-8").rstrip("\r\n"))
            errs.append("")
        except UnicodeDecodeError as e:
            raws.append("")
            errs.append(f"not valid UTF-8 (byte 0x{b[e.start]:02x} at column {e.start + 1})")
        rows.append(n)
    return pa.table({ROW_COL: pa.array(rows, pa.int64()), RAW_COL: pa.array(raws, pa.string()),
                     ERR_COL: pa.array(errs, pa.string())})


def _lines(data: bytes | memoryview) -> list[bytes]:
    """Lines as a binary file yields them: split after each b"\\n" only, line ends kept."""
    parts = bytes(data).split(b"\n")
    out = [p + b"\n" for p in parts[:-1]]
    if parts[-1]:
        out.append(parts[-1])
    return out
