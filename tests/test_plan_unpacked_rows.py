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


def demo_inputs(out, *overrides):
    """check_inputs of the embedded demo (train.steps=2 unless overridden)."""
    from megatrain.config import load_config
    from megatrain.run.prepare import check_inputs

    return check_inputs(load_config(None, [f"output.dir={out}", "train.steps=2", "train.eval_every=0",
                                           "train.exact_match_path=", *overrides]))


def test_a_run_times_its_unpacked_rows_from_its_data(tmp_path):
    """check_inputs reads the data and retimes the plan from the micro-batches the run trains (the embedded demo's
    rows are far shorter than its max_seq_len); packed rows are timed from their documents instead."""
    def inputs(*overrides):
        return demo_inputs(tmp_path / "run", *overrides)

    got = inputs("data.packing=false")
    epoch = got.loader.sampler.plan
    trained = epoch[:2 * got.loader.grad_accum_steps]  # train.steps=2: the first micro-batches, not the epoch's
    assert len(trained) < len(epoch)
    rows, padded, _ = micro_batch_shapes(trained, got.loader.examples.lengths)
    mb_tokens, span = rows_timing(rows, padded)
    w = got.plan.workload
    assert not w.packed and padded.max() < w.seq_len
    assert got.plan.time["timed_rows"] == {"mean_padded_row": round(mb_tokens / max(w.micro_batches)),
                                           "attention_span": pytest.approx(span)}
    assert any("padded to its longest row" in n for n in got.plan.notes)
    packed = inputs("data.packing=true")
    assert "timed_rows" not in packed.plan.time


def test_packed_rows_are_timed_over_the_rows_the_run_trains(tmp_path):
    """A run shorter than an epoch is timed at the packed rows it trains, not at the epoch's (packed rows differ in
    their documents: a best-fit packing's rows, shuffled, from full to nearly empty); one that reaches past the
    epoch's end at the whole epoch's; a resumed run from the checkpoint's cursor."""
    from types import SimpleNamespace

    from megatrain.data.sampler import packed_span, run_part
    from megatrain.run.prepare import trained_rows

    short = demo_inputs(tmp_path / "a", "data.packing=true", "train.steps=1")
    epoch, n = short.loader.sampler.plan, short.loader.grad_accum_steps
    lengths, T = short.loader.examples.lengths, short.plan.workload.seq_len
    assert 2 * n < len(epoch)
    first, whole = packed_span(epoch[:n], lengths, T), packed_span(epoch, lengths, T)
    assert first != pytest.approx(whole, rel=1e-3)
    assert short.plan.workload.attn_len == pytest.approx(first)
    past = demo_inputs(tmp_path / "b", "data.packing=true", f"train.steps={len(epoch)}")
    assert past.plan.workload.attn_len == pytest.approx(whole)

    cfg = SimpleNamespace(train=SimpleNamespace(steps=5, grad_accum_steps=2))
    at = SimpleNamespace(step=3, state={"loader": {"epoch": 0, "cursor": 6}})
    assert trained_rows(cfg, epoch, 1, at) == epoch[6:10] == run_part(epoch, 6, 4)
    assert trained_rows(cfg, epoch, 2, None) == epoch[:20]  # every rank's share of each step
    later = SimpleNamespace(step=3, state={"loader": {"epoch": 1, "cursor": 6}})
    assert trained_rows(cfg, epoch, 1, later) is epoch
    assert run_part(epoch, len(epoch) - 1, 2) is epoch
