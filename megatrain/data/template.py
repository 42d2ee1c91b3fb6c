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

import numpy as np

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


def check_tools_rendered(tok, messages: list[dict], tools=None) -> None:
    """Tool definitions, an assistant's tool calls and tool turns must reach what the model sees: a template that
    leaves them out (its render is the same without them) would drop them silently, and train an empty reply where
    the assistant only called a tool. RowError naming the message."""
    def render(msgs, t=tools):
        return _render(tok, msgs, t, False)

    if tools and render(messages) == render(messages, None):
        raise RowError("the chat template does not render the tools column (the tool definitions); the model would "
                       "not see them: use a template that renders tools (data.chat_template)")
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("tool_calls"):
            without = dict(m)
            del without["tool_calls"]
            if render(messages[: i + 1]) == render(messages[:i] + [without]):
                raise RowError(f"message {i + 1}: the chat template does not render the assistant's tool_calls; the "
                               f"model would not see them and would learn "
                               f"{'an empty reply' if not m['content'].strip() else 'the reply without them'}: use a "
                               f"template that renders tool calls (data.chat_template)")
        elif m["role"] == "tool":
            changed = dict(m, content=m["content"] + " (changed)")
            if render(messages[: i + 1]) == render(messages[:i] + [changed]):
                raise RowError(f"message {i + 1}: the chat template does not render tool turns (role 'tool'); the "
                               f"model would not see the tool's answer: use a template that renders them "
                               f"(data.chat_template)")


def chat_pieces(tok, messages: list[dict], tools=None, loss_from: int = 0,
                mask_history: bool = False) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces; trained pieces are assistant replies.
    Tools, tool calls and tool turns are checked to be rendered first (check_tools_rendered)."""
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        check_tools_rendered(tok, messages, tools)
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
        extend(_render(tok, messages[:i], tools, True), f"messages 1-{i} with the generation prompt", False)
        extend(_render(tok, messages[: i + 1], tools, False), f"messages 1-{i + 1}", i in trained)
    if len(done) == 0 or messages[-1]["role"] != "assistant":
        extend(_render(tok, messages, tools, False), f"messages 1-{len(messages)}", False)
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
    enc = tok(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    char_trained = np.zeros(len(text) + 1, dtype=np.int64)
    pos = 0
    for t, train in pieces:
        if train:
            char_trained[pos + 1: pos + len(t) + 1] = 1
        pos += len(t)
    cum = np.cumsum(char_trained)  # cum[j] = trained characters among text[:j]
    off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    hit = cum[off[:, 1]] - cum[off[:, 0]] > 0 if len(ids) else np.zeros(0, dtype=bool)
    labels = [i if h else IGNORE for i, h in zip(ids, hit.tolist())]
    return ids, labels


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
        return list(tok(t, add_special_tokens=first)["input_ids"])

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
    kind = sample["kind"]
    eos = tok.eos_token_id
    if kind == "text":
        ids, cut = _text_ids(tok, sample["text"], opts)
        if opts.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        labels = list(ids)
    elif kind == "completion":
        pieces = [(sample["prompt"], opts.train_on_prompt), (sample["completion"], True)]
        (ids, labels), cut = bounded(lambda k: tokenize_pieces(tok, cut_pieces(pieces, k), add_special_tokens=True),
                                     sum(len(t) for t, _ in pieces), opts.max_tokens)
        if opts.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos)
    else:
        pieces = chat_pieces(tok, sample["messages"], sample.get("tools"), sample.get("loss_from", 0),
                             opts.mask_history)
        (ids, labels), cut = bounded(lambda k: tokenize_pieces(tok, cut_pieces(pieces, k), add_special_tokens=False),
                                     sum(len(t) for t, _ in pieces), opts.max_tokens)  # (the template writes BOS)
        if opts.train_on_prompt:
            labels = list(ids)
    if labels:
        labels[0] = IGNORE
    return ids, labels, cut
