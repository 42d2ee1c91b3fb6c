"""Preference pairs: a row of (prompt, chosen, rejected) -> a pair sample -> the token ids and labels of both sides.

The layouts of a row (data.format: preference; every column remappable with data.columns):
    strings    {"prompt": str, "chosen": str, "rejected": str}: the chat template's user turn and assistant turn
    messages   prompt: a list of messages (a system message and earlier turns honoured); chosen and rejected: a list
               holding the assistant message(s), one message object, or a string
    implicit   no prompt column (or a string prompt beside message lists, as in ultrafeedback_binarized): the prompt
               is the messages that chosen and rejected share at their start, as TRL's maybe_extract_prompt does
    LLaMA-Factory `"ranking": true` entries (sources.py): alpaca layout (instruction and input [+ history] -> the user
               turn, chosen and rejected strings), sharegpt layout (conversations -> the prompt, chosen and rejected
               message objects)
The two sides share one prompt: after it (and the messages they share at their start) each side starts with its
assistant reply. Sides whose messages before their first reply differ were written for different prompts: a row
error, since a pair conditioned on two prompts teaches no preference between the replies.
A system column adds a system message. Without a chat template (a base model's tokenizer) string pairs are
prompt + completion + EOS, as SFT's prompt_completion.

Each side is the prompt followed by one completion; its labels are the completion's tokens (the template's reply with
its end-of-turn marker), -100 elsewhere. Sides are cached whole (up to tokenizer.row_tokens from each end); the cut
to data.max_seq_len happens after the cache (preference_examples.py), so changing it does not tokenise again.
"""

from __future__ import annotations

from .config import CANONICAL_ROLES
from .encode import read_row
from .formats import Columns, RowError, alpaca_turns, parse_messages, parse_tools, with_system
from .template import IGNORE, EncodeOptions, chat_pieces, cut_pieces, tokenize_pieces, with_trained_eos
from .tokenizer import CHARS_PER_TOKEN_FIRST

PAIR_ENCODER_VERSION = "pair-3"  # bump when the encoding of a pair changes
SIDES = ("chosen", "rejected")
_ANY_ROLE = {r: r for r in CANONICAL_ROLES}


def pair_features():
    import datasets

    seq = datasets.Sequence(datasets.Value("int32"))
    cols = {f"{s}_{k}": seq for s in SIDES for k in ("ids", "labels")}
    cols.update({f"{s}_{k}": datasets.Value("int32") for s in SIDES for k in ("length", "prompt")})
    cols.update(row=datasets.Value("int64"), error=datasets.Value("string"), length=datasets.Value("int32"),
                num_targets=datasets.Value("int32"), cut_chars=datasets.Value("int64"))
    return datasets.Features(cols)


# ---- a row -> a pair sample --------------------------------------------------------------------------------------
def _completion(c: Columns, key: str, roles: dict) -> str | list[dict]:
    v = c.get(key)
    if isinstance(v, str):
        return v
    if isinstance(v, dict):  # one message object (LLaMA-Factory's sharegpt layout)
        v = [v]
    if not isinstance(v, list):
        raise RowError(f"column {c.name(key)} must be a string, a message or a list of messages, got "
                       f"{type(v).__name__}")
    try:
        return parse_messages(v, c, roles, keep_extra=True)
    except RowError as e:
        raise RowError(f"column {c.name(key)}: {e}") from None


def _as_messages(v: str | list[dict]) -> list[dict]:
    return [{"role": "assistant", "content": v}] if isinstance(v, str) else v


def _check_completion(c: Columns, key: str, msgs: list[dict]) -> None:
    replies = [m for m in msgs if m["role"] == "assistant"]
    if not replies:
        raise RowError(f"column {c.name(key)}: the completion has no assistant message")
    if not any(m["content"].strip() or m.get("tool_calls") for m in replies):
        raise RowError(f"empty completion (column {c.name(key)})")


def _shared_start(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _first_reply(msgs: list[dict]) -> int:
    return next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))


def to_pair(row, columns: dict[str, str], roles: dict[str, str]) -> dict:
    """One row -> {"prompt": [messages], "chosen": [messages], "rejected": [messages], "tools": list | None,
    "plain": (prompt, chosen, rejected) strings for a tokenizer without a chat template, or None}. RowError names
    the column at fault."""
    c = Columns(row, "preference", columns)
    roles = {**_ANY_ROLE, **roles}
    chosen, rejected = _completion(c, "chosen", roles), _completion(c, "rejected", roles)
    if _as_messages(chosen) == _as_messages(rejected):
        raise RowError(f"chosen and rejected are identical (columns {c.name('chosen')} and {c.name('rejected')})")
    prompt, parsed, plain = c.get("prompt", required=False), False, None
    if isinstance(chosen, list) and isinstance(rejected, list) and not isinstance(prompt, list):
        n = _shared_start(chosen, rejected)  # the implicit prompt: the messages both sides start with
        if n:
            prompt, chosen, rejected, parsed = chosen[:n], chosen[n:], rejected[n:], True
    ch, rj = _as_messages(chosen), _as_messages(rejected)
    _check_completion(c, "chosen", ch)
    _check_completion(c, "rejected", rj)
    lead = _first_reply(ch)  # the turns before each side's first reply belong to the prompt: the same on both sides
    if ch[:lead] != rj[:_first_reply(rj)]:
        raise RowError(f"chosen and rejected have different prompts (columns {c.name('chosen')} and "
                       f"{c.name('rejected')}: the messages before their first assistant reply differ)")
    shared, ch, rj = ch[:lead], ch[lead:], rj[lead:]
    if prompt is None:
        c.get("prompt")  # raises: missing column
    if isinstance(prompt, str):
        msgs = alpaca_turns(c, "prompt")  # the user turn (with data.columns' input and history, LLaMA-Factory's)
        if len(msgs) == 1 and isinstance(chosen, str) and isinstance(rejected, str):
            plain = (msgs[0]["content"], chosen, rejected)
    elif isinstance(prompt, list):
        if not prompt:
            raise RowError(f"empty prompt (column {c.name('prompt')})")
        try:
            msgs = prompt if parsed else parse_messages(prompt, c, roles, keep_extra=True)
        except RowError as e:
            raise RowError(f"column {c.name('prompt')}: {e}") from None
    else:
        raise RowError(f"column {c.name('prompt')} must be a string or a list of messages, got "
                       f"{type(prompt).__name__}")
    system = c.text("system", False)
    if system and system.strip():
        plain = None  # a system prompt needs the chat template
    msgs = with_system(msgs + shared, system)
    return {"prompt": msgs, "chosen": ch, "rejected": rj, "tools": parse_tools(c.get("tools", False)),
            "plain": plain}


# ---- a pair sample -> tokens -------------------------------------------------------------------------------------
def first_label(labels) -> int:
    """Index of the first token with a label (len(labels) when none)."""
    return next((i for i, x in enumerate(labels) if x != IGNORE), len(labels))


def side_tokens(tok, pieces: list[tuple[str, bool]], add_special_tokens: bool, max_tokens: int):
    """(ids, labels, characters left untokenised) of a side's pieces. A long side is tokenised only as far as
    max_tokens from each end that truncation keeps: the prompt's last and the completion's first tokens (prefixes
    and suffixes of CHARS_PER_TOKEN_FIRST x max_tokens characters, doubled until they hold enough; see
    template.bounded)."""
    first = next((i for i, (_, t) in enumerate(pieces) if t), len(pieces))
    head, rest = "".join(t for t, _ in pieces[:first]), pieces[first:]
    n_rest = sum(len(t) for t, _ in rest)
    k = CHARS_PER_TOKEN_FIRST * max_tokens
    while max_tokens and rest and k < max(len(head), n_rest):
        cl, cr = max(0, len(head) - k), max(0, n_rest - k)
        ids, labels = tokenize_pieces(tok, [(head[cl:], False)] + cut_pieces(rest, k), add_special_tokens and not cl)
        p = first_label(labels)
        if (not cl or p >= max_tokens) and (not cr or len(ids) - p >= max_tokens):
            return ids, labels, cl + cr
        k *= 2
    return (*tokenize_pieces(tok, pieces, add_special_tokens), 0)


def encode_pair(tok, pair: dict, opts: EncodeOptions) -> dict:
    """A pair sample -> the columns of pair_features() (but row and error)."""
    out = {"cut_chars": 0, "num_targets": 0}
    for side in SIDES:
        if tok.chat_template:
            pieces = chat_pieces(tok, pair["prompt"] + pair[side], pair["tools"], len(pair["prompt"]),
                                 opts.mask_history)
            ids, labels, cut = side_tokens(tok, pieces, False, opts.max_tokens)  # (the template writes BOS)
        elif pair["plain"] is None:
            raise RowError("message lists, a system prompt or history are rendered with the chat template, but the "
                           "tokenizer has none; set data.chat_template")
        else:
            prompt, completion = pair["plain"][0], pair["plain"][1 + SIDES.index(side)]
            ids, labels, cut = side_tokens(tok, [(prompt, False), (completion, True)], True, opts.max_tokens)
            ids, labels = with_trained_eos(ids, labels, tok.eos_token_id, opts.add_eos)
        if labels:
            labels[0] = IGNORE  # nothing predicts the first token
        p = first_label(labels)
        if p == len(labels):
            raise RowError(f"the {side} completion has no token to learn (the chat template renders no reply)")
        out.update({f"{side}_ids": ids, f"{side}_labels": labels, f"{side}_length": len(ids), f"{side}_prompt": p})
        out["cut_chars"] += cut
        out["num_targets"] += sum(1 for x in labels if x != IGNORE)
    if not out["cut_chars"] and all(out[f"chosen_{k}"] == out[f"rejected_{k}"] for k in ("ids", "labels")):
        raise RowError("chosen and rejected give the same tokens (the chat template renders them alike): the pair "
                       "holds no preference")
    out["length"] = max(out["chosen_length"], out["rejected_length"])
    return out


def _bad(row_no: int, msg: str) -> dict:
    out = {f"{s}_{k}": [] for s in SIDES for k in ("ids", "labels")}
    out.update({f"{s}_{k}": 0 for s in SIDES for k in ("length", "prompt")})
    return {**out, "row": row_no, "error": msg, "length": 0, "num_targets": 0, "cut_chars": 0}


def encode_pair_row(raw: dict, index: int, *, tok, fmt: str, columns: dict, roles: dict, blank_ok: bool,
                    opts: EncodeOptions) -> dict:
    """One raw row -> its tokenised pair (encode.tokenise's encoder for preference data). Module level, so `map`
    can send it to worker processes."""
    row_no, row, err = read_row(raw, index)
    if err:
        return _bad(row_no, err)
    try:
        if fmt != "preference":
            raise RowError(f"format '{fmt}' is not preference data")
        return {**encode_pair(tok, to_pair(row, columns, roles), opts), "row": row_no, "error": ""}
    except RowError as e:
        return _bad(row_no, str(e))
    except Exception as e:  # anything else a strange row provokes (the template, the tokenizer): name it
        return _bad(row_no, f"{type(e).__name__}: {e}".splitlines()[0])
