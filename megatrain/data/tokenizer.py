"""Loading the run's tokenizer, and what about it decides how data is tokenised (its fingerprint)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from ..errors import MegatrainError, load_json, read_text


# Files of a tokenizer folder that transformers parses as JSON, and text files it reads (all checked first, so a broken
# one is named with its line instead of surfacing as whatever transformers makes of it).
JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "chat_template.json")
TEXT_FILES = ("chat_template.jinja", "merges.txt", "vocab.txt")


def load_tokenizer(path: str | Path, key: str = "tokenizer"):
    """AutoTokenizer from a local folder, with one-line errors that name the folder (and the file and line); key:
    the config key that gave the folder, named when it is missing."""
    from transformers import AutoTokenizer

    p = Path(path).expanduser()
    if p.is_file():
        raise MegatrainError(f"{key}: {p} is a file; expected a directory of tokenizer files")
    if not p.is_dir():
        raise MegatrainError(f"{key}: directory {p} does not exist")
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                                           "vocab.json", "vocab.txt")):
        raise MegatrainError(f"tokenizer: {p} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...)")
    for name in JSON_FILES + TEXT_FILES:
        f = p / name
        if not f.is_file():
            continue
        try:
            load_json(f) if name in JSON_FILES else read_text(f)
        except MegatrainError as e:
            raise MegatrainError(f"tokenizer: cannot load the tokenizer in {p}: {name}{str(e)[len(str(f)):]}") \
                from None
    custom = custom_code(p)
    try:  # never the folder's own Python: with trust_remote_code unset transformers would ask on a terminal
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for broken tokenizers
        if custom:
            raise MegatrainError(f"tokenizer: {p} asks for custom code ({custom}), which megatrain never runs, and "
                                 f"transformers' own classes cannot load it") from None
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MegatrainError(f"tokenizer: cannot load the tokenizer in {p}: {msg}") from None
    if custom:
        print(f"megatrain: tokenizer: {p} asks for custom code ({custom}); it was not run: transformers' own "
              f"{type(tok).__name__} loaded the folder", file=sys.stderr)
    return tok


def custom_code(folder: Path) -> str | None:
    """What a model or tokenizer folder asks to run of its own code (`auto_map` in tokenizer_config.json or
    config.json, a class in one of its .py files), or None."""
    for name in ("tokenizer_config.json", "config.json"):
        f = folder / name
        if not f.is_file():
            continue
        try:
            auto_map = load_json(f).get("auto_map")
        except (MegatrainError, AttributeError):
            continue  # a broken file is reported by whatever reads it
        if auto_map:
            refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
            return f"auto_map in {name}: {', '.join(refs[:2]) or auto_map}"
    return None


def read_chat_template(template: str) -> str:
    """`data.chat_template`: the template itself, or a file holding one (read strictly as UTF-8)."""
    if "{" in template:
        return template
    f = Path(template).expanduser()
    if f.is_dir():
        raise MegatrainError(f"data.chat_template: {f} is a directory; expected a Jinja file (or the template itself)")
    if not f.is_file():
        raise MegatrainError(f"data.chat_template: file {f} does not exist (or give the template itself)")
    try:
        text = read_text(f)
    except MegatrainError as e:
        raise MegatrainError(f"data.chat_template: {e}") from None
    if not text.strip():  # set on the tokenizer, it would read as no template at all
        raise MegatrainError(f"data.chat_template: file {f} is empty")
    return text


def apply_chat_template_override(tokenizer, template: str | None) -> None:
    """Set `data.chat_template` (a template or a file holding one) on the run's tokenizer, so exports carry it."""
    if template:
        tokenizer.chat_template = read_chat_template(template)


def pad_id(tokenizer) -> int:
    """Token used to fill padding (never attended to, never a label, so any valid id works)."""
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if t is not None:
            return int(t)
    return 0


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of everything in the tokenizer that changes token ids: vocabulary, merges, normaliser, special tokens,
    BOS/EOS handling and the chat template. Part of the tokenisation cache key."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow tokenizer: let datasets hash the whole object
        from datasets.fingerprint import Hasher

        h.update(Hasher.hash(tokenizer).encode())
    extra = {
        "class": type(tokenizer).__name__,
        "chat_template": tokenizer.chat_template,
        "special": {k: str(v) for k, v in sorted(tokenizer.special_tokens_map.items())},
        "added": sorted((str(k), int(v)) for k, v in tokenizer.get_added_vocab().items()),
        "bos": getattr(tokenizer, "add_bos_token", None),
        "eos": getattr(tokenizer, "add_eos_token", None),
        "split_special": getattr(tokenizer, "split_special_tokens", None),  # special tokens' text as plain text
        "encode_special": getattr(backend, "encode_special_tokens", None),
    }
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]



MIN_ROW_TOKENS = 4096  # the least a row is tokenised to (rounded up to a power of two: see row_tokens)
CHARS_PER_TOKEN_FIRST = 4  # the first prefix tried: this many characters a token; doubled until it is enough


def row_tokens(max_seq_len: int) -> int:
    """Tokens a row is tokenised to at most, before truncation: max_seq_len and a margin (so that where the text
    was cut never reaches the kept tokens), rounded up to a power of two of at least MIN_ROW_TOKENS, so that a
    change of data.max_seq_len within one power of two (every value up to 4,080) does not tokenise the data
    again (the bound is part of the cache's fingerprint)."""
    need = max(max_seq_len + 16, MIN_ROW_TOKENS)
    return 1 << (need - 1).bit_length()
