"""Where rows come from: config entries -> resolved `Source`s -> files -> raw `datasets.Dataset`s (one per file).

Every file is loaded on its own, so an error can name the file and the row. JSON and JSON-lines files are read by
our own generator into one JSON string per row (no Arrow schema inference to trip over mixed types; the exact line
of a malformed row is known); parquet, csv and text files go through the datasets builders; save_to_disk
directories through `load_from_disk`. Everything lands in the datasets cache, so a second run reads Arrow files.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TOO_DEEP, MegatrainError, utf8_problem
from .config import DEFAULT_COLUMNS, DEFAULT_ROLES, DataConfig, DatasetSpec
from .registry import as_prompts, from_registry, load_registry

if TYPE_CHECKING:
    from datasets import Dataset

EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text"}
READER_VERSION = "3"  # bump when the rows read of a file change
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".tar", ".7z")  # named, never skipped silently
# Columns of a raw JSON part: the row's line (JSON lines) or 1-based item number (JSON array), the row itself, and
# what is wrong with its bytes ("" when nothing; e.g. not UTF-8: the row is then reported or skipped like any other).
ROW_COL, RAW_COL, ERR_COL = "_mt_row", "_mt_raw", "_mt_error"
ESCAPED_BYTE = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, decoded with errors="surrogateescape"
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of half a UTF-16 surrogate pair
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what json.loads leaves of such an escape without its other half


def invalid_text(text: str) -> str | None:
    """Why a string parsed from JSON is no text a tokenizer takes (an escaped half of a UTF-16 surrogate pair without
    its other half: not a character), or None."""
    lone = LONE_SURROGATE.search(text)
    return lone and (f"invalid text: the escape \\u{ord(lone.group()):04x} is half of a UTF-16 surrogate pair, "
                     f"without its other half: not a character")


@dataclass
class Source:
    key: str  # the config key that named it, for messages: data.path, data.datasets[1], ...
    name: str
    path: Path
    format: str
    columns: dict[str, str]  # every logical column of the format -> its name in the data
    roles: dict[str, str] = field(default_factory=dict)  # data role -> canonical role
    weight: float = 1.0
    num_samples: int | None = None
    sample_by: str = "line"
    split: str = "train"


@dataclass
class RawPart:
    """One file (or saved dataset) of a source, loaded by datasets."""

    source: Source
    file: Path
    dataset: Dataset
    identity: str  # changes whenever the file's content may have changed
    line_based: bool  # row numbers are line numbers (JSON lines, .txt by line)

    def where(self, row: int) -> str:
        return f"{self.file}:{row}" if self.line_based else f"{self.file} row {row}"


# ---- config -> sources -------------------------------------------------------------------------------------------
def _source(cfg: DataConfig, key: str, spec: DatasetSpec | None, path: str | None, registry) -> Source:
    """Merge an entry over the registry over the inline settings; fill every column and role default."""
    fields: dict = {}
    if spec is not None and spec.name is not None:
        reg_file, reg = registry
        if spec.name not in reg:
            import difflib

            close = difflib.get_close_matches(spec.name, list(reg), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise MegatrainError(f"{key}: dataset '{spec.name}' is not in {reg_file}{hint}")
        fields = from_registry(reg_file, reg[spec.name], spec.name)
    explicit = spec.model_dump(exclude_none=True) if spec is not None else {}
    if fields and (explicit.get("format") or cfg.format) == "prompt":
        fields = as_prompts(fields)
    fmt = explicit.get("format") or fields.get("format") or cfg.format
    inherits = "format" not in explicit and "format" not in fields
    columns = dict(DEFAULT_COLUMNS[fmt])
    columns.update(cfg.columns if inherits else {})
    columns.update(fields.get("columns", {}))
    columns.update(explicit.get("columns", {}))
    roles = dict(DEFAULT_ROLES.get(fmt, {}))
    roles.update(cfg.roles)
    roles.update(fields.get("roles", {}))
    roles.update(explicit.get("roles", {}))
    p = Path(explicit.get("path") or fields.get("path") or path).expanduser()
    name = explicit.get("name") or p.name
    return Source(key=key, name=name, path=p, format=fmt, columns=columns, roles=roles,
                  weight=explicit.get("weight", 1.0), num_samples=explicit.get("num_samples", fields.get("num_samples")),
                  sample_by=explicit.get("sample_by") or cfg.sample_by,
                  split=explicit.get("split") or fields.get("split") or cfg.split)


def resolve_sources(cfg: DataConfig, eval: bool = False) -> list[Source]:
    """The training (or evaluation) sources named by the config; [] when none is given."""
    inline, specs, key = (cfg.eval_path, cfg.eval_datasets, "data.eval_datasets") if eval else \
        (cfg.path, cfg.datasets, "data.datasets")
    if inline:
        return [_source(cfg, "data.eval_path" if eval else "data.path", None, inline, None)]
    registry = load_registry(cfg.dataset_info) if cfg.dataset_info and any(s.name for s in specs or []) else None
    return [_source(cfg, f"{key}[{i}]", s, None, registry) for i, s in enumerate(specs or [])]


def check_files(cfg: DataConfig, need: bool = True) -> list[Source]:
    """The training sources (with `need`, at least one) and every training and evaluation source's files, checked to
    exist and be readable data (source_files): what a run reads first, checked without importing torch or datasets.
    need=False: the command line's early check, which leaves "no data given" to come after the model's checks."""
    sources = resolve_sources(cfg)
    if need and not sources:
        raise MegatrainError("data.path: no training data given (set data.path or data.datasets)")
    for src in sources + resolve_sources(cfg, eval=True):
        source_files(src)
    return sources


# ---- source -> files ---------------------------------------------------------------------------------------------
def is_saved_dataset(p: Path) -> bool:
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def source_files(src: Source) -> list[Path]:
    """The files of a source (or [its folder] for a save_to_disk directory), checked to exist and be non-empty."""
    p = src.path
    if not p.exists():
        raise MegatrainError(f"{src.key}: {p} does not exist")
    if is_saved_dataset(p):
        return [p]
    if p.is_file():
        if p.suffix.lower() in COMPRESSED:
            raise MegatrainError(f"{src.key}: {p} is compressed; megatrain reads {', '.join(EXTENSIONS)} files: "
                                 f"decompress it")
        if p.suffix.lower() not in EXTENSIONS:
            raise MegatrainError(f"{src.key}: {p}: unsupported file type '{p.suffix}' "
                                 f"(supported: {', '.join(EXTENSIONS)})")
        files = [p]
    else:
        visible = [f for f in p.rglob("*")
                   if f.is_file() and not any(x.startswith(".") for x in f.relative_to(p).parts)]
        packed = sorted(f for f in visible if f.suffix.lower() in COMPRESSED)
        if packed:
            raise MegatrainError(f"{src.key}: {packed[0]} is compressed{_more(packed)}; megatrain reads "
                                 f"{', '.join(EXTENSIONS)} files: decompress it (or move it out of {p})")
        files = sorted(f for f in visible if f.suffix.lower() in EXTENSIONS and f.name != "dataset_info.json")
        if not files:
            raise MegatrainError(f"{src.key}: directory {p} holds no data files ({', '.join(EXTENSIONS)}) "
                                 f"and is not a datasets save_to_disk directory")
    for f in files:
        if f.stat().st_size == 0:
            raise MegatrainError(f"{src.key}: file {f} is empty")
        if not has_ink(f):
            raise MegatrainError(f"{src.key}: file {f} holds no rows (only blank lines)")
    return files


def has_ink(f: Path, chunk: int = 1 << 20) -> bool:
    """Whether a file holds a byte that is not white space (bytes.strip's): read until the first one, mostly the
    first chunk."""
    with open(f, "rb") as fh:
        while block := fh.read(chunk):
            if block.strip():
                return True
    return False


def _more(files: list) -> str:
    return f" (and {len(files) - 1} more)" if len(files) > 1 else ""


# ---- file -> raw dataset -----------------------------------------------------------------------------------------
def _json_rows(path: str):
    """Rows of a JSON array or JSON-lines file as JSON strings; a bad line becomes a row holding the bad text, a row
    whose bytes are not UTF-8 one holding the reason (never decoded with replacement characters)."""
    with open(path, "rb") as fh:
        head = fh.read(4096).lstrip()
    if head.startswith(b"["):  # one JSON array: it parses whole or not at all
        yield from _json_array_rows(path)
        return
    with open(path, "rb") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield {ROW_COL: n, RAW_COL: line.decode("utf-8").rstrip("\r\n"), ERR_COL: ""}
                except UnicodeDecodeError as e:
                    byte = line[e.start]
                    yield {ROW_COL: n, RAW_COL: "",
                           ERR_COL: f"not valid UTF-8 (byte 0x{byte:02x} at column {e.start + 1})"}


def _json_array_rows(path: str):
    data = Path(path).read_bytes()
    # bytes that are not UTF-8 become lone surrogates, so the array still parses and each item says if it has one
    text = data.decode("utf-8", errors="surrogateescape")
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        _raise_first_bad_byte(path, data, before_line=e.lineno)
        raise MegatrainError(f"{path}:{e.lineno}: malformed JSON: {e.msg}") from None
    except RecursionError:
        raise MegatrainError(f"{path}: malformed JSON: {TOO_DEEP}") from None
    if not items:
        raise MegatrainError(f"{path}: holds no rows (an empty JSON array)")
    if not ESCAPED_BYTE.search(text):
        halves = SURROGATE_ESCAPE.search(text)  # an escaped half of a surrogate pair, which Arrow cannot store alone
        for n, item in enumerate(items, 1):
            raw = json.dumps(item, ensure_ascii=False)
            if halves and LONE_SURROGATE.search(raw):
                raw = json.dumps(item)  # kept escaped: read_row names its row
            yield {ROW_COL: n, RAW_COL: raw, ERR_COL: ""}
        return
    # some item holds bytes that are not UTF-8: walk the array item by item to know where each one is
    dec, pos = json.JSONDecoder(), text.index("[") + 1
    for n in range(1, len(items) + 1):
        while text[pos] in " \t\r\n,":
            pos += 1
        item, end = dec.raw_decode(text, pos)
        bad = ESCAPED_BYTE.search(text, pos, end)
        if bad is None:
            yield {ROW_COL: n, RAW_COL: json.dumps(item, ensure_ascii=False), ERR_COL: ""}
        else:
            line = text.count("\n", 0, bad.start()) + 1
            yield {ROW_COL: n, RAW_COL: "",
                   ERR_COL: f"not valid UTF-8 (byte 0x{ord(bad.group()) - 0xDC00:02x} on line {line})"}
        pos = end


def _raise_first_bad_byte(path, data: bytes, before_line: int | None = None) -> None:
    """A file that cannot be parsed because of a byte that is not UTF-8 (at or before `before_line`, when given):
    the error names the file, line, column and byte offset."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, problem = utf8_problem(data, e.start)
        if before_line is None or line <= before_line:
            raise MegatrainError(f"{path}:{line}: {problem}; save the file as UTF-8") from None


def _scan_utf8(path: Path, chunk: int = 1 << 24) -> None:
    """Read a large text file in chunks of whole lines and raise at its first byte that is not UTF-8."""
    line, offset, rest = 1, 0, b""
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            data = rest + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            if block and cut == 0:  # no line end yet: read on
                rest = data
                continue
            data, rest = data[:cut], data[cut:]
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as e:
                at, problem = utf8_problem(data, e.start, offset)
                raise MegatrainError(f"{path}:{line + at - 1}: {problem}; save the file as UTF-8") from None
            line += data.count(b"\n")
            offset += len(data)
            if not block:
                return


def check_strings_utf8(part: RawPart) -> None:
    """Arrow string columns that did not pass through our reader (parquet files, saved datasets) can hold bytes that
    are not UTF-8, which would fail when a row is read: name the first such row and its column."""
    import pyarrow as pa

    table = part.dataset.data.table
    for name in table.column_names:
        start = 0
        for chunk in table.column(name).chunks:
            try:
                chunk.validate(full=True)
            except pa.ArrowInvalid as e:
                if "UTF8" not in str(e):
                    raise MegatrainError(f"{part.file}: column '{name}' is unreadable: {e}") from None
                lo, hi = 0, len(chunk)  # chunk[lo:hi] holds the first bad value: halve until one row is left
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    try:
                        chunk.slice(lo, mid - lo).validate(full=True)
                        lo = mid
                    except pa.ArrowInvalid:
                        hi = mid
                raise MegatrainError(f"{part.where(start + lo + 1)}: column '{name}' is not valid UTF-8; save the "
                                     f"file as UTF-8") from None
            start += len(chunk)


def _stamp(p: Path) -> str:
    """A file's identity for the caches: its path, size, modification time, and the inode and change time that an
    edit changes even where the modification time is set back (`touch -r`, `cp -p`, os.utime)."""
    st = p.stat()
    return f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"


def _cause(e: BaseException, kind: type = MegatrainError) -> BaseException | None:
    while e is not None:
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
    return None


def load_raw(src: Source, file: Path, cache_dir: str) -> RawPart:
    import datasets
    from datasets.exceptions import DatasetGenerationError

    kind = "saved" if is_saved_dataset(file) else EXTENSIONS[file.suffix.lower()]
    try:
        if kind == "saved":
            ds = datasets.load_from_disk(str(file))
            if isinstance(ds, datasets.DatasetDict):
                if src.split not in ds:
                    raise MegatrainError(f"{src.key}: {file} has no split '{src.split}' (it has: "
                                         f"{', '.join(ds)}); choose one with split:")
                ds = ds[src.split]
            meta = file / ("state.json" if (file / "state.json").is_file() else "dataset_dict.json")
            return RawPart(src, file, ds, f"saved|{src.split}|{ds._fingerprint}|{_stamp(meta)}", False)
        if kind == "json":
            ident = json_identity(file)
            ds = datasets.Dataset.from_generator(_json_rows, features=raw_features(), gen_kwargs={"path": str(file)},
                                                 cache_dir=cache_dir, fingerprint=f"megatrain-json-{ident}")
            return RawPart(src, file, ds, ident, file.suffix.lower() == ".jsonl" or not is_json_array(file))
        ident = f"{kind}|{READER_VERSION}|{src.sample_by}|{_stamp(file)}"
        # datasets keys its builders' cache on the file's modification time alone: a folder per identity instead
        own = Path(cache_dir) / "megatrain" / f"raw-{kind}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
        with quiet_datasets():
            ds = datasets.load_dataset(kind, data_files=str(file), split="train", cache_dir=str(own),
                                       **_builder_options(src, file, kind))
        return RawPart(src, file, ds, ident, kind == "text" and src.sample_by == "line")
    except MegatrainError:
        raise
    except Exception as e:  # datasets wraps reader errors; ours (a malformed JSON array) is inside
        inner = _cause(e)
        if inner is not None:
            raise MegatrainError(str(inner)) from None
        if _cause(e, UnicodeDecodeError) is not None and file.is_file():  # csv, txt: datasets decodes them
            _scan_utf8(file)
        if isinstance(e, DatasetGenerationError) and e.__cause__ is not None:  # the reader's own words (pandas:
            e = e.__cause__                                                    # "Expected 3 fields in line 3, saw 5")
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MegatrainError(f"{src.key}: cannot read {file}: {msg}") from None


def _builder_options(src: Source, file: Path, kind: str) -> dict:
    """The options of datasets' builder for a csv, parquet or text file; a file without rows is refused first.
    csv: every column read as text, as written: pandas would guess types per column (an answer "123" an int, a
    cell "NA", "None" or "null" missing), so an empty cell is an empty string. text: a leading byte order mark
    is not text (utf-8-sig drops it, as pandas does for csv)."""
    import datasets

    if kind == "text":
        return {"sample_by": src.sample_by, "encoding": "utf-8-sig"}
    if kind == "parquet":
        import pyarrow.parquet as pq

        if pq.ParquetFile(file).metadata.num_rows == 0:
            raise MegatrainError(f"{src.key}: file {file} holds no rows")
        return {}
    import pandas as pd

    head = pd.read_csv(file, nrows=1, dtype=str, na_filter=False)  # the header, and whether a row follows it
    if head.empty:
        raise MegatrainError(f"{src.key}: file {file} holds no rows (only its header)")
    return {"features": datasets.Features({c: datasets.Value("string") for c in head.columns}), "na_filter": False}


@contextmanager
def quiet_datasets():
    """datasets' logger silenced while a file is read: its readers log a failure ("Failed to read schema from ...")
    before raising it, and the raise is reported as the one error line. Progress bars are not logging: they stay."""
    from datasets.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def json_identity(file: Path) -> str:
    """A JSON or JSON-lines file's raw part's identity: changes whenever the file's content may have changed."""
    return hashlib.sha256(f"json|{READER_VERSION}|{_stamp(file)}".encode()).hexdigest()[:16]


def raw_features():
    """The columns of a raw part read by megatrain's JSON reader: line number, the line's text, why it is bad."""
    import datasets

    return datasets.Features({ROW_COL: datasets.Value("int64"), RAW_COL: datasets.Value("string"),
                              ERR_COL: datasets.Value("string")})


def is_json_array(file: Path) -> bool:
    with open(file, "rb") as fh:
        return fh.read(4096).lstrip().startswith(b"[")


# ---- what kind of data a config names (read with the config: nothing heavier than this module) ----------------
def is_preference(cfg: DataConfig) -> bool:
    """Whether the configured data is preference pairs: data.format preference, or a dataset (training or
    evaluation) that resolves to it (a dataset_info entry with "ranking": true). MegatrainError when a named
    registry or entry is missing."""
    return cfg.format == "preference" or any(s.format == "preference" for side in (False, True)
                                             for s in resolve_sources(cfg, eval=side))


def is_prompt(cfg: DataConfig) -> bool:
    """Whether the configured data is prompts: data.format prompt, or a dataset (training or evaluation) that
    resolves to it. MegatrainError when a named registry or entry is missing."""
    return cfg.format == "prompt" or any(s.format == "prompt" for side in (False, True)
                                         for s in resolve_sources(cfg, eval=side))
