"""Prompt data of train.objective grpo (megatrain/data/prompts.py): every row layout gives the tokens of
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`; plain text without a template; LLaMA-Factory
registry entries read as prompts; the rows handed to the rewards whole; over-long, malformed and unscorable rows as
one line naming file:line, or skipped and counted; the seeded order resumes exactly and splits between ranks."""

from __future__ import annotations

import json

import pytest
from data_fixtures.helpers import tokenizer, write_jsonl

from megatrain.config import load_command_line
from megatrain.data import build_prompt_source, is_prompt, preview, render_prompt_preview, validate_inputs
from megatrain.data.prompts import build_prompts
from megatrain.errors import MegatrainError

SYSTEM = "Be brief."
USER = {"role": "user", "content": "Name a colour."}


def _cfg(tmp_path, path, *overrides, rewards="[{name: exact_match}]"):
    return load_command_line(None, [f"model.path={tmp_path}", "train.objective=grpo", "data.format=prompt",
                                    f"data.path={path}", f"data.cache_dir={tmp_path / 'cache'}",
                                    f"grpo.rewards={rewards}", "data.max_seq_len=256", "grpo.max_new_tokens=64",
                                    "grpo.prompts_per_rollout=4", *overrides])


def _source(tmp_path, rows, *overrides, tok=None, seed=0, **kw):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    return build_prompt_source(_cfg(tmp_path, path, *overrides, **kw), tok or tokenizer(), seed=seed)


def _template_ids(tok, msgs):
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_every_layout_gives_the_template_tokens_with_the_generation_prompt(tmp_path):
    tok = tokenizer()
    sys_msg = {"role": "system", "content": SYSTEM}
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, USER]
    rows = [
        {"prompt": "Name a colour.", "answer": "blue"},  # a string: the user turn
        {"prompt": [sys_msg, USER], "answer": "blue"},  # a message list, its system message kept
        {"messages": turns + [{"role": "assistant", "content": "Blue."}], "answer": "blue"},  # reply dropped
        {"prompt": "Name a colour.", "system": SYSTEM, "answer": "blue"},  # a system column
        {"prompt": "Name a", "input": "colour.", "answer": "blue"},  # alpaca's input joined by a line break
    ]
    src = _source(tmp_path, rows, tok=tok)
    got = {p.index: p for p in src.next_prompts(8)[:5]}
    want = [[USER], [sys_msg, USER], turns, [sys_msg, USER], [{"role": "user", "content": "Name a\ncolour."}]]
    for k, msgs in enumerate(want):
        p = got[k]
        assert p.ids == _template_ids(tok, msgs), k
        assert p.text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert p.text.endswith("<|im_start|>assistant\n") and p.where == f"{tmp_path / 'p.jsonl'}:{k + 1}"
        assert p.row == rows[k]  # the whole row, for the rewards
    assert len(src) == 5


def test_columns_are_remapped_and_other_fields_kept(tmp_path):
    rows = [{"question": "Name a colour.", "gold": "blue", "meta": {"id": 7}}]
    src = _source(tmp_path, rows, "data.columns={prompt: question}", rewards="[{name: exact_match, field: gold}]")
    (p,) = src.next_prompts(4)[:1]
    assert p.ids == _template_ids(tokenizer(), [USER]) and p.row == rows[0]


def test_without_a_chat_template_a_string_prompt_is_plain_text(tmp_path):
    tok = tokenizer()
    tok.chat_template = None
    src = _source(tmp_path, [{"prompt": "reverse abc", "answer": "cba"}], tok=tok)
    p = src.next_prompts(4)[0]
    assert p.text == "reverse abc" and p.ids == tok("reverse abc")["input_ids"]
    with pytest.raises(MegatrainError, match=r"p.jsonl:1: message lists, a system prompt or history are rendered "
                                             r"with the chat template, but the tokenizer has none"):
        _source(tmp_path, [{"prompt": [USER], "answer": "x"}], tok=tok)


def test_a_chat_template_from_the_config_is_applied(tmp_path):
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}[assistant] {% endif %}")
    p = _source(tmp_path, [{"prompt": "hi", "answer": "x"}], f"data.chat_template={tmpl}").next_prompts(4)[0]
    assert p.text == "[user] hi\n[assistant] "


def test_registry_entries_are_read_as_prompts(tmp_path):
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "Name a", "input": "colour.", "output": "blue"}]))
    write_jsonl(tmp_path / "sg.jsonl", [{"conversations": [{"from": "human", "value": "Name a colour."},
                                                           {"from": "gpt", "value": "Blue."}], "output": "blue"}])
    (tmp_path / "dataset_info.json").write_text(json.dumps({
        "a": {"file_name": "alpaca.json"},
        "s": {"file_name": "sg.jsonl", "formatting": "sharegpt", "columns": {"messages": "conversations"}}}))
    tok = tokenizer()
    for name, msgs in (("a", [{"role": "user", "content": "Name a\ncolour."}]), ("s", [USER])):
        cfg = load_command_line(None, [f"model.path={tmp_path}", "train.objective=grpo", "data.format=prompt",
                                       f"data.dataset_info={tmp_path}", f"data.datasets=[{name}]",
                                       f"data.cache_dir={tmp_path / 'cache'}",
                                       "grpo.rewards=[{name: exact_match, field: output}]"])
        assert is_prompt(cfg.data)
        p = build_prompt_source(cfg, tok, seed=0).next_prompts(64)[0]
        assert p.ids == _template_ids(tok, msgs) and p.row["output"] == "blue", name


# ---- bad rows ---------------------------------------------------------------------------------------------------
LONG = " ".join(["word"] * 300)


@pytest.mark.parametrize("row, message", [
    ({"prompt": LONG, "answer": "x"}, "the prompt is 3{n} tokens (chat template included), more than "
                                      "data.max_seq_len - grpo.max_new_tokens = 192 (set data.skip_bad_rows: true "
                                      "to skip and count such prompts, or raise data.max_seq_len)"),
    ({"answer": "x"}, "missing column 'prompt' (or 'messages') needed by format 'prompt'"),
    ({"prompt": 3, "answer": "x"}, "column 'prompt' must be a string or a list of messages, got int"),
    ({"prompt": [{"role": "assistant", "content": "Hi"}], "answer": "x"}, "empty prompt (no user turn with text "
                                                                          "before the completion)"),
    ({"prompt": [{"role": "robot", "content": "Hi"}], "answer": "x"}, "column 'prompt': unknown role 'robot'"),
    ({"prompt": "Name a colour."}, "the row has no column 'answer', read by grpo.rewards[0] (exact_match) (set "
                                   "data.skip_bad_rows: true to skip and count such rows)"),
])
def test_a_bad_row_is_one_line_naming_file_and_row(tmp_path, row, message):
    rows = [{"prompt": "fine", "answer": "x"}, row]
    with pytest.raises(MegatrainError) as e:
        _source(tmp_path, rows)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'p.jsonl'}:2: ") and "\n" not in msg
    head = message.split("3{n}")[0]
    assert head in msg and message.split("3{n}")[-1] in msg, msg


def test_bad_rows_skipped_and_counted(tmp_path):
    rows = [{"prompt": "fine", "answer": "x"}, {"prompt": LONG, "answer": "x"}, {"prompt": "no answer"},
            "not an object", {"prompt": "also fine", "answer": 3}]
    src = _source(tmp_path, rows, "data.skip_bad_rows=true")
    c = src.prompts.counts
    assert (len(src), c.too_long, c.unscorable, c.bad, c.rows) == (2, 1, 1, 1, 5)
    assert [p.where.rsplit(":", 1)[1] for p in sorted(src.next_prompts(4)[:2], key=lambda p: p.index)] == ["1", "5"]
    text = src.summary
    assert "prompts: 2 from 1 source" in text and "1 over-long prompts (> data.max_seq_len - grpo.max_new_tokens = " \
        "192 tokens) skipped" in text and f"  skipped: {tmp_path / 'p.jsonl'}:2: the prompt is" in text
    dropped = _source(tmp_path, rows[:2], "data.overlong=drop")
    assert len(dropped) == 1 and dropped.prompts.counts.dropped == 1


def test_numeric_reward_needs_a_number_in_each_answer(tmp_path):
    with pytest.raises(MegatrainError, match=r"p.jsonl:2: column 'answer' holds no number \('blue'\), read by "
                                             r"grpo.rewards\[1\] \(numeric\)"):
        _source(tmp_path, [{"prompt": "a", "answer": "#### 4"}, {"prompt": "b", "answer": "blue"}],
                rewards="[{name: exact_match}, {name: numeric}]")


# ---- order ------------------------------------------------------------------------------------------------------
ROWS = [{"prompt": f"prompt {i}", "answer": str(i)} for i in range(10)]


def test_epochs_are_seeded_shuffles_and_resume_exactly(tmp_path):
    a = _source(tmp_path, ROWS, seed=3)
    epoch0 = [p.index for k in (4, 4, 2) for p in a.next_prompts(k)]
    assert sorted(epoch0) == list(range(10)) and epoch0 != list(range(10)) and a.epoch == 0
    state = a.state_dict()
    rest = [[p.index for p in a.next_prompts(4)] for _ in range(5)]  # 20 prompts: epochs 1 and 2, a call across
    epoch1 = rest[0] + rest[1] + rest[2][:2]
    assert a.epoch == 2 and sorted(epoch1) == list(range(10)) and epoch1 != epoch0
    b = _source(tmp_path, ROWS, seed=3)
    b.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
    assert [[p.index for p in b.next_prompts(4)] for _ in range(5)] == rest
    assert [p.index for p in _source(tmp_path, ROWS, seed=3).next_prompts(10)] == epoch0  # same seed, same order
    other = _source(tmp_path, ROWS, seed=4)
    assert [p.index for p in other.next_prompts(10)] != epoch0
    with pytest.raises(MegatrainError, match="cannot resume the exact prompt order: seed was 3 in the checkpoint"):
        other.load_state_dict(state)
    with pytest.raises(MegatrainError, match="not of prompts"):
        other.load_state_dict({"epoch": 0, "cursor": 1})


def test_ranks_split_each_rollout_batch(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = _cfg(tmp_path, path)
    one = build_prompt_source(cfg, tokenizer(), seed=1)
    ranks = [build_prompt_source(cfg, tokenizer(), seed=1, rank=r, world=2) for r in range(2)]
    for _ in range(4):
        whole = [p.index for p in one.next_prompts(4)]
        parts = [[p.index for p in r.next_prompts(4)] for r in ranks]
        assert parts[0] + parts[1] == whole and len(parts[0]) == 2
    assert ranks[0].state_dict()["cursor"] == one.state_dict()["cursor"]
    with pytest.raises(MegatrainError, match="3 prompts do not split between 2 ranks"):
        ranks[0].next_prompts(3)


def test_the_tokenised_prompts_are_cached(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    cfg = _cfg(tmp_path, path)
    a = build_prompts(cfg, tokenizer())
    b = build_prompts(cfg, tokenizer())
    assert a.fingerprint() == b.fingerprint()
    files = [f["filename"] for f in a.parts[0].tokens.cache_files]
    assert files == [f["filename"] for f in b.parts[0].tokens.cache_files] and "tokens-" in files[0]


def test_preview_shows_each_prompt_as_the_model_sees_it(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ROWS[:3])
    cfg = _cfg(tmp_path, path)
    text = preview(cfg.data, tokenizer(), 2)  # what `megatrain data` prints from the data section alone
    assert text.count("--- prompt ") == 2 and f"--- prompt 1 of 3: {path}:1 -- " in text
    assert "<|im_start|>user\n  prompt 0<|im_end|>" in text and "row: prompt='prompt 0', answer='0'" in text
    assert "--- statistics\nprompts: 3 from 1 source" in text and "rollout batches" not in text
    full = render_prompt_preview(cfg, tokenizer(), 1)
    assert "= 192 tokens) skipped" in full and "(> data.max_seq_len = 256 tokens)" in text
    assert "rollout batches: 4 prompts x 8 completions; 0.75 rollout batches" in full
    with pytest.raises(MegatrainError, match="data.datasets\\[1\\]: format 'alpaca' is not prompt data"):
        validate_inputs(_cfg(tmp_path, path, "data.path=null", f"data.datasets=[{path}, {{path: {path}, "
                                                                "format: alpaca}]").data)


def test_parquet_rows_and_a_held_out_share(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
             "answer": f"a{i}"} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    cfg = _cfg(tmp_path, tmp_path / "p.parquet")
    cfg.data.eval_fraction = 0.25  # the data layer's held-out split (a grpo config refuses it: it evaluates none)
    train = build_prompt_source(cfg, tokenizer(), seed=0)
    held = build_prompt_source(cfg, tokenizer(), seed=0, side="eval")
    assert (len(train), len(held), train.prompts.counts.held_out) == (6, 2, 2)
    seen = train.next_prompts(8)[:6] + held.next_prompts(4)[:2]
    assert sorted(p.row["answer"] for p in seen) == [f"a{i}" for i in range(8)]  # the rows whole, from parquet
    for p in seen:
        i = int(p.row["answer"][1:])
        assert p.ids == _template_ids(tokenizer(), [{"role": "user", "content": f"q{i}"}])
        assert p.where == f"{tmp_path / 'p.parquet'} row {i + 1}"
