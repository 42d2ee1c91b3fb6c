"""Tokenising on several processes (data.num_proc; default: one per ROWS_PER_PROCESS rows up to the cores): the
same examples as one process, in the same order."""

from __future__ import annotations

import os

from data_fixtures.helpers import config, tokenizer, write_jsonl
from megatrain.data.encode import ROWS_PER_PROCESS, processes
from megatrain.data.examples import build_examples


def test_default_processes_follow_the_rows_and_the_cores():
    cores = len(os.sched_getaffinity(0))
    assert processes(None, ROWS_PER_PROCESS - 1) is None  # too few rows to pay for a second process
    assert processes(None, 64 * ROWS_PER_PROCESS) == (cores if cores > 1 else None)
    assert processes(3, 10) == 3 and processes(3, 5) is None and processes(1, 10**6) is None


def test_several_processes_give_the_examples_of_one(tmp_path):
    words = "alpha beta gamma delta epsilon zeta eta theta".split()
    rows = [{"text": " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 11))} for i in range(600)]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    tok = tokenizer()
    one = build_examples(config(tmp_path / "a", path=str(path), max_seq_len=16, num_proc=1), tok, "train")
    two = build_examples(config(tmp_path / "b", path=str(path), max_seq_len=16, num_proc=2), tok, "train")
    assert len(one.lengths) == len(two.lengths) == 600
    assert list(one.lengths) == list(two.lengths)
    assert [[list(a) for a in one.get(i)] for i in range(600)] == [[list(a) for a in two.get(i)] for i in range(600)]
