"""Tool calls and tool turns (issue 33): they used to be dropped by a template that does not render them, and the
assistant turn that only called a tool trained as an empty reply. Where the template renders them they are in
what the model sees (the call trained, the tool's answer not); where it does not, the row is refused, naming the
message, or skipped and counted with data.skip_bad_rows."""

from __future__ import annotations

import pytest

from data_fixtures.helpers import config, masked_text, tokenizer, trained_texts, write_jsonl
from megatrain.data import build_train_loader
from megatrain.data.formats import RowError, to_sample
from megatrain.data.config import DEFAULT_COLUMNS, DEFAULT_ROLES
from megatrain.data.template import EncodeOptions, encode
from megatrain.errors import MegatrainError

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
ROW = {"messages": [{"role": "user", "content": "weather in paris?"},
                    {"role": "assistant", "content": "", "tool_calls": [CALL]},
                    {"role": "tool", "content": "sunny, 21C"},
                    {"role": "assistant", "content": "It is sunny."}]}
# a template that renders tool definitions, calls and turns (as chat templates with tool support do)
TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<call>{{ c['function']['name'] }}"
    "({{ c['function']['arguments'] | tojson }})</call>{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}<|end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# renders the content of every role but no tool call (the fixture's default template)
NO_CALLS = None
# renders system, user and assistant turns only
NO_TOOL_TURNS = ("{% for m in messages %}{% if m['role'] != 'tool' %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "{% if m['role'] == 'assistant' %}<|end|>{% endif %}\n{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def sample(row=ROW, tools=None):
    row = dict(row, **({"tools": tools} if tools else {}))
    return to_sample(row, "messages", DEFAULT_COLUMNS["messages"], DEFAULT_ROLES["messages"])


def tok_with(template):
    tok = tokenizer()
    if template:
        tok.chat_template = template
    return tok


def test_tool_calls_and_turns_are_seen_and_the_call_is_trained():
    tok = tok_with(TOOL_TEMPLATE)
    ids, labels = encode(tok, sample(tools=TOOLS), EncodeOptions())
    text = tok.decode(ids)
    assert "get_weather" in text and "Paris" in text and "sunny, 21C" in text and "<|tools|>" in text
    trained = " ".join(trained_texts(tok, ids, labels))
    assert "<call>get_weather" in trained and "It is sunny." in trained  # the call is the reply it learns
    assert "sunny, 21C" not in trained and "[[" in masked_text(tok, ids, labels)  # the tool's answer is context


@pytest.mark.parametrize("template,tools,culprit", [
    (NO_CALLS, None, "message 2: the chat template does not render the assistant's tool_calls; the model would "
                     "not see them and would learn an empty reply"),
    (NO_TOOL_TURNS, None, "message 2: the chat template does not render the assistant's tool_calls"),
    (TOOL_TEMPLATE.replace("{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}", ""), TOOLS,
     "the chat template does not render the tools column"),
])
def test_a_template_that_drops_them_refuses_the_row(template, tools, culprit):
    with pytest.raises(RowError) as e:
        encode(tok_with(template), sample(tools=tools), EncodeOptions())
    assert str(e.value).startswith(culprit) and "\n" not in str(e.value), str(e.value)


def test_a_template_that_drops_tool_turns_refuses_the_row():
    row = {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "let me check"},
                        {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "It is sunny."}]}
    with pytest.raises(RowError) as e:
        encode(tok_with(NO_TOOL_TURNS), sample(row), EncodeOptions())
    assert str(e.value).startswith("message 3: the chat template does not render tool turns (role 'tool')")


def test_refused_with_the_row_named_or_skipped_and_counted(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 3 + [ROW]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(MegatrainError) as e:
        build_train_loader(config(tmp_path, path=str(path), format="messages", max_seq_len=256), tokenizer(),
                           seed=0, micro_batch_size=1, grad_accum_steps=1)
    assert str(e.value).startswith(f"{path}:4: message 2: the chat template does not render the assistant's "
                                   f"tool_calls"), str(e.value)
    loader = build_train_loader(config(tmp_path, path=str(path), format="messages", max_seq_len=256,
                                       skip_bad_rows=True), tokenizer(), seed=0, micro_batch_size=1,
                                grad_accum_steps=1)
    assert "4 read, 1 bad rows skipped" in loader.summary(), loader.summary()
