"""The grpo run's pieces (run/grpo.py): group advantages against a written-out float64 reference (TRL's formula),
the loss types' row weights, the rows' labels and target order, the rollout batch's log fields, the checkpoint
encoding of per-token log-probs; and a sampled rollout batch's step against TRL's loss written out."""

import math
import statistics

import torch

from megatrain.run.grpo import (ROW_GRANULE, _dec, _enc, batch_fields, collate, group_advantages, row_length,
                               row_weights, split_targets)


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


def test_a_rollout_batch_has_one_row_length_rounded_up_within_max_seq_len():
    """Every micro-batch of a rollout batch is padded to one length (compiled layers then run one shape): the
    batch's longest row rounded up to a multiple of ROW_GRANULE, at most data.max_seq_len, never shorter than a
    row."""
    def rows(*lengths):
        return [{"prompt": [1] * 3, "completion": [2] * (n - 3)} for n in lengths]
    assert row_length(rows(100, 7, 64), 1000) == 128 == 2 * ROW_GRANULE
    assert row_length(rows(128, 5), 1000) == 128 and row_length(rows(129), 1000) == 192
    assert row_length(rows(600, 630), 641) == 640 and row_length(rows(641), 641) == 641
    assert row_length(rows(645), 700) == 700  # (the cap: data.max_seq_len, prompt limit + max_new_tokens)
    assert row_length(rows(700), 641) == 700  # never shorter than a row
    b = collate([{"prompt": [5, 6], "completion": [7], "advantage": 1.0, "old": None, "ref": None}], 0, length=6)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0, 0, 0]] and b["labels"].tolist() == [[-100, -100, 7] + [-100] * 3]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0]] and b["num_real_tokens"] == 3


def test_a_sampled_rollout_batch_steps_as_trl_writes_it(tmp_path):
    """The run's path from a rollout to the gradient, on completions sampled at temperature 0.7 (some ended by EOS,
    kept and trained on, some cut at max_new_tokens): the sampler's kept log-probs, Engine.token_logps (the old
    log-probs of a batch that feeds several steps) and a plain forward of each unpadded prompt + completion with its
    logits / temperature (TRL's per-token log-probs) agree; the run's rows (group advantages, collate's labels and
    right padding, the step's row weights) give the loss and every gradient of TRL's loss written out over those
    sequences."""
    from conftest import make_model_dir
    from reference import Megatrain, rel
    from test_equivalence import TOL, load_reference

    from megatrain.rollout import DictWeights, Sampler, SamplingParams
    from megatrain.run.prefetch import prepare_step
    from megatrain.runtime.objective import Objective

    make_model_dir(tmp_path, "llama", seed=71, layers=2)
    model = load_reference(tmp_path)
    T, n, max_new = 0.7, 4, 6
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (k,), generator=g).tolist() for k in (3, 6, 4, 5)]
    eos = tuple(range(40, 60))  # a fifth of the vocabulary ends a completion
    out = Sampler(model.config, DictWeights(dict(model.state_dict())), "cpu", dtype=torch.float32).generate(
        prompts, SamplingParams(max_new, temperature=T, n=n, eos_token_ids=eos, seed=5))
    comps = out.completion_ids
    assert any(c[-1] in eos for c in comps) and any(len(c) == max_new and c[-1] not in eos for c in comps)
    rewards = torch.tensor([sum(t % 2 == 0 for t in c) / len(c) for c in comps])
    adv, _ = group_advantages(rewards, n)
    rows = [{"prompt": prompts[i], "completion": c, "advantage": float(a), "old": None, "ref": None}
            for i, c, a in zip(out.prompt_index, comps, adv.tolist())]
    w = row_weights([len(c) for c in comps], "dapo", max_new)
    rows = [{**r, "row_weight": x} for r, x in zip(rows, w)]
    obj = Objective("grpo", loss_type="dapo", temperature=T)
    mt = Megatrain(tmp_path, objective=obj)
    length = row_length(rows, 40)  # as the run pads them: one length for the batch, past every row's end
    assert length == 40 > max(len(r["prompt"]) + len(r["completion"]) for r in rows)
    mbs = prepare_step([collate(rows[i:i + 6], pad_id=0, length=length) for i in range(0, len(rows), 6)], pin=False)
    assert {mb.input_ids.shape[1] for mb in mbs} == {40}
    old = torch.cat(mt.engine.token_logps(mbs))

    loss_ref, want_old = 0.0, []
    tokens = sum(len(c) for c in comps)
    model.zero_grad(set_to_none=True)
    for r in rows:
        p, c = r["prompt"], r["completion"]
        logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1: len(p) + len(c) - 1].float()
        logp = torch.log_softmax(logits / T, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
        want_old.append(logp.detach())
        ratio = torch.exp(logp - logp.detach())
        a = torch.tensor(r["advantage"])
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a)
        loss = per_token.sum() / tokens  # dapo: the step's token mean
        loss.backward()
        loss_ref += loss.item()
    want_old = torch.cat(want_old)
    sampled = torch.tensor([x for lp in out.logprobs for x in lp])
    assert (sampled - want_old).abs().max().item() <= TOL * want_old.abs().max().item()
    assert (old - want_old).abs().max().item() <= TOL * want_old.abs().max().item()
    got_loss, _, grads = mt.train_step(None, keep_grads=True, mbs=mbs)
    assert abs(got_loss - loss_ref) <= TOL * max(1.0, abs(loss_ref))
    for k, p in model.named_parameters():
        assert rel(grads[k], p.grad) <= TOL, k
    mt.close()
