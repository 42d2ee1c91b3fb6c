"""GRPO through the engine equals a plain reference: a transformers model, torch.optim.AdamW and the loss written out
from TRL's GRPOTrainer (_compute_loss: the clipped ratio, the k3 KL estimate, the grpo / dr_grpo / dapo
aggregations, the clip-ratio and kl metrics) on per-token log-probs from log_softmax of the logits divided by the
sampling temperature (TRL's; 0.7, 1, 1.3 and 0.8 here), given fixed completions (random token rows, the prompt and
the padding masked) and fixed rewards turned into group-normalised advantages. Loss, every gradient, the metrics and
every updated weight within 1e-5 over several steps of several micro-batches, dense and MoE; the ratio clipped low
and high against given old log-probs; a rollout batch trained twice (num_iterations 2) with the old log-probs and
the KL reference's from Engine.token_logps."""

import copy
from types import SimpleNamespace

import pytest
import torch

from conftest import make_model_dir
from reference import (MAX_NORM, Megatrain, completion_batches, reference_optimizer, rel, step_and_grads,
                       token_logps)
from test_equivalence import TOL, load_reference

from megatrain.runtime import MicroBatch, Placement
from megatrain.runtime.objective import Objective, grpo_row_weights

GROUPS, PER_GROUP = 2, 3  # prompts per micro-batch, completions per prompt (TRL num_generations)
MAX_NEW = 16  # dr_grpo's max_completion_length: the longest row
LENGTHS = [11, 16]


def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """TRL's: (r - the group's mean) / (the group's std (unbiased) + 1e-4), groups of PER_GROUP consecutive rows."""
    r = rewards.view(-1, PER_GROUP)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)


def rollout(n_micro: int, seed: int):
    """Micro-batches of completions and each micro-batch's advantages (fixed rewards, some groups tied)."""
    batches = completion_batches(n_micro, GROUPS, PER_GROUP, 97, LENGTHS, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    rewards = torch.randint(0, 3, (n_micro * GROUPS * PER_GROUP,), generator=g).float()
    return batches, list(advantages(rewards).split(GROUPS * PER_GROUP))


def padded(flat: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[B, T-1]: flat per-target values at the labelled positions, 0 elsewhere."""
    mask = labels[:, 1:] != -100
    out = torch.zeros(mask.shape, dtype=torch.float32)
    out[mask] = flat
    return out


def trl_step(model, opt, batches, advs, obj: Objective, old=None, ref=None):
    """One AdamW step of TRL's GRPO loss over the micro-batches (gradient accumulation). Returns (loss, the same sum
    of the per-token losses' magnitudes (the scale of the loss's rounding), gradients, metric token means)."""
    opt.zero_grad(set_to_none=True)
    ga = len(batches)
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)  # num_items_in_batch
    total, magnitude, sums = 0.0, 0.0, {}
    for m, b in enumerate(batches):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        y = b["labels"][:, 1:]
        mask = (y != -100).float()
        logits = out.logits[:, :-1].float() / obj.temperature  # TRL: the logits over the sampling temperature
        logps = torch.log_softmax(logits, -1).gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
        old_logps = logps.detach() if old is None else padded(old[m], b["labels"])
        coef_1 = torch.exp(logps - old_logps)
        coef_2 = torch.clamp(coef_1, 1 - obj.epsilon, 1 + obj.epsilon_high)
        a = advs[m].unsqueeze(1)
        per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
        if obj.kl_beta:
            r = padded(ref[m], b["labels"])
            per_token_kl = torch.exp(r - logps) - (r - logps) - 1
            per_token_loss = per_token_loss + obj.kl_beta * per_token_kl
            sums["kl"] = sums.get("kl", 0.0) + (per_token_kl * mask).sum().item()

        def aggregate(x):
            if obj.loss_type == "grpo":
                return ((x * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / ga
            if obj.loss_type == "dr_grpo":
                return (x * mask).sum() / (x.size(0) * MAX_NEW) / ga
            return (x * mask).sum() / items  # dapo

        loss = aggregate(per_token_loss)
        magnitude += aggregate(per_token_loss.detach().abs()).item()
        if getattr(model.config, "output_router_logits", False):
            aux = model.config.router_aux_loss_coef * out.aux_loss / ga
            loss, magnitude = loss + aux, magnitude + aux.item()
        loss.backward()
        total += loss.item()
        low = (coef_1 < 1 - obj.epsilon) & (a < 0)
        high = (coef_1 > 1 + obj.epsilon_high) & (a > 0)
        for k, v in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", high), ("clip_ratio/region_mean",
                                                                                    low | high)):
            sums[k] = sums.get(k, 0.0) + (v.float() * mask).sum().item()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return total, magnitude, grads, {k: v / items for k, v in sums.items()}


def engine_microbatches(batches, advs, obj: Objective, old=None, ref=None) -> list[MicroBatch]:
    """The run's micro-batches: each row's weight w_r from the step's rows and completion tokens."""
    counts = [(b["labels"][:, 1:] != -100).sum(-1) for b in batches]
    rows, tokens = sum(len(n) for n in counts), int(sum(n.sum() for n in counts))
    return [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"], advantages=advs[m],
                                   row_weight=grpo_row_weights(obj.loss_type, counts[m], rows, tokens, MAX_NEW),
                                   old_logps=None if old is None else old[m],
                                   ref_token_logps=None if ref is None else ref[m])
            for m, b in enumerate(batches)]


def check_step(mt: Megatrain, model, opt, batches, advs, obj: Objective, step, old=(None, None), ref=(None, None)):
    """One step of both, equal; old and ref: (the engine's, the reference's) per-target log-probs per micro-batch.
    Returns the engine's metric sums."""
    ref_loss, magnitude, ref_grads, ref_metrics = trl_step(model, opt, batches, advs, obj, old[1], ref[1])
    loss, _, grads = mt.train_step(None, keep_grads=True, mbs=engine_microbatches(batches, advs, obj, old[0], ref[0]))
    # the loss sums terms of both signs (advantages have zero mean in a group): its rounding scales with their size
    assert abs(loss - ref_loss) <= TOL * magnitude, f"loss at step {step}: {loss} vs {ref_loss}"
    for k, g in grads.items():
        assert rel(g, ref_grads[k]) <= TOL, f"gradient of {k} at step {step}"
    m = mt.last.metrics
    tokens = m["tokens"].item()
    assert tokens == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    assert set(m) == {"tokens", *ref_metrics}
    for k, v in ref_metrics.items():
        assert abs(m[k].item() / tokens - v) <= TOL * max(1.0, abs(v)), f"{k} at step {step}"
    return m


def check_params(mt: Megatrain, model, steps) -> None:
    ref_params = dict(model.named_parameters())
    for k, p in mt.params().items():
        assert rel(p, ref_params[k].detach()) <= TOL, f"{k} after {steps} steps"


CASES = [("dapo", "llama", 0.7), ("grpo", "qwen3_moe", 1.0), ("dr_grpo", "llama", 1.3)]


@pytest.mark.parametrize("loss_type,family,temperature", CASES, ids=[f"{t}-{f}-T{x}" for t, f, x in CASES])
def test_on_policy_steps_equal_trl(tmp_path, loss_type, family, temperature):
    """num_iterations 1: no old log-probs (the ratio is 1, its gradient the policy gradient), each aggregation's
    weighting, 3 micro-batches a step (2 for MoE); epsilon_high != epsilon; the log-probs of the logits divided by
    the sampling temperature (TRL's)."""
    make_model_dir(tmp_path, family, tied=family == "llama", seed=61)
    model = load_reference(tmp_path)
    opt = reference_optimizer(model)
    obj = Objective("grpo", epsilon=0.2, epsilon_high=0.28, loss_type=loss_type, temperature=temperature)
    mt = Megatrain(tmp_path, objective=obj)
    steps, n_micro = 3, 2 if family == "qwen3_moe" else 3
    for step in range(steps):
        batches, advs = rollout(n_micro, seed=900 + step)
        m = check_step(mt, model, opt, batches, advs, obj, step)
        assert m["clip_ratio/region_mean"].item() == 0.0  # on-policy: nothing clips
    check_params(mt, model, steps)
    mt.close()


@pytest.mark.parametrize("family,loss_type", [("qwen2", "dapo"), ("qwen3_moe", "grpo")])
def test_clipped_ratio_low_and_high(tmp_path, family, loss_type):
    """Old log-probs apart from the current ones (the current + noise): tokens clip below 1 - epsilon (negative
    advantage) and above 1 + epsilon_high (positive advantage), where the clipped branch's gradient is zero."""
    make_model_dir(tmp_path, family, seed=62)
    model = load_reference(tmp_path)
    opt = reference_optimizer(model)
    obj = Objective("grpo", epsilon=0.2, epsilon_high=0.25, loss_type=loss_type)
    mt = Megatrain(tmp_path, objective=obj)
    low = high = 0.0
    steps = 2 if family == "qwen3_moe" else 3
    for step in range(steps):
        batches, advs = rollout(2, seed=950 + step)
        g = torch.Generator().manual_seed(step)
        with torch.no_grad():
            old = [token_logps(model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                               b["labels"]) for b in batches]
        old = [o + 0.3 * torch.randn(o.shape, generator=g) for o in old]
        m = check_step(mt, model, opt, batches, advs, obj, step, old=(old, old))
        low, high = low + m["clip_ratio/low_mean"].item(), high + m["clip_ratio/high_mean"].item()
        assert m["clip_ratio/region_mean"].item() < m["tokens"].item()  # and some are not
    assert low > 0 and high > 0
    check_params(mt, model, steps)
    mt.close()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_two_iterations_with_kl_and_token_logps(tmp_path, family):
    """Two rollout batches of 2 optimizer steps each (1 for MoE), every batch trained twice (num_iterations 2): the old
    log-probs from Engine.token_logps at the batch's start, the KL reference (beta > 0) the store's frozen step-0
    copy through token_logps(weights="reference"); both equal the reference model's per-token log_softmax of its
    logits / temperature (0.8, TRL's)."""
    make_model_dir(tmp_path, family, tied=family == "llama", seed=63)
    model = load_reference(tmp_path)
    frozen = copy.deepcopy(model).eval()
    opt = reference_optimizer(model)
    obj = Objective("grpo", epsilon=0.01, epsilon_high=0.015, kl_beta=0.2, loss_type="dapo", temperature=0.8)
    mt = Megatrain(tmp_path, objective=obj, loss_chunk_tokens=7, placement=Placement(wave_groups=2))
    mt.store.freeze_reference()
    step, clipped = 0, 0.0
    for batch in range(2):
        steps = [rollout(2, seed=1000 + 10 * batch + s) for s in range(1 if family == "qwen3_moe" else 2)]
        logps = {}
        for weights, net in (("policy", model), ("reference", frozen)):
            got = [mt.engine.token_logps(Megatrain.microbatches(b), weights=weights) for b, _ in steps]
            with torch.no_grad():
                want = [[token_logps(net(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
                                     / obj.temperature, x["labels"]) for x in b] for b, _ in steps]
            for g, w in zip(sum(got, []), sum(want, [])):
                assert g.dtype == torch.float32 and g.shape == w.shape
                assert (g - w).abs().max().item() <= TOL * w.abs().max().item(), weights
            logps[weights] = (got, want)
        if batch == 1:  # the policy moved away from the reference
            assert not torch.equal(torch.cat(logps["policy"][0][0]), torch.cat(logps["reference"][0][0]))
        for _ in range(2):  # num_iterations
            for s, (batches, advs) in enumerate(steps):
                old = (logps["policy"][0][s], logps["policy"][1][s])
                ref = (logps["reference"][0][s], logps["reference"][1][s])
                m = check_step(mt, model, opt, batches, advs, obj, step, old=old, ref=ref)
                clipped += m["clip_ratio/region_mean"].item()
                step += 1
    assert clipped > 0
    check_params(mt, model, step)
    mt.close()


def test_ranks_shares_add_up_to_the_step(tmp_path):
    """What a distributed step does: each rank runs its micro-batches (row weights from the whole step) with the
    step's totals; the ranks' losses, gradients and metric sums add up to the one-process step's (MoE: the router
    loss's share too)."""
    make_model_dir(tmp_path, "qwen3_moe", seed=64)
    obj = Objective("grpo", kl_beta=0.1, loss_type="grpo")
    batches, advs = rollout(3, seed=1100)
    g = torch.Generator().manual_seed(5)
    old = [token_logps(torch.randn(*b["input_ids"].shape, 97, generator=g), b["labels"]) for b in batches]
    ref = [o + 0.1 * torch.randn(o.shape, generator=g) for o in old]
    mbs = engine_microbatches(batches, advs, obj, old, ref)

    def run(share, totals=None):
        return step_and_grads(tmp_path, obj, [mbs[m] for m in share], totals)

    whole, gw = run([0, 1, 2])
    totals = (sum(mb.num_targets for mb in mbs), 3)
    (a, ga), (b, gb) = run([0, 2], totals), run([1], totals)
    assert abs(a.loss_sum.item() + b.loss_sum.item() - whole.loss_sum.item()) <= TOL * abs(whole.loss_sum.item())
    for i in gw:
        assert rel(ga[i] + gb[i], gw[i]) <= TOL, f"unit {i}"
    assert whole.metrics["kl"].item() > 0 and whole.metrics["clip_ratio/region_mean"].item() > 0
    for k, v in whole.metrics.items():
        assert abs(a.metrics[k].item() + b.metrics[k].item() - v.item()) <= TOL * max(1.0, abs(v.item())), k


def test_row_weights_are_trls_aggregations():
    n = torch.tensor([3, 1, 5, 2])
    assert torch.equal(grpo_row_weights("grpo", n, 8, 40, 16), 1 / (n.double() * 8))  # float64
    assert torch.equal(grpo_row_weights("dr_grpo", n, 8, 40, 16), torch.full((4,), 1 / 128, dtype=torch.float64))
    assert torch.equal(grpo_row_weights("dapo", n, 8, 40, 16), torch.full((4,), 1 / 40, dtype=torch.float64))
    with pytest.raises(ValueError, match="loss_type"):
        grpo_row_weights("bnpo", n, 8, 40, 16)


def test_objective_from_config():
    train = SimpleNamespace(objective="grpo")
    obj = Objective.from_config(train, None, SimpleNamespace(epsilon=0.1, epsilon_high=None, beta=0.04,
                                                             loss_type="dr_grpo", temperature=0.6))
    assert (obj.epsilon, obj.epsilon_high, obj.kl_beta, obj.loss_type, obj.temperature) == (0.1, 0.1, 0.04,
                                                                                          "dr_grpo", 0.6)
    assert obj.grpo and not obj.preference and obj.needs_reference_tokens and not obj.needs_reference
    obj = Objective.from_config(train, None, SimpleNamespace(epsilon=0.2, epsilon_high=0.28, beta=0.0))
    assert (obj.epsilon_high, obj.kl_beta, obj.loss_type, obj.needs_reference_tokens, obj.temperature) == (
        0.28, 0.0, "dapo", False, 1.0)
    assert Objective.from_config(SimpleNamespace(objective="dpo"), SimpleNamespace(
        beta=0.3, label_smoothing=0.0, simpo_gamma=0.5, orpo_lambda=0.1)).preference
    for bad in (dict(epsilon=1.0), dict(epsilon=-0.1), dict(epsilon_high=-0.1), dict(kl_beta=-1.0),
                dict(loss_type="bnpo"), dict(temperature=0.0)):
        with pytest.raises(ValueError, match="objective grpo"):
            Objective("grpo", **bad)


def test_bad_grpo_microbatches_are_refused(tmp_path):
    make_model_dir(tmp_path, "llama", seed=65)
    obj = Objective("grpo", kl_beta=0.1)
    mt = Megatrain(tmp_path, objective=obj)
    batches, advs = rollout(1, seed=1200)
    b = batches[0]
    n = int((b["labels"][:, 1:] != -100).sum())
    w = torch.full((b["input_ids"].shape[0],), 0.01)
    full = dict(advantages=advs[0], row_weight=w, ref_token_logps=torch.zeros(n))
    for missing, match in (("advantages", "needs advantages"), ("row_weight", "needs row_weight"),
                           ("ref_token_logps", "needs ref_token_logps")):
        kw = {k: v for k, v in full.items() if k != missing}
        with pytest.raises(ValueError, match=match):
            mt.engine.train_step([MicroBatch.from_labels(b["input_ids"], b["labels"], **kw)])
    with pytest.raises(ValueError, match=r"needs old_logps.*shape \(3,\)"):
        mt.engine.train_step([MicroBatch.from_labels(b["input_ids"], b["labels"], old_logps=torch.zeros(3), **full)])
    with pytest.raises(ValueError, match=r"needs advantages.*shape \(2,\)"):
        mt.engine.train_step([MicroBatch.from_labels(b["input_ids"], b["labels"], **{**full,
                                                                                    "advantages": advs[0][:2]})])
    pos = torch.arange(b["input_ids"].shape[1]).repeat(b["input_ids"].shape[0], 1) % 5
    with pytest.raises(ValueError, match="unpacked"):
        mt.engine.train_step([MicroBatch.from_labels(b["input_ids"], b["labels"], pos, **full)])
    mt.close()


def test_microbatch_carries_the_grpo_fields():
    """from_labels passes them as float32; the device copy (MicroBatch.to rebuilds from _tensors) keeps their order."""
    batches, advs = rollout(1, seed=1300)
    b = batches[0]
    n = int((b["labels"][:, 1:] != -100).sum())
    old, ref = torch.randn(n, dtype=torch.float64), torch.randn(n)
    mb = MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"], advantages=advs[0],
                                row_weight=torch.ones(6, dtype=torch.float64), old_logps=old, ref_token_logps=ref)
    assert mb.num_targets == n and mb.old_logps.dtype == mb.row_weight.dtype == torch.float32
    t = mb._tensors()
    again = MicroBatch(*t[:4], mb.packed, *t[4:])  # the order MicroBatch.to and pin rebuild in
    for k in ("advantages", "row_weight", "old_logps", "ref_token_logps", "token_mask", "targets"):
        assert torch.equal(getattr(again, k), getattr(mb, k)), k
    assert torch.equal(mb.old_logps, old.float()) and torch.equal(mb.ref_token_logps, ref)
