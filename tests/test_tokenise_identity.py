"""Tokenising in batches (encode.encode_rows: the rows' texts through the Rust tokenizer together, the chat template
rendered by template.chat_pieces) gives every row exactly the columns of the straightforward per-row encoding it
replaced, kept here as the reference (`ref_*`: tok(...) with offsets per row, the template rendered per call, one
`map` call per row): input_ids, labels, row, error, length, num_targets and cut_chars, for every format, loss-mask
option, length bound (max_tokens, split), bad row, tokenizer kind (BOS from the post-processor or not, truncation
or special-token splitting set on the backend, a class that changes the call, a slow one) and process count."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_fixtures.helpers import tokenizer

from megatrain.data.config import DEFAULT_COLUMNS, DEFAULT_ROLES
from megatrain.data.encode import encode_row, encode_rows, read_row, tokenise
from megatrain.data.formats import RowError, to_sample
from megatrain.data.sources import ERR_COL, RAW_COL, ROW_COL, RawPart, Source
from megatrain.data.template import IGNORE, EncodeOptions, backend, tokenize_pieces


# ---- the reference: the per-row encoding as it was ----------------------------------------------------------------
def ref_render(tok, messages, tools, generation_prompt):
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RowError(f"the chat template rejected this conversation: {msg}") from None


def ref_check_tools(tok, messages, tools=None):
    def render(msgs, t=tools):
        return ref_render(tok, msgs, t, False)

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


def ref_chat_pieces(tok, messages, tools=None, loss_from=0, mask_history=False):
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        ref_check_tools(tok, messages, tools)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= loss_from]
    trained = set(replies[-1:] if mask_history else replies)
    pieces, done, done_what = [], "", "nothing"

    def extend(text, what, train):
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
        extend(ref_render(tok, messages[:i], tools, True), f"messages 1-{i} with the generation prompt", False)
        extend(ref_render(tok, messages[: i + 1], tools, False), f"messages 1-{i + 1}", i in trained)
    if len(done) == 0 or messages[-1]["role"] != "assistant":
        extend(ref_render(tok, messages, tools, False), f"messages 1-{len(messages)}", False)
    return [(t, tr) for t, tr in pieces if t]


def ref_tokenize_pieces(tok, pieces, add_special_tokens):
    text = "".join(t for t, _ in pieces)
    if not getattr(tok, "is_fast", False):
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
    cum = np.cumsum(char_trained)
    off = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    hit = cum[off[:, 1]] - cum[off[:, 0]] > 0 if len(ids) else np.zeros(0, dtype=bool)
    return ids, [i if h else IGNORE for i, h in zip(ids, hit.tolist())]


def ref_cut_pieces(pieces, chars):
    out, left = [], chars
    for t, train in pieces:
        if left <= 0:
            break
        out.append((t[:left], train))
        left -= len(t)
    return out


def ref_bounded(tokenise, n_chars, max_tokens):
    k = 4 * max_tokens
    while max_tokens and k < n_chars:
        out = tokenise(k)
        if len(out[0]) >= max_tokens:
            return out, n_chars - k
        k *= 2
    return tokenise(n_chars), 0


def ref_text_ids(tok, text, opts):
    def ids_of(t, first=True):
        return list(tok(t, add_special_tokens=first)["input_ids"])

    if opts.split and opts.max_tokens:
        m = 4 * opts.max_tokens
        return [i for k in range(0, len(text), m) for i in ids_of(text[k: k + m], k == 0)], 0
    (ids,), cut = ref_bounded(lambda k: (ids_of(text[:k]),), len(text), opts.max_tokens)
    return ids, cut


def ref_encode_counted(tok, sample, opts):
    kind, eos = sample["kind"], tok.eos_token_id
    if kind == "text":
        ids, cut = ref_text_ids(tok, sample["text"], opts)
        if opts.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        labels = list(ids)
    elif kind == "completion":
        pieces = [(sample["prompt"], opts.train_on_prompt), (sample["completion"], True)]
        (ids, labels), cut = ref_bounded(lambda k: ref_tokenize_pieces(tok, ref_cut_pieces(pieces, k), True),
                                         sum(len(t) for t, _ in pieces), opts.max_tokens)
        if opts.add_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
            labels.append(eos)
    else:
        pieces = ref_chat_pieces(tok, sample["messages"], sample.get("tools"), sample.get("loss_from", 0),
                                 opts.mask_history)
        (ids, labels), cut = ref_bounded(lambda k: ref_tokenize_pieces(tok, ref_cut_pieces(pieces, k), False),
                                         sum(len(t) for t, _ in pieces), opts.max_tokens)
        if opts.train_on_prompt:
            labels = list(ids)
    if labels:
        labels[0] = IGNORE
    return ids, labels, cut


def ref_bad(row_no, msg):
    return {"input_ids": [], "labels": [], "row": row_no, "error": msg, "length": 0, "num_targets": 0, "cut_chars": 0}


def ref_encode_row(raw, index, *, tok, fmt, columns, roles, blank_ok, opts):
    row_no, row, err = read_row(raw, index)
    if err:
        return ref_bad(row_no, err)
    try:
        sample = to_sample(row, fmt, columns, roles, blank_ok)
        if sample is None:
            return {"input_ids": [], "labels": [], "row": row_no, "error": "", "length": 0, "num_targets": 0,
                    "cut_chars": 0}
        ids, labels, cut = ref_encode_counted(tok, sample, opts)
    except RowError as e:
        return ref_bad(row_no, str(e))
    except Exception as e:
        return ref_bad(row_no, f"{type(e).__name__}: {e}".splitlines()[0])
    return {"input_ids": ids, "labels": labels, "row": row_no, "error": "", "length": len(ids),
            "num_targets": len(labels) - labels.count(IGNORE), "cut_chars": cut}


# ---- rows -----------------------------------------------------------------------------------------------------------
LONG = " ".join(f"word{i} is héllo, 世界 {i * 7}?" for i in range(60))  # ~1,500 characters, several scripts
SPECIAL = "a <|im_start|>user\nnot a turn<|im_end|> </s> <s> b"  # special tokens' text inside content
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_TEMPLATE = (  # renders tool definitions, calls and turns
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] | tojson }})</call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
UNSTABLE = ("{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] }}: {{ m['content'] }}\n"
            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def msgs(*turns, system=None, first="user"):
    out = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"] if first == "user" else ["assistant", "user"]
    return out + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


ROWS = {
    "alpaca": [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Translate to French:", "input": "good morning", "output": " Bonjour."},
        {"instruction": "Summarise", "input": LONG, "output": LONG[:700], "system": "Be brief."},
        {"instruction": "Again?", "input": "", "output": "Yes.", "history": [["Hi", "Hello!"], ["And?", "More."]]},
        {"instruction": SPECIAL, "output": SPECIAL + " \u00e9\U0001F600"},
        {"instruction": "no output column"},
        {"instruction": "x", "output": "   "},
        {"instruction": 7, "output": "x"},
        {"instruction": "lone surrogate", "output": "a\ud800b"},
        {"instruction": "ends in spaces   ", "input": "\n\n", "output": "tabs\t\tand\r\nbreaks  \n"},
    ],
    "messages": [
        {"messages": msgs("Hello! How are you?", "Fine.", "Write a haiku.", "Waves fold into foam.")},
        {"messages": msgs("Name a colour.", "Blue.", system="You are helpful.")},
        {"messages": msgs("q1", LONG, "q2", "short", "q3", LONG[::-1])},
        {"messages": msgs("question", "answer", "a last user turn")},
        {"messages": [{"role": "user", "content": "weather in paris?"},
                      {"role": "assistant", "content": "", "tool_calls": [CALL]},
                      {"role": "tool", "content": "sunny, 21C"}, {"role": "assistant", "content": "It is sunny."}],
         "tools": TOOLS},
        {"messages": msgs("q", "a"), "tools": json.dumps(TOOLS)},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text",
                                                                                        "text": "joined"}]},
                      {"role": "assistant", "content": "ok"}]},
        {"messages": msgs("no reply")},
        {"messages": msgs("q", "")},
        {"messages": [{"role": "wizard", "content": "?"}]},
        {"messages": "not a list"},
        {"messages": msgs(SPECIAL, SPECIAL)},
    ],
    "sharegpt": [
        {"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Tell me a joke."},
                           {"from": "gpt", "value": "Why did the chicken cross the road?"}]},
        {"conversations": [{"from": "human", "value": "Add 2 and 3."}, {"from": "gpt", "value": "Five."},
                           {"from": "human", "value": "Count:"}, {"from": "gpt", "value": LONG}]},
        {"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "call()"},
                           {"from": "observation", "value": "result"}, {"from": "gpt", "value": "done"}]},
    ],
    "prompt_completion": [
        {"prompt": "The capital of France is", "completion": " Paris."},
        {"prompt": LONG, "completion": LONG[:300]},
        {"prompt": "", "completion": "only a completion"},
        {"prompt": [{"role": "user", "content": "Name a colour."}],
         "completion": [{"role": "assistant", "content": "Green."}]},
        {"prompt": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}],
         "completion": [{"role": "assistant", "content": "a2"}], "system": "ignored: there is one"},
        {"prompt": "x", "completion": " "},
        {"prompt": "x", "completion": ["mixed"]},
        {"prompt": SPECIAL, "completion": SPECIAL + "\ud800"},
    ],
    "text": [
        {"text": "The quick brown fox jumps over the lazy dog."},
        {"text": LONG + "\n" + LONG},
        {"text": "  \n "},
        {"text": SPECIAL + "</s>"},
        {"text": ["not", "a string"]},
        {"text": "x\ud800"},
        {"text": "é"},
    ],
}
OPTIONS = [EncodeOptions(), EncodeOptions(train_on_prompt=True, add_eos=False),
           EncodeOptions(mask_history=True, max_tokens=40), EncodeOptions(max_tokens=6),
           EncodeOptions(max_tokens=6, split=True), EncodeOptions(max_tokens=300, split=True, mask_history=True)]


def raw_rows(fmt: str) -> list[dict]:
    """The format's rows as megatrain's JSON reader gives them, with a line of bad JSON and one of bad bytes."""
    lines = [json.dumps(r) for r in ROWS[fmt]]
    out = [{ROW_COL: i + 1, RAW_COL: s, ERR_COL: ""} for i, s in enumerate(lines)]
    out.insert(3, {ROW_COL: 90, RAW_COL: '{"oops": ', ERR_COL: ""})
    out.insert(5, {ROW_COL: 91, RAW_COL: "", ERR_COL: "bytes that are not UTF-8 at byte 3"})
    return out


def kwargs(tok, fmt, opts, blank_ok=False):
    return dict(tok=tok, fmt=fmt, columns=DEFAULT_COLUMNS[fmt], roles=DEFAULT_ROLES.get(fmt, {}), blank_ok=blank_ok,
                opts=opts)


def batch_of(raws: list[dict]) -> dict:
    return {k: [r[k] for r in raws] for k in raws[0]}


def rows_of(cols: dict) -> list[dict]:
    n = len(next(iter(cols.values())))
    return [{k: v[j] for k, v in cols.items()} for j in range(n)]


# ---- tokenizers -----------------------------------------------------------------------------------------------------
def plain(template=None):
    tok = tokenizer()
    if template:
        tok.chat_template = template
    return tok


def no_bos():
    from tokenizers import processors

    tok = tokenizer()
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def truncating():  # tokenizer.json may carry truncation and padding; tok(...) clears them before it encodes
    tok = tokenizer()
    tok.backend_tokenizer.enable_truncation(5)
    tok.backend_tokenizer.enable_padding(length=64)
    return tok


def splitting():  # split_special_tokens: tok(...) sets it on the backend before it encodes
    tok = tokenizer()
    tok.split_special_tokens = True
    return tok


def lowering():  # a class of its own that changes the call: always called as tok(...)
    tok = tokenizer()
    base = type(tok)

    class Lower(base):
        def _encode_plus(self, text, *a, **kw):
            return base._encode_plus(self, text.lower() if isinstance(text, str) else text, *a, **kw)

    tok.__class__ = Lower
    return tok


TOKENIZERS = {"plain": plain, "tools": lambda: plain(TOOL_TEMPLATE), "unstable": lambda: plain(UNSTABLE),
              "no_bos": no_bos, "truncating": truncating, "splitting": splitting, "lowering": lowering}


@pytest.mark.parametrize("which", sorted(TOKENIZERS))
@pytest.mark.parametrize("fmt", sorted(ROWS))
def test_batches_give_each_rows_reference_columns(which, fmt):
    """Every option, the rows in one batch and in batches of 3, with threads and without, and one row at a time;
    each against a reference on its own tokenizer object (tok(...) changes the backend's settings)."""
    raws = raw_rows(fmt)
    for opts in OPTIONS:
        ref_tok, tok = TOKENIZERS[which](), TOKENIZERS[which]()
        want = [ref_encode_row(r, i, **kwargs(ref_tok, fmt, opts, fmt == "text")) for i, r in enumerate(raws)]
        assert any(w["error"] for w in want) and (which == "unstable" or any(w["length"] for w in want))
        kw = kwargs(tok, fmt, opts, fmt == "text")
        assert rows_of(encode_rows(batch_of(raws), list(range(len(raws))), threads=True, **kw)) == want, opts
        for threads in (False, True):
            got = [r for s in range(0, len(raws), 3)
                   for r in rows_of(encode_rows(batch_of(raws[s: s + 3]), list(range(s, s + len(raws[s: s + 3]))),
                                                threads=threads, **kw))]
            assert got == want, opts
        assert [encode_row(r, i, **kw) for i, r in enumerate(raws)] == want, opts


def test_the_reference_covers_the_cases():
    """The rows above reach what they are meant to: bounded and split texts, cut rows, errors of the tokenizer,
    of the template and of the rows, tools rendered, special tokens split or not."""
    tok = tokenizer()
    cut = ref_encode_row(raw_rows("alpaca")[2], 2, **kwargs(tok, "alpaca", EncodeOptions(max_tokens=6)))
    assert cut["cut_chars"] > 0 and cut["length"] >= 6 and not cut["error"]
    errors = {w["error"].split(":")[0] for fmt in ROWS for i, r in enumerate(raw_rows(fmt))
              for w in [ref_encode_row(r, i, **kwargs(tokenizer(), fmt, EncodeOptions(), fmt == "text"))]}
    assert {"invalid text", "malformed JSON", "bytes that are not UTF-8 at byte 3", "empty assistant turn (message 2)",
            "the chat template does not render the tools column (the tool definitions); the model would not see "
            "them"} <= errors
    tools = ref_encode_row(raw_rows("messages")[6], 6, **kwargs(plain(TOOL_TEMPLATE), "messages", EncodeOptions()))
    assert not tools["error"] and tools["num_targets"] > 0
    unstable = ref_encode_row(raw_rows("messages")[0], 0, **kwargs(plain(UNSTABLE), "messages", EncodeOptions()))
    assert unstable["error"].startswith("the chat template is not prefix-stable")
    assert backend(tokenizer()) is not None and backend(no_bos()) is not None and backend(lowering()) is None
    assert backend(truncating()) is None and backend(splitting()) is None  # (until tok(...) has reset them)
    split = [ref_encode_row(raw_rows("text")[4], 4, **kwargs(t, "text", EncodeOptions()))["input_ids"]
             for t in (tokenizer(), splitting())]
    assert split[0] != split[1]


class CharTokenizer:
    """A slow (not fast) tokenizer: one id per character, BOS first; transformers' PythonBackend."""

    @staticmethod
    def make():
        from transformers import PythonBackend

        class Chars(PythonBackend):
            vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(c): c + 3 for c in range(32, 0x3000)}}

            def get_vocab(self):
                return dict(self.vocab)

            @property
            def vocab_size(self):
                return len(self.vocab)

            def _tokenize(self, text, **kw):
                return list(text)

            def _convert_token_to_id(self, token):
                return self.vocab.get(token, 0)

            def _convert_id_to_token(self, index):
                return next((k for k, v in self.vocab.items() if v == index), "<pad>")

            def build_inputs_with_special_tokens(self, a, b=None):
                return [1] + a + (b or [])

        tok = Chars(bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        tok.chat_template = tokenizer().chat_template
        return tok


@pytest.mark.parametrize("fmt", ["alpaca", "prompt_completion", "text"])
def test_a_slow_tokenizer_is_encoded_as_before(fmt):
    raws = raw_rows(fmt)
    for opts in OPTIONS[:4]:
        ref_tok, tok = CharTokenizer.make(), CharTokenizer.make()
        assert not tok.is_fast
        want = [ref_encode_row(r, i, **kwargs(ref_tok, fmt, opts, fmt == "text")) for i, r in enumerate(raws)]
        assert any(not w["error"] and w["length"] > 3 for w in want)
        got = rows_of(encode_rows(batch_of(raws), list(range(len(raws))), threads=True,
                                  **kwargs(tok, fmt, opts, fmt == "text")))
        assert got == want


def part_of(tmp_path, fmt: str, rows: list[dict], name: str) -> RawPart:
    import datasets

    src = Source(key="data.path", name=name, path=tmp_path / name, format=fmt, columns=DEFAULT_COLUMNS[fmt],
                 roles=DEFAULT_ROLES.get(fmt, {}))
    return RawPart(src, tmp_path / name, datasets.Dataset.from_list(rows), f"test|{name}", True)


@pytest.mark.parametrize("num_proc", [None, 2])
def test_tokenise_gives_the_reference_rows(tmp_path, num_proc):
    """Through datasets.map, in this process (the Rust tokenizer on its threads) or two: megatrain's JSON reader's
    rows, and rows whose columns datasets read itself (parquet, csv, saved datasets)."""
    opts = EncodeOptions(max_tokens=40)
    raws = [r for _ in range(7) for r in raw_rows("alpaca")]  # several batches' worth with num_proc 2
    plain_rows = [r for r in ROWS["alpaca"] if isinstance(r.get("instruction"), str) and "output" in r
                  and "\ud800" not in r["output"]]  # (Arrow stores no lone surrogate; only JSON escapes give one)
    plain_rows = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]}
                  for r in plain_rows] * 5
    for name, rows in (("json", raws), ("columns", plain_rows)):
        part = part_of(tmp_path, "alpaca", rows, name)
        tok = tokenizer()
        got = tokenise(part, tok, opts, str(tmp_path / "cache"), num_proc, fail_fast=False).to_list()
        ref_tok = tokenizer()
        want = [ref_encode_row(dict(r), i, **kwargs(ref_tok, "alpaca", opts)) for i, r in enumerate(rows)]
        assert got == want


@pytest.mark.parametrize("which", ["plain", "no_bos", "splitting", "lowering"])
def test_tokenize_pieces_is_the_reference(which):
    """What preference pairs and bounded rows tokenise piece-wise: empty, one, and many pieces, trained or not."""
    ref_tok, tok = TOKENIZERS[which](), TOKENIZERS[which]()
    cases = [[], [("", True)], [("a", True)], [("Hello", False), (" world", True)], [(SPECIAL, True), (LONG, False)],
             [("x", False), ("", True), ("é世", True), ("\U0001F600 y", False), (LONG[:99], True)]]
    for pieces in cases:
        for special in (True, False):
            assert tokenize_pieces(tok, pieces, special) == ref_tokenize_pieces(ref_tok, pieces, special)


def test_other_encoders_map_in_batches_as_row_by_row(tmp_path):
    """tokenise's other encoders (preference pairs here) run row by row inside each batch: each row's own columns."""
    from megatrain.data.preference import encode_pair_row, pair_features

    rows = [{"prompt": "Name a colour.", "chosen": "Blue.", "rejected": "Loud."},
            {"prompt": LONG, "chosen": LONG[:200], "rejected": "no"}, {"prompt": "x"},
            {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
             "rejected": [{"role": "assistant", "content": "b"}]}] * 3
    raws = [{ROW_COL: i + 1, RAW_COL: json.dumps(r), ERR_COL: ""} for i, r in enumerate(rows)]
    opts = EncodeOptions(max_tokens=300)
    part = part_of(tmp_path, "preference", raws, "pairs")
    got = tokenise(part, tokenizer(), opts, str(tmp_path / "cache"), None, fail_fast=False, encoder=encode_pair_row,
                   features=pair_features).to_list()
    tok = tokenizer()
    want = [encode_pair_row(r, i, **kwargs(tok, "preference", opts)) for i, r in enumerate(raws)]
    assert got == want and any(w["error"] for w in want) and any(not w["error"] for w in want)


@pytest.mark.parametrize("threads,chars", [(False, None), (True, None), (True, 60)])
def test_rows_tokenised_whole_come_from_the_batch_itself(monkeypatch, threads, chars):
    """The rows above match the reference through the batch's own encodings, not through the row-alone fallback
    (which would match too); chars: the texts handed to the tokenizer at once (template.BATCH_CHARS)."""
    import megatrain.data.template as template

    def alone(*a, **kw):
        raise AssertionError("tokenised alone")

    for fmt in ROWS:
        for opts in (EncodeOptions(), EncodeOptions(train_on_prompt=True, mask_history=True, max_tokens=4096)):
            raws = raw_rows(fmt)[:3]
            want = [ref_encode_row(r, i, **kwargs(tokenizer(), fmt, opts, fmt == "text")) for i, r in enumerate(raws)]
            assert not any(w["error"] for w in want) and sum(w["length"] > 0 for w in want) >= 2
            tok = tokenizer()
            monkeypatch.setattr(template, "_encode_planned", alone)
            if chars:
                monkeypatch.setattr(template, "BATCH_CHARS", chars)
            kw = kwargs(tok, fmt, opts, fmt == "text")
            got = rows_of(encode_rows(batch_of(raws), [0, 1, 2], threads=threads, **kw))
            monkeypatch.undo()
            assert got == want
