"""Samples -> token ids and labels, through the tokenizer's own chat template.

Conversations are rendered incrementally: for each assistant turn i, the text of messages[:i] with the generation
prompt must be a prefix of the text of messages[:i+1], and each render a prefix of the next. The difference is the
assistant's reply as the template writes it (content plus its end-of-turn marker). The whole conversation is then
tokenised once, as `apply_chat_template(tokenize=True)` would at inference, and a token carries a label when its
characters overlap a reply that is trained on. A template that renders earlier turns differently later (not
prefix-stable) is reported instead of silently mislabelled.

Labels follow Hugging Face: unshifted, -100 where no loss. The first token of every example is -100 as well: it
has no predecessor in its document, so nothing predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..errors import MegatrainError
from .formats import RowError

IGNORE = -100


@dataclass(frozen=True)
class EncodeOptions:
    train_on_prompt: bool = False
    mask_history: bool = False
    add_eos: bool = True
    max_tokens: int = 0  # a row is tokenised only as far as this many tokens (0: whole; tokenizer.row_tokens)
    split: bool = False  # data.overlong split: a longer text is tokenised in pieces, none lost


def _render(tok, messages: list[dict], tools, generation_prompt: bool) -> str:
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template), TypeError, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RowError(f"the chat template rejected this conversation: {msg}") from None


PROBE = [{"role": "user", "content": "Hi"}]


def check_chat_template(tok, origin: str) -> str | None:
    """The tokenizer's chat template, rendered on one user turn with and without the generation prompt before any
    row is: a Jinja syntax error is a MegatrainError naming `origin` (where the template came from) and its line,
    not every row's error. Returns a warning when both renderings are equal (add_generation_prompt ignored): the
    role header the template writes before a reply (`assistant: `) is then part of the reply, so its loss trains
    it. A warning, not a refusal: with such a template, inference too gets no header, and the model must write it
    itself, which is what this loss teaches; a user who wants it masked gives a template that writes a generation
    prompt. A template that refuses this turn is judged on the rows themselves."""
    import jinja2

    t = tok.chat_template
    if not (isinstance(t, str) or isinstance(t, dict) and all(isinstance(v, str) for v in t.values())):
        raise MegatrainError(f"{origin}: expected a Jinja template (a string), got {type(t).__name__}")
    try:
        with_prompt, without = (tok.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=gp)
                                for gp in (True, False))
    except jinja2.TemplateSyntaxError as e:
        raise MegatrainError(f"{origin}: line {e.lineno}: not a valid Jinja template: {e.message}") from None
    except Exception:
        return None
    if with_prompt != without:
        return None
    return ("warning: the chat template ignores add_generation_prompt (a user turn renders the same with and "
            "without it), so the role header it writes before each assistant reply is trained with the reply; "
            "set data.chat_template to a template that writes a generation prompt to leave the header out of the loss")


def check_tools_rendered(tok, messages: list[dict], tools=None, prefix=None) -> None:
    """Tool definitions, an assistant's tool calls and tool turns must reach what the model sees: a template that
    leaves them out (its render is the same without them) would drop them silently, and train an empty reply where
    the assistant only called a tool. RowError naming the message. prefix(n, generation_prompt, tools): the
    rendering of messages[:n] (chat_pieces's, which renders them again)."""
    def render(msgs, t=tools):
        return _render(tok, msgs, t, False)

    prefix = prefix or (lambda n, gp, t=tools: _render(tok, messages[:n], t, gp))
    if tools and prefix(len(messages), False) == prefix(len(messages), False, None):
        raise RowError("the chat template does not render the tools column (the tool definitions); the model would "
                       "not see them: use a template that renders tools (data.chat_template)")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            without = dict(m)
            del without["tool_calls"]
            if prefix(i + 1, False) == render(messages[:i] + [without]):
                raise RowError(f"message {i + 1}: the chat template does not render the assistant's tool_calls; the "
                               f"model would not see them and would learn "
                               f"{'an empty reply' if not m['content'].strip() else 'the reply without them'}: use a "
                               f"template that renders tool calls (data.chat_template)")
        elif m["role"] == "tool":
            changed = dict(m, content=m["content"] + " (changed)")
            if prefix(i + 1, False) == render(messages[:i] + [changed]):
                raise RowError(f"message {i + 1}: the chat template does not render tool turns (role 'tool'); the "
                               f"model would not see the tool's answer: use a template that renders them "
                               f"(data.chat_template)")


def chat_pieces(tok, messages: list[dict], tools=None, loss_from: int = 0,
                mask_history: bool = False) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces; trained pieces are assistant replies.
    Tools, tool calls and tool turns are checked to be rendered first (check_tools_rendered)."""
    renders: dict = {}

    def prefix(n: int, generation_prompt: bool, t=tools) -> str:  # the rendering of messages[:n], once
        key = (n, generation_prompt, t is None)
        if key not in renders:
            renders[key] = _render(tok, messages[:n], t, generation_prompt)
        return renders[key]

    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        check_tools_rendered(tok, messages, tools, prefix)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= loss_from]
    trained = set(replies[-1:] if mask_history else replies)
    pieces: list[tuple[str, bool]] = []
    done, done_what = "", "nothing"

    def extend(text: str, what: str, train: bool):
        nonlocal done, done_what
        if not text.startswith(done):
            raise RowError(f"the chat template is not prefix-stable: the rendering of {done_what} is not a prefix "
                           f"of the rendering of {what}, so turns cannot be masked; use a template that renders "
                           f"earlier turns unchanged (data.chat_template)")
        pieces.append((text[len(done):], train))
        done, done_what = text, what

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0 and 0 in trained:  # no rendering of "nothing yet" says where the reply starts in the template's text
            raise RowError("the conversation opens with an assistant turn: nothing prompts its reply, so where the "
                           "reply starts in the chat template's text is unknown; start with a user or system turn")
        if i == 0:  # an untrained opening reply: context, rendered with what follows it
            continue
        extend(prefix(i, True), f"messages 1-{i} with the generation prompt", False)
        extend(prefix(i + 1, False), f"messages 1-{i + 1}", i in trained)
    if len(done) == 0 or messages[-1]["role"] != "assistant":
        extend(prefix(len(messages), False), f"messages 1-{len(messages)}", False)
    return [(t, tr) for t, tr in pieces if t]


def tokenize_pieces(tok, pieces: list[tuple[str, bool]], add_special_tokens: bool) -> tuple[list[int], list[int]]:
    """Tokenise the concatenated pieces in one call; a token is labelled if it overlaps a trained piece."""
    text = "".join(t for t, _ in pieces)
    if not getattr(tok, "is_fast", False):  # no offsets: tokenise piece by piece (may differ at piece borders)
        ids, labels = [], []
        for k, (t, train) in enumerate(pieces):
            part = tok(t, add_special_tokens=add_special_tokens and k == 0)["input_ids"]
            ids += part
            labels += part if train else [IGNORE] * len(part)
        return ids, labels
    enc = _encode(tok, text, add_special_tokens)
    if enc is not None:
        ids = enc.ids
        return ids, encoding_labels(pieces, ids, enc)
    enc = tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    return ids, piece_labels(pieces, ids, enc["offset_mapping"])


def encoding_labels(pieces: list[tuple[str, bool]], ids: list[int], enc) -> list[int]:
    """piece_labels for a Rust Encoding `enc` of the pieces' text, without turning every token's offsets into Python
    tuples (most of a row's labelling time): the tokens overlapping a trained piece run from the token of its first
    character to that of its last (Encoding.char_to_token), widened over the neighbours that overlap it as well (the
    tokens of one character: byte fallback). piece_labels over all offsets where a piece's end character has no
    token (a normalizer removed it)."""
    n, labels, pos = len(ids), [IGNORE] * len(ids), 0

    def overlaps(k: int, a: int, b: int) -> bool:
        span = enc.token_to_chars(k)  # (start, end); a special token the post-processor added: (0, 0) or None
        return span is not None and span[0] < span[1] and span[0] < b and span[1] > a

    for text, train in pieces:
        a = pos
        b = pos = pos + len(text)
        if not train or a == b:
            continue
        first, last = enc.char_to_token(a), enc.char_to_token(b - 1)
        if first is None or last is None:
            return piece_labels(pieces, ids, enc.offsets)
        while first > 0 and overlaps(first - 1, a, b):
            first -= 1
        while last + 1 < n and overlaps(last + 1, a, b):
            last += 1
        labels[first: last + 1] = ids[first: last + 1]
    return labels


def piece_labels(pieces: list[tuple[str, bool]], ids: list[int], offsets) -> list[int]:
    """The labels of the tokens `ids` of the pieces' text, whose (start, end) characters are `offsets`: a token's id
    where its characters overlap a trained piece, IGNORE elsewhere."""
    char_trained = np.zeros(sum(len(t) for t, _ in pieces) + 1, dtype=np.int64)
    pos = 0
    for t, train in pieces:
        if train:
            char_trained[pos + 1: pos + len(t) + 1] = 1
        pos += len(t)
    cum = np.cumsum(char_trained)  # cum[j] = trained characters among text[:j]
    n = len(ids)
    off = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * n).reshape(-1, 2)
    hit = np.zeros(n + 2, dtype=bool)
    hit[1: n + 1] = cum[off[:, 1]] > cum[off[:, 0]]
    edges = np.flatnonzero(hit[1:] != hit[:-1]).tolist()  # where runs of labelled tokens start and end
    labels = [IGNORE] * n
    for a, b in zip(edges[::2], edges[1::2]):
        labels[a:b] = ids[a:b]
    return labels


# The steps of transformers' own call tok(text, ...) -> backend.encode_batch([text]) (transformers 4 and 5): where a
# class overrides one, or one is replaced (a spy), it may change the text or the result, so tok(...) is called.
_BASE_MODULES = ("transformers.tokenization_utils_base", "transformers.tokenization_utils_fast",
                 "transformers.tokenization_utils_tokenizers")
_CALL_PATH = ("__call__", "_call_one", "encode_plus", "_encode_plus", "_batch_encode_plus",
              "set_truncation_and_padding", "_convert_encoding")


def _plain_call_path(cls: type) -> bool:
    return all(getattr(getattr(cls, name, None), "__module__", _BASE_MODULES[0]) in _BASE_MODULES
               for name in _CALL_PATH)


def backend(tok):
    """The Rust tokenizer of a fast tokenizer where tok(text, add_special_tokens=a) gives exactly its
    encode(text, add_special_tokens=a)'s ids and offsets (what tok(...) calls, less transformers' per-call work):
    transformers' own call path, no truncation or padding set on the backend (tok(...) clears them first), special
    tokens split as tok(...) would set. Else None (tokenise with tok(...))."""
    b = getattr(tok, "_tokenizer", None) if getattr(tok, "is_fast", False) else None
    if (b is None or b.truncation is not None or b.padding is not None or hasattr(tok, "_switch_to_input_mode")
            or getattr(b, "encode_special_tokens", False) != bool(getattr(tok, "split_special_tokens", False))):
        return None
    return b if _plain_call_path(type(tok)) else None


def _encode(tok, text: str, add_special_tokens: bool):
    """backend(tok).encode(text), or None: no such backend, or it raised (tok(...) then raises its own error)."""
    b = backend(tok)
    if b is None:
        return None
    try:
        return b.encode(text, add_special_tokens=add_special_tokens)
    except Exception:
        return None


def cut_pieces(pieces: list[tuple[str, bool]], chars: int) -> list[tuple[str, bool]]:
    """The pieces' first `chars` characters."""
    out, left = [], chars
    for t, train in pieces:
        if left <= 0:
            break
        out.append((t[:left], train))
        left -= len(t)
    return out


def bounded(tokenise, n_chars: int, max_tokens: int):
    """tokenise(k) -> (ids, ...) of the first k characters of a row of n_chars. The row is tokenised as far as
    max_tokens tokens, never whole when a prefix holds them: prefixes of CHARS_PER_TOKEN_FIRST x max_tokens
    characters, doubled until one yields max_tokens tokens (a 50 MB row tokenised whole took ~23 GB). Returns
    (tokenise's result, characters cut)."""
    from .tokenizer import CHARS_PER_TOKEN_FIRST

    k = CHARS_PER_TOKEN_FIRST * max_tokens
    while max_tokens and k < n_chars:
        out = tokenise(k)
        if len(out[0]) >= max_tokens:
            return out, n_chars - k
        k *= 2
    return tokenise(n_chars), 0


def _text_ids(tok, text: str, opts: EncodeOptions) -> tuple[list[int], int]:
    """A text's token ids, tokenised as far as opts.max_tokens (see bounded), or with opts.split in pieces of
    CHARS_PER_TOKEN_FIRST x max_tokens characters, none lost (a piece's border may tokenise differently from the
    whole). (ids, characters cut)."""
    from .tokenizer import CHARS_PER_TOKEN_FIRST

    def ids_of(t: str, first: bool = True) -> list[int]:
        enc = _encode(tok, t, first)
        return enc.ids if enc is not None else list(tok(t, add_special_tokens=first)["input_ids"])

    if opts.split and opts.max_tokens:
        m = CHARS_PER_TOKEN_FIRST * opts.max_tokens
        return [i for k in range(0, len(text), m) for i in ids_of(text[k: k + m], k == 0)], 0
    (ids,), cut = bounded(lambda k: (ids_of(text[:k]),), len(text), opts.max_tokens)
    return ids, cut


def encode(tok, sample: dict, opts: EncodeOptions) -> tuple[list[int], list[int]]:
    """A sample (see formats.py) -> (input_ids, labels)."""
    ids, labels, _ = encode_counted(tok, sample, opts)
    return ids, labels


def encode_counted(tok, sample: dict, opts: EncodeOptions) -> tuple[list[int], list[int], int]:
    """A sample (see formats.py) -> (input_ids, labels, characters cut before tokenising: EncodeOptions.max_tokens)."""
    return _encode_planned(tok, sample, opts, _plan(tok, sample, opts))


def _plan(tok, sample: dict, opts: EncodeOptions) -> tuple[list[tuple[str, bool]], bool]:
    """What a sample's tokens are of: its (text, trained) pieces (a chat rendered here) and add_special_tokens."""
    kind = sample["kind"]
    if kind == "text":
        return [(sample["text"], True)], True
    if kind == "completion":
        return [(sample["prompt"], opts.train_on_prompt), (sample["completion"], True)], True
    return chat_pieces(tok, sample["messages"], sample.get("tools"), sample.get("loss_from", 0),
                       opts.mask_history), False  # (the template writes BOS)


def _encode_planned(tok, sample: dict, opts: EncodeOptions, plan) -> tuple[list[int], list[int], int]:
    pieces, special = plan
    if sample["kind"] == "text":
        (ids, cut), labels = _text_ids(tok, sample["text"], opts), None
    else:
        (ids, labels), cut = bounded(lambda k: tokenize_pieces(tok, cut_pieces(pieces, k), special),
                                     sum(len(t) for t, _ in pieces), opts.max_tokens)
    return (*_finish(tok, sample["kind"], ids, labels, opts), cut)


def _finish(tok, kind: str, ids: list[int], labels: list[int] | None, opts: EncodeOptions):
    """A sample's (input_ids, labels) from its tokens (and their labels, but for text): EOS, the first label."""
    eos = tok.eos_token_id
    if kind == "text":
        if opts.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        labels = list(ids)
    elif kind == "completion":
        ids, labels = with_trained_eos(ids, labels, eos, opts.add_eos)
    elif opts.train_on_prompt:
        labels = list(ids)
    if labels:
        labels[0] = IGNORE
    return ids, labels


def with_trained_eos(ids: list[int], labels: list[int], eos: int | None, add_eos: bool):
    """A completion's (ids, labels) ending in a trained EOS when add_eos: appended, or, where the tokenizer's
    post-processor appended it (Llama's add_eos_token: a token of no characters, so no label), labelled."""
    if add_eos and eos is not None:
        if not ids or ids[-1] != eos:
            ids, labels = ids + [eos], labels + [eos]
        elif labels[-1] == IGNORE:
            labels = labels[:-1] + [eos]
    return ids, labels


BATCH_CHARS = 1 << 21  # characters handed to the Rust tokenizer at once: their Encodings (~100 bytes a token)


def encode_many(tok, samples: list, opts: EncodeOptions, threads: bool = False) -> list:
    """encode_counted of each sample (None for None), or the exception it raised. The texts of the samples that are
    tokenised whole (all but those over CHARS_PER_TOKEN_FIRST x opts.max_tokens characters) go to the Rust tokenizer
    together, BATCH_CHARS at most at once (backend(tok); threads: its encode_batch, on this process's cores, else one
    after another); a text it fails on is tokenised again alone, as encode_counted would."""
    from .tokenizer import CHARS_PER_TOKEN_FIRST

    b, limit = backend(tok), CHARS_PER_TOKEN_FIRST * opts.max_tokens
    out, whole = [None] * len(samples), {True: [], False: []}  # add_special_tokens -> [(sample index, plan, text)]
    for i, s in enumerate(samples):
        if s is None:
            continue
        try:
            plan = _plan(tok, s, opts)
            text = "".join(t for t, _ in plan[0])
            if b is not None and text and (not limit or len(text) <= limit):  # bounded() tokenises these whole
                whole[plan[1]].append((i, plan, text))
            else:
                out[i] = _encode_planned(tok, s, opts, plan)
        except Exception as e:
            out[i] = e
    for special, items in whole.items():
        for chunk in _chunks(items):
            texts = [t for _, _, t in chunk]
            try:
                encs = b.encode_batch(texts, add_special_tokens=special) if threads else \
                    [b.encode(t, add_special_tokens=special) for t in texts]
            except Exception:
                encs = [None] * len(chunk)
            for (i, plan, _), enc in zip(chunk, encs):
                out[i] = _encoded(tok, samples[i], opts, plan, enc)
    return out


def _chunks(items: list) -> list[list]:
    """items (.., .., text) in consecutive runs of BATCH_CHARS characters at most (or one item)."""
    out, chars = [[]], 0
    for it in items:
        if out[-1] and chars + len(it[2]) > BATCH_CHARS:
            out.append([])
            chars = 0
        out[-1].append(it)
        chars += len(it[2])
    return out if out[-1] else []


def _encoded(tok, sample: dict, opts: EncodeOptions, plan, enc):
    """encode_counted's result for a sample tokenised whole into the Encoding enc (None: its batch failed)."""
    kind = sample["kind"]
    if enc is not None:
        try:
            ids = enc.ids
            labels = None if kind == "text" else encoding_labels(plan[0], ids, enc)
            return (*_finish(tok, kind, ids, labels, opts), 0)
        except Exception:
            pass
    try:  # alone, as encode_counted would: its error is the row's
        return _encode_planned(tok, sample, opts, plan)
    except Exception as e:
        return e
