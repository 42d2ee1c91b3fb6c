"""Unpacked rows of varied lengths: each micro-batch is padded to its longest row, so `megatrain train` times the step
again from the data's micro-batches once it has read them (estimate.retime_unpacked), as it does packed rows from
their documents."""

from __future__ import annotations

import numpy as np
import pytest

from megatrain.data.sampler import micro_batch_shapes, plan_efficiency
from megatrain.planner import Workload
from megatrain.planner.estimate import estimate, retime_unpacked, rows_timing
from megatrain.planner.profile import DEFAULTS
from megatrain.planner.timing import executed_flops

from test_plan_attention_kernels import adapter_of


def test_micro_batch_shapes_are_each_micro_batch_rows_longest_and_real_tokens():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 500, 300)
    order = rng.permutation(300).tolist()
    plan, i = [], 0
    while i < len(order):  # micro-batches of 1-4 rows, each of 1-3 examples (packed rows)
        mb = []
        for _ in range(int(rng.integers(1, 5))):
            k = int(rng.integers(1, 4))
            if i < len(order):
                mb.append(order[i: i + k])
                i += k
        plan.append(mb)
    for row_length in (None, 700):
        rows, padded, real = micro_batch_shapes(plan, lengths, row_length)
        row_lens = [[sum(int(lengths[k]) for k in row) for row in mb] for mb in plan]
        assert rows.tolist() == [len(mb) for mb in plan]
        assert padded.tolist() == [max(max(r), row_length or 0) for r in row_lens]
        assert real.tolist() == [sum(r) for r in row_lens]
        assert plan_efficiency(plan, lengths, row_length) == (sum(map(sum, row_lens)),
                                                               sum(len(r) * p for r, p in zip(row_lens, padded)))


def test_rows_timing_is_the_mean_micro_batch_and_the_token_weighted_span():
    tokens, span = rows_timing([2, 2, 1], [100, 300, 50])
    assert tokens == pytest.approx((200 + 600 + 50) / 3)
    assert span == pytest.approx((2 * 100 ** 2 + 2 * 300 ** 2 + 50 ** 2) / (200 + 600 + 50))
    assert rows_timing([], []) == (0.0, 0.0)


def test_rows_of_one_length_are_timed_as_that_length_with_the_memory_of_max_seq_len():
    llama = adapter_of("llama-3.1-8b", num_hidden_layers=2)
    plan = estimate(llama, Workload((8, 8), 4096, compile=True), DEFAULTS)
    gpu, host, before = plan.gpu_peak, dict(plan.host), dict(plan.time)
    retime_unpacked(plan, llama, *rows_timing([8] * 6, [1024] * 6))
    short = estimate(llama, Workload((8, 8), 1024, compile=True), DEFAULTS)
    assert plan.step_s == pytest.approx(short.step_s, rel=1e-12)
    assert plan.time["tokens_per_s"] == pytest.approx(short.time["tokens_per_s"], rel=1e-12)
    assert plan.step_s < before["step_s"]
    assert plan.gpu_peak == gpu and plan.host == host and plan.workload.seq_len == 4096
    assert "padded to its longest row" in plan.notes[-1]


def test_rows_as_long_as_max_seq_len_and_packed_rows_are_left_as_planned():
    llama = adapter_of("llama-3.1-8b", num_hidden_layers=2)
    full = estimate(llama, Workload((8,), 4096, compile=True), DEFAULTS)
    t, notes = dict(full.time), list(full.notes)
    retime_unpacked(full, llama, *rows_timing([8, 8], [4096, 4096]))
    assert full.time == t and full.notes == notes
    packed = estimate(llama, Workload((8,), 4096, packed=True, compile=True), DEFAULTS)
    t = dict(packed.time)
    retime_unpacked(packed, llama, *rows_timing([8], [512]))
    assert packed.time == t


def test_mixed_lengths_execute_the_flops_of_their_micro_batches():
    """Causal attention's work per token is linear in the row's length, so a step timed at the mean padded row and
    the span sum(r·L²)/sum(r·L) executes exactly the FLOPs of its micro-batches each at its own length."""
    llama = adapter_of("llama-3.1-8b", num_hidden_layers=2)
    rng = np.random.default_rng(7)
    B = 4
    padded = rng.integers(64, 2048, 10)
    padded[-1] -= int(padded.sum()) % 10  # a mean row of whole tokens
    rows = [B] * len(padded)
    mb_tokens, span = rows_timing(rows, padded)
    seq = round(mb_tokens / B)
    timed = Workload((B, B), seq, compile=True, rows_span=span)
    assert timed.span_len == span and timed.tokens_per_step == 2 * B * seq
    each = [executed_flops(llama, llama.units(), Workload((B,), int(L), compile=True)) for L in padded]
    got = executed_flops(llama, llama.units(), timed)
    for part in ("forward", "rebuild", "backward", "head"):
        # two micro-batches a step: twice the mean micro-batch
        assert got[part] == pytest.approx(2 * sum(f[part] for f in each) / len(each), rel=1e-9)
    plan = estimate(llama, Workload((B, B), 2048, compile=True), DEFAULTS)
    retime_unpacked(plan, llama, mb_tokens, span)
    assert plan.time["timed_rows"] == {"mean_padded_row": seq, "attention_span": pytest.approx(span)}


def test_a_run_times_its_unpacked_rows_from_its_data(tmp_path):
    """check_inputs reads the data and retimes the plan from the epoch's micro-batches (the embedded demo's rows are
    far shorter than its max_seq_len); packed rows are timed from their documents instead."""
    from megatrain.config import load_config
    from megatrain.run.prepare import check_inputs

    def inputs(*overrides):
        return check_inputs(load_config(None, [f"output.dir={tmp_path / 'run'}", "train.steps=2", "train.eval_every=0",
                                               "train.exact_match_path=", *overrides]))

    got = inputs("data.packing=false")
    rows, padded, _ = micro_batch_shapes(got.loader.sampler.plan, got.loader.examples.lengths)
    mb_tokens, span = rows_timing(rows, padded)
    w = got.plan.workload
    assert not w.packed and padded.max() < w.seq_len
    assert got.plan.time["timed_rows"] == {"mean_padded_row": round(mb_tokens / max(w.micro_batches)),
                                           "attention_span": pytest.approx(span)}
    assert any("padded to its longest row" in n for n in got.plan.notes)
    packed = inputs("data.packing=true")
    assert "timed_rows" not in packed.plan.time
