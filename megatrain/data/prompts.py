"""Prompts for online RL (data.format prompt, train.objective grpo): rows -> tokenised prompts -> a seeded order of
prompts that resumes exactly.

The layouts of a row (every column remappable with data.columns, as for the other formats):
    {"prompt": str}                the user turn (with data.columns' input and history, LLaMA-Factory's alpaca)
    {"prompt": [messages]}         the conversation so far (a system message and earlier turns honoured)
    {"messages": [messages]}       the same; a conversation of SFT data, its last assistant turn (the reference
                                   answer) dropped
plus any other fields, which the rewards read (the row is handed to them whole). A system column adds a system
message; a tools column is rendered by the template. The prompt is the chat template's rendering with the generation
prompt added (what `tokenizer.apply_chat_template(messages, add_generation_prompt=True)` gives); a tokenizer without
a chat template takes a string prompt as plain text (its BOS as the tokenizer adds it). LLaMA-Factory registry
entries are read as prompts too (sources.py: alpaca, sharegpt and ranking entries give their prompt side).

Prompts are tokenised once and cached like SFT rows (encode.py). A prompt longer than data.max_seq_len -
grpo.max_new_tokens, a malformed row, or a row a built-in reward cannot score (rl.rewards.row_problem: a missing
answer column) is one error naming its file and row; with data.skip_bad_rows they are skipped and counted
(data.overlong: drop also drops over-long prompts). The order is sampler.py's: each source's quota per epoch,
shuffled with the seed; the state is (epoch, cursor). Several ranks draw the same prompts and each keeps its block
(sampler.rank_share), so the ranks' prompts of a rollout batch are disjoint and together what one process draws.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from ..errors import MegatrainError
from .config import DataConfig
from .encode import read_row
from .examples import Counts, Examples, Part, load_parts, no_examples
from .formats import Columns, RowError, alpaca_turns, parse_messages, parse_tools, with_system
from .sampler import BatchShape, EpochPlanner, rank_share
from .sources import ERR_COL, RAW_COL, ROW_COL, resolve_sources
from .template import EncodeOptions, bounded, check_tools_rendered
from .tokenizer import apply_chat_template_override, row_tokens

PROMPT_ENCODER_VERSION = "prompt-2"  # bump when the encoding of a prompt changes
SHOWN = 3  # skipped rows named in the summary


@dataclass
class PromptRow:
    index: int  # the prompt's index in its set: rows in file order, bad and skipped rows left out
    ids: list[int]  # the tokenised prompt (chat template with the generation prompt)
    text: str  # what was tokenised
    row: dict  # the data row, every column (the rewards read it)
    where: str  # file:line (or file row N)


def prompt_features():
    import datasets

    return datasets.Features({"ids": datasets.Sequence(datasets.Value("int32")), "text": datasets.Value("string"),
                              "row": datasets.Value("int64"), "error": datasets.Value("string"),
                              "length": datasets.Value("int32"), "cut_chars": datasets.Value("int64")})


# ---- a row -> a prompt -> tokens -------------------------------------------------------------------------------
def to_prompt(row, columns: dict[str, str], roles: dict[str, str]) -> dict:
    """One row -> {"messages": [...], "tools": list | None, "plain": the prompt string for a tokenizer without a
    chat template, or None}. RowError names the column at fault."""
    c = Columns(row, "prompt", columns)
    prompt, plain = c.get("prompt", required=False), None
    if prompt is None:
        if c.get("messages", required=False) is None:
            raise RowError(f"missing column {c.name('prompt')} (or {c.name('messages')}) needed by format 'prompt'")
        msgs = parse_messages(c.get("messages"), c, roles, keep_extra=True)
    elif isinstance(prompt, str):
        msgs = alpaca_turns(c, "prompt")
        plain = msgs[0]["content"] if len(msgs) == 1 else None
    elif isinstance(prompt, list):
        try:
            msgs = parse_messages(prompt, c, roles, keep_extra=True)
        except RowError as e:
            raise RowError(f"column {c.name('prompt')}: {e}") from None
    else:
        raise RowError(f"column {c.name('prompt')} must be a string or a list of messages, got "
                       f"{type(prompt).__name__}")
    if msgs and msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]  # the reference answer of a conversation: the completion is sampled in its place
    if not any(m["content"].strip() for m in msgs if m["role"] != "system"):
        raise RowError("empty prompt (no user turn with text before the completion)")
    system = c.text("system", False)
    if system and system.strip():
        plain = None  # a system prompt needs the chat template
    return {"messages": with_system(msgs, system), "tools": parse_tools(c.get("tools", False)), "plain": plain}


def render_prompt(tok, messages: list[dict], tools=None) -> str:
    """The chat template's rendering of a conversation with the generation prompt added."""
    try:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja2 TemplateError (raise_exception in the template), TypeError, ...
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RowError(f"the chat template rejected this prompt: {msg}") from None


def encode_prompt(tok, prompt: dict, max_tokens: int) -> tuple[list[int], str, int]:
    """A prompt -> (ids, the text tokenised, characters left untokenised: a prompt is tokenised only as far as
    max_tokens, which is already too long; template.bounded)."""
    if tok.chat_template:
        msgs, tools = prompt["messages"], prompt["tools"]
        if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
            check_tools_rendered(tok, msgs, tools)
        text, special = render_prompt(tok, msgs, tools), False  # (the template writes BOS)
    elif prompt["plain"] is None:
        raise RowError("message lists, a system prompt or history are rendered with the chat template, but the "
                       "tokenizer has none; set data.chat_template")
    else:
        text, special = prompt["plain"], True
    (ids,), cut = bounded(lambda k: (list(tok(text[:k], add_special_tokens=special)["input_ids"]),), len(text),
                          max_tokens)
    eos = tok.eos_token_id
    if special and ids and ids[-1] == eos and not (tok.eos_token and text[: len(text) - cut].endswith(tok.eos_token)):
        ids = ids[:-1]  # the tokenizer's post-processor ends text in EOS (add_eos_token): a completion follows
    return ids, text[: len(text) - cut], cut


def _bad(row_no: int, msg: str) -> dict:
    return {"ids": [], "text": "", "row": row_no, "error": msg, "length": 0, "cut_chars": 0}


def encode_prompt_row(raw: dict, index: int, *, tok, fmt: str, columns: dict, roles: dict, blank_ok: bool,
                      opts: EncodeOptions) -> dict:
    """One raw row -> its tokenised prompt (encode.tokenise's encoder for prompt data). Module level, so `map` can
    send it to worker processes."""
    row_no, row, err = read_row(raw, index)
    if err:
        return _bad(row_no, err)
    try:
        if fmt != "prompt":
            raise RowError(f"format '{fmt}' is not prompt data")
        ids, text, cut = encode_prompt(tok, to_prompt(row, columns, roles), opts.max_tokens)
    except RowError as e:
        return _bad(row_no, str(e))
    except Exception as e:  # anything else a strange row provokes (the template, the tokenizer): name it
        return _bad(row_no, f"{type(e).__name__}: {e}".splitlines()[0])
    return {"ids": ids, "text": text, "row": row_no, "error": "", "length": len(ids), "cut_chars": cut}


# ---- the prompts of a run --------------------------------------------------------------------------------------
def check_prompts(cfg: DataConfig) -> None:
    """Prompt data is prompts only (training and evaluation)."""
    for s in resolve_sources(cfg) + resolve_sources(cfg, eval=True):
        if s.format != "prompt":
            raise MegatrainError(f"{s.key}: format '{s.format}' is not prompt data; train.objective grpo samples "
                                 f"completions for prompts only (format: prompt)")


@dataclass
class PromptCounts(Counts):
    too_long: int = 0  # prompts longer than max_seq_len - max_new_tokens, skipped or dropped
    limit: int = 0  # that bound
    unscorable: int = 0  # rows a built-in reward cannot score, skipped


def _raw_rows(part: Part, rows: np.ndarray):
    """(row index, the row as the rewards see it) for the given rows of a part, read in batches."""
    ds = part.raw.dataset
    for a in range(0, len(rows), 1024):
        idx = rows[a: a + 1024].tolist()
        batch = ds.select(idx).to_dict() if len(idx) else {}
        for j, i in enumerate(idx):
            raw = {k: v[j] for k, v in batch.items()}
            if RAW_COL in raw:
                yield i, json.loads(raw[RAW_COL])
            else:
                yield i, {k: v for k, v in raw.items() if k not in (ROW_COL, ERR_COL)}


class Prompts:
    """The prompts of one side (train or eval). Prompt k is row row[k] of parts[part[k]] (tokens and raw alike)."""

    quotas = Examples.quotas  # prompts drawn per epoch from each source

    def __init__(self, sources, parts: list[Part], part, row, source, lengths, counts: PromptCounts):
        self.sources, self.parts, self.counts = sources, parts, counts
        self.part, self.row, self.source, self.lengths = part, row, source, lengths
        self._views = [p.tokens.with_format("numpy", columns=["ids"]) for p in parts]

    def __len__(self) -> int:
        return len(self.row)

    def where(self, k: int) -> str:
        p = self.parts[self.part[k]]
        return p.raw.where(p.tokens[int(self.row[k])]["row"])

    def get(self, k: int) -> PromptRow:
        p, r = self.parts[self.part[k]], int(self.row[k])
        ids = self._views[self.part[k]][r]["ids"].astype(np.int64).tolist()
        (_, row), = _raw_rows(p, np.asarray([r]))
        return PromptRow(int(k), ids, p.tokens[r]["text"], row, self.where(k))

    def fingerprint(self) -> str:
        """Changes whenever any prompt's tokens or index may: the tokenised files and which rows are the prompts."""
        h = hashlib.sha256()
        for p in self.parts:
            h.update(str([f["filename"].rsplit("/", 1)[-1] for f in p.tokens.cache_files]).encode())
        for a in (self.part, self.row):
            h.update(np.ascontiguousarray(a, dtype=np.int64).tobytes())
        return h.hexdigest()[:16]


def _skip(cfg: DataConfig, counts: PromptCounts, where: str, msg: str, hint: str) -> None:
    if not cfg.skip_bad_rows:
        raise MegatrainError(f"{where}: {msg} ({hint})")
    if len(counts.bad_examples) < SHOWN:
        counts.bad_examples.append(f"{where}: {msg}")


def _sections(cfg) -> tuple[DataConfig, object | None]:
    """(the data section, the grpo section or None) of a megatrain Config, or of a bare DataConfig."""
    return (cfg, None) if isinstance(cfg, DataConfig) else (cfg.data, cfg.grpo)


def build_prompts(cfg, tok, side: str = "train") -> Prompts:
    """Load, tokenise (cached) and select the prompts of `side` ("train" or "eval") of a megatrain Config (its
    data and grpo sections; a bare DataConfig: no completion is counted against data.max_seq_len, no reward checks
    a row); MegatrainError for a bad, over-long or unscorable row (unless skipped) or when no prompt is left."""
    from ..rl.config import FIELD_REWARDS
    from ..rl.rewards import row_problem

    d, g = _sections(cfg)
    check_prompts(d)
    limit = d.max_seq_len - (g.max_new_tokens if g is not None else 0)
    if limit < 1:
        raise MegatrainError(f"grpo.max_new_tokens: {g.max_new_tokens} leaves no room for a prompt in "
                             f"data.max_seq_len={d.max_seq_len}")
    counts = PromptCounts(cut_to=row_tokens(d.max_seq_len), limit=limit)
    sources, loaded = load_parts(d, tok, side, counts, encoder=encode_prompt_row, features=prompt_features,
                                 version=PROMPT_ENCODER_VERSION)
    rewards = g.rewards if g is not None else []
    checked = [(i, s) for i, s in enumerate(rewards) if s.name in FIELD_REWARDS]  # the built-ins that read a row
    cols: dict[str, list] = {k: [] for k in ("part", "row", "source", "length")}
    for pi, (si, part, good) in enumerate(loaded):
        length = part.tokens.data.column("length").to_numpy().astype(np.int64)
        over = length[good] > limit
        for r in good[over].tolist():
            n = int(length[r])
            what = f"at least {n:,}" if part.tokens[r]["cut_chars"] else f"{n:,}"
            if d.overlong == "drop":
                counts.dropped += 1
            else:
                counts.too_long += 1
                _skip(d, counts, part.raw.where(part.tokens[r]["row"]),
                      f"the prompt is {what} tokens (chat template included), more than data.max_seq_len - "
                      f"grpo.max_new_tokens = {limit:,}", "set data.skip_bad_rows: true to skip and count such "
                                                          "prompts, or raise data.max_seq_len")
        good = good[~over]
        if checked:
            keep = np.ones(len(good), dtype=bool)
            for j, (r, row) in enumerate(_raw_rows(part, good)):
                for i, s in checked:
                    if problem := row_problem(s, row):
                        keep[j] = False
                        counts.unscorable += 1
                        _skip(d, counts, part.raw.where(part.tokens[r]["row"]),
                              f"{problem}, read by grpo.rewards[{i}] ({s.name})",
                              "set data.skip_bad_rows: true to skip and count such rows")
                        break
            good = good[keep]
        counts.tokens += int(length[good].sum())
        for key, v in (("part", np.full(len(good), pi)), ("row", good), ("source", np.full(len(good), si)),
                       ("length", length[good])):
            cols[key].append(np.asarray(v, dtype=np.int64))
    arrays = [np.concatenate(cols[k]) if cols[k] else np.zeros(0, dtype=np.int64) for k in cols]
    prompts = Prompts(sources, [p for _, p, _ in loaded], *arrays, counts)
    counts.examples = len(prompts)
    if not len(prompts):
        raise no_examples(counts, side, d.max_seq_len)
    return prompts


# ---- the order of prompts --------------------------------------------------------------------------------------
class PromptSource:
    """Hands out prompts, epoch after epoch in a seeded order, resuming exactly; `rank` of `world` ranks."""

    def __init__(self, cfg, prompts: Prompts, seed: int, rank: int = 0, world: int = 1):
        self.cfg, self.prompts, self.seed, self.rank, self.world = cfg, prompts, seed, rank, world
        self.planner = EpochPlanner(prompts.lengths, prompts.source, prompts.quotas(), seed, BatchShape(1, 0))
        self.epoch, self.cursor, self._order = 0, 0, None

    def __len__(self) -> int:
        return len(self.prompts)

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            self._order = self.planner.order(self.epoch)
        return self._order

    def next_prompts(self, k: int) -> list[PromptRow]:
        """The next k prompts of all ranks (an epoch ends, the next begins, within one call), this rank's block of
        k / world of them."""
        if k % self.world:
            raise MegatrainError(f"grpo.prompts_per_rollout: {k} prompts do not split between {self.world} ranks")
        drawn: list[int] = []
        while len(drawn) < k:
            order = self._epoch_order()
            if self.cursor >= len(order):
                self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
                continue
            take = order[self.cursor: self.cursor + k - len(drawn)].tolist()
            drawn += take
            self.cursor += len(take)
        return [self.prompts.get(i) for i in rank_share(drawn, self.rank, self.world)]

    def _identity(self) -> dict:
        p = self.planner
        return {"seed": p.seed, "prompts": int(len(p.lengths)), "tokens": int(p.lengths.sum()),
                "quotas": [int(q) for q in p.quotas]}

    def state_dict(self) -> dict:
        return {"kind": "prompts", "epoch": self.epoch, "cursor": self.cursor, "world_size": self.world,
                **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "prompts":
            raise MegatrainError("data: cannot resume: the checkpoint's data order is not of prompts (it was saved "
                                 "by a run of another objective)")
        for k, v in self._identity().items():
            if k in state and state[k] != v:
                raise MegatrainError(f"data: cannot resume the exact prompt order: {k} was {state[k]} in the "
                                     f"checkpoint and is {v} now (the data or its settings changed)")
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None

    def fingerprint(self) -> str:
        return self.prompts.fingerprint()

    @property
    def summary(self) -> str:
        return "\n".join(prompt_lines(self.prompts, self.cfg))


def prompt_lines(prompts: Prompts, cfg) -> list[str]:
    """The run-start summary of the prompts, like the SFT loader's count lines."""
    g, c, q = _sections(cfg)[1], prompts.counts, prompts.quotas()
    per_src = ", ".join(f"{s.name}: {int((prompts.source == i).sum()):,}"
                        + (f" -> {q[i]:,}/epoch" if q[i] != int((prompts.source == i).sum()) else "")
                        for i, s in enumerate(prompts.sources))
    n = len(prompts.sources)
    lines = [f"prompts: {c.examples:,} from {n} source{'s' * (n > 1)} [{per_src}]",
             f"rows: {c.rows:,} read, {c.bad:,} bad rows skipped, {c.too_long:,} over-long prompts (> "
             + (f"data.max_seq_len - grpo.max_new_tokens = {c.limit:,}" if g is not None else
                f"data.max_seq_len = {c.limit:,}")
             + f" tokens) skipped, {c.dropped:,} dropped, {c.unscorable:,} rows the rewards cannot score skipped, "
               f"{c.held_out:,} held out for evaluation"]
    lines += [f"  skipped: {b}" for b in c.bad_examples]
    L = prompts.lengths
    lines.append(f"prompt tokens: {c.tokens:,}; length min {L.min()}, median {int(np.median(L))}, mean {L.mean():.1f}, "
                 f"p95 {int(np.percentile(L, 95))}, max {L.max()}"
                 + (f"; completions up to {g.max_new_tokens:,} tokens" if g is not None else ""))
    if g is None:
        return lines
    per_epoch = sum(q)
    lines.append(f"rollout batches: {g.prompts_per_rollout:,} prompts x {g.num_generations} completions; "
                 f"{per_epoch / g.prompts_per_rollout:.2f} rollout batches per epoch")
    return lines


def build_prompt_source(cfg, tokenizer, *, seed: int, rank: int = 0, world: int = 1,
                        side: str = "train") -> PromptSource:
    """The prompts of a megatrain Config (data.format prompt; its data and grpo sections), tokenised with the chat
    template (data.chat_template set on `tokenizer` first), in a seeded order; rank, world: this process's share of
    each rollout batch. side: "train", or "eval" (data.eval_path / eval_datasets / eval_fraction)."""
    apply_chat_template_override(tokenizer, cfg.data.chat_template)
    return PromptSource(cfg, build_prompts(cfg, tokenizer, side), seed, rank, world)


def render_prompt_preview(cfg, tok, n: int) -> str:
    """What `megatrain data CONFIG --preview N` prints for prompts (cfg: a megatrain Config, or its DataConfig):
    each prompt as the model sees it and its row, then the statistics."""
    apply_chat_template_override(tok, _sections(cfg)[0].chat_template)
    prompts = build_prompts(cfg, tok, "train")
    lines = []
    for k in range(min(n, len(prompts))):
        p = prompts.get(k)
        fields = ", ".join(f"{key}={str(v)[:40]!r}" for key, v in p.row.items())
        lines += [f"--- prompt {k + 1} of {len(prompts):,}: {p.where} -- {len(p.ids)} tokens", "  " +
                  p.text.replace("\n", "\n  "), f"  row: {fields}", ""]
    return "\n".join(lines + ["--- statistics"] + prompt_lines(prompts, cfg))
