"""The grpo run's pieces without a model (run/grpo.py): group advantages against a written-out float64 reference
(TRL's formula), the loss types' row weights, the rows' labels and target order, the rollout batch's log fields, the
checkpoint encoding of per-token log-probs."""

import math
import statistics

import torch

from megatrain.run.grpo import _dec, _enc, batch_fields, collate, group_advantages, row_weights, split_targets


def test_group_advantages_match_trl_formula():
    g = torch.Generator().manual_seed(1)
    for n in (2, 3, 8):
        r = torch.rand(5 * n, generator=g, dtype=torch.float64)
        r[:n] = 0.5  # one group with every reward equal: advantage 0, std 0
        adv, std = group_advantages(r.float(), n, scale=True)
        adv_u, _ = group_advantages(r.float(), n, scale=False)
        vals = r.float().double().tolist()
        for gi in range(5):
            grp = vals[gi * n:(gi + 1) * n]
            m, s = statistics.fmean(grp), statistics.stdev(grp)  # unbiased, as torch.std
            assert math.isclose(float(std[gi]), s, rel_tol=1e-5, abs_tol=1e-7)
            for j, x in enumerate(grp):
                assert math.isclose(float(adv[gi * n + j]), (x - m) / (s + 1e-4), rel_tol=1e-5, abs_tol=1e-6)
                assert math.isclose(float(adv_u[gi * n + j]), x - m, rel_tol=1e-5, abs_tol=1e-6)
        assert bool((adv[:n] == 0).all())


def test_row_weights_per_loss_type():
    lengths = [3, 1, 7, 5]
    assert row_weights(lengths, "dapo", 16) == [1 / 16] * 4
    assert row_weights(lengths, "dr_grpo", 16) == [1 / (4 * 16)] * 4
    w = row_weights(lengths, "grpo", 16)
    assert all(math.isclose(x, 1 / (n * 4)) for x, n in zip(w, lengths))
    # the step's loss sum w_r * n_r: each type's normaliser
    assert math.isclose(sum(x * n for x, n in zip(w, lengths)), 1.0)
    assert math.isclose(sum(x * n for x, n in zip(row_weights(lengths, "dapo", 16), lengths)), 1.0)


def test_collate_labels_only_on_completions_in_target_order():
    from megatrain.runtime import MicroBatch

    rows = [{"prompt": [5, 6, 7], "completion": [8, 9], "advantage": 0.5, "row_weight": 0.1,
             "old": [-1.0, -2.0], "ref": None},
            {"prompt": [5], "completion": [4, 3, 2, 1], "advantage": -1.0, "row_weight": 0.2,
             "old": [-3.0, -4.0, -5.0, -6.0], "ref": None}]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9], [5, 4, 3, 2, 1]]
    assert b["labels"].tolist() == [[-100, -100, -100, 8, 9], [-100, 4, 3, 2, 1]]
    assert b["attention_mask"].tolist() == [[1] * 5, [1] * 5]
    rows[0]["completion"] = [8]  # a shorter row is right-padded, its padding neither attended nor trained
    rows[0]["old"] = [-1.0]
    b = collate(rows, pad_id=0)
    assert b["input_ids"].tolist()[0] == [5, 6, 7, 8, 0] and b["labels"].tolist()[0] == [-100, -100, -100, 8, -100]
    assert b["attention_mask"].tolist()[0] == [1, 1, 1, 1, 0]
    mb = MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"])
    assert mb.targets.tolist() == [8, 4, 3, 2, 1]  # target order = rows' completions in order
    assert b["old_logps"].tolist() == [-1.0, -3.0, -4.0, -5.0, -6.0] and "ref_token_logps" not in b
    assert b["advantages"].tolist() == [0.5, -1.0]
    back = split_targets([b["old_logps"]], [rows])
    assert back == [[-1.0], [-3.0, -4.0, -5.0, -6.0]]


def test_batch_fields_as_trl_names_them():
    total = torch.tensor([1.0, 0.0, 1.0, 1.0])
    _, std = group_advantages(total, 2)
    f = batch_fields({"exact_match": [1.0, 0.0, 1.0, 1.0]}, total, std, [3, 5, 2, 8], [True, False, True, True])
    assert f["reward"] == 0.75 and math.isclose(f["reward_std"], statistics.stdev([1, 0]) / 2, rel_tol=1e-6)
    assert f["frac_reward_zero_std"] == 0.5
    assert f["rewards/exact_match/mean"] == 0.75
    assert math.isclose(f["rewards/exact_match/std"], statistics.stdev([1, 0, 1, 1]))
    assert (f["completions/mean_length"], f["completions/min_length"], f["completions/max_length"]) == (4.5, 2, 8)
    assert f["completions/clipped_ratio"] == 0.25


def test_logps_encoding_is_exact():
    g = torch.Generator().manual_seed(2)
    vals = [torch.randn(n, generator=g).tolist() for n in (3, 0, 7)]
    back = _dec(_enc(vals))
    assert [len(v) for v in back] == [3, 0, 7]
    assert all(torch.equal(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
               for a, b in zip(vals, back))
    assert _dec(_enc(None)) is None
