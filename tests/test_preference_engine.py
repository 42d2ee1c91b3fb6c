"""Preference objectives (dpo, ipo, simpo, orpo) through the engine equal a plain reference: a transformers model,
torch.optim.AdamW, the losses written out here from the papers' formulas (DPO, IPO, SimPO, ORPO; as TRL computes
them) and reference log-probs from a frozen copy of the model. Loss, every gradient, the logged metrics and every
updated weight within 1e-5 over 20 steps of 2 micro-batches, dense and MoE, tied and untied; placements, the SSD
tier and gemma2's logit cap over fewer steps."""

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model_dir
from reference import MAX_NORM, Megatrain, pair_batches, reference_optimizer, rel, row_logps
from test_equivalence import TOL, load_reference

from megatrain.runtime import Placement
from megatrain.runtime.objective import Objective

BETA, LS, GAMMA, LAMBDA = 0.5, 0.1, 0.3, 0.2
OBJECTIVES = {"dpo": Objective("dpo", beta=BETA, label_smoothing=LS), "ipo": Objective("ipo", beta=BETA),
              "simpo": Objective("simpo", beta=BETA, simpo_gamma=GAMMA), "orpo": Objective("orpo", orpo_lambda=LAMBDA)}


def written_out(name: str, logp: torch.Tensor, n: torch.Tensor, ref: torch.Tensor | None):
    """(each pair's loss, {metric: each pair's value}) from the papers' formulas; rows 2i / 2i+1 chosen / rejected."""
    c, r, nc, nr = logp[0::2], logp[1::2], n[0::2].double(), n[1::2].double()
    if name == "dpo":  # Rafailov et al.: -log σ(β((log π_c - log ref_c) - (log π_r - log ref_r))), smoothed
        z = BETA * ((c - ref[0::2]) - (r - ref[1::2]))
        loss = -(1 - LS) * F.logsigmoid(z) - LS * F.logsigmoid(-z)
        rc, rr, sc, sr = BETA * (c - ref[0::2]), BETA * (r - ref[1::2]), c, r
    elif name == "ipo":  # Azar et al. (length-normalised as TRL): (h - 1/(2β))²
        h = (c / nc - ref[0::2] / nc) - (r / nr - ref[1::2] / nr)
        loss = (h - 1 / (2 * BETA)) ** 2
        rc, rr, sc, sr = BETA * (c / nc - ref[0::2] / nc), BETA * (r / nr - ref[1::2] / nr), c / nc, r / nr
    elif name == "simpo":  # Meng et al.: -log σ(β/|y_c| log π_c - β/|y_r| log π_r - γ)
        loss = -F.logsigmoid(BETA * c / nc - BETA * r / nr - GAMMA)
        rc, rr, sc, sr = BETA * c / nc, BETA * r / nr, c / nc, r / nr
    else:  # Hong et al.: -λ log σ(log odds_c - log odds_r), odds = p / (1 - p) of the per-token average
        ac, ar = c / nc, r / nr
        odds = (ac - torch.log(1 - torch.exp(ac))) - (ar - torch.log(1 - torch.exp(ar)))
        loss = -LAMBDA * F.logsigmoid(odds)
        rc, rr, sc, sr = LAMBDA * ac, LAMBDA * ar, ac, ar
    metrics = {"rewards/chosen": rc, "rewards/rejected": rr, "rewards/margins": rc - rr,
               "rewards/accuracies": (rc > rr).double(), "logps/chosen": sc, "logps/rejected": sr}
    if name == "orpo":
        metrics.update({"log_odds_ratio": F.logsigmoid(odds), "log_odds_chosen": odds})
    return loss, {k: v.detach() for k, v in metrics.items()}


def reference_pref_step(model, opt, batches, name: str, refs) -> tuple[float, dict, dict]:
    """One AdamW step of the written-out loss: the mean over the step's pairs (+ orpo's NLL of the chosen tokens over
    their count; + the MoE router loss, the mean over micro-batches). Returns (loss, gradients, metric means)."""
    opt.zero_grad(set_to_none=True)
    pairs = sum(b["input_ids"].shape[0] // 2 for b in batches)
    chosen = sum(int((b["labels"][0::2, 1:] != -100).sum()) for b in batches)
    total, metrics = 0.0, {}
    for b, ref in zip(batches, refs):
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
        logp, n = row_logps(out.logits, b["labels"])
        losses, ms = written_out(name, logp, n, ref)
        loss = losses.sum() / pairs
        if name == "orpo":
            loss = loss - logp[0::2].sum() / chosen
            metrics["nll_loss"] = metrics.get("nll_loss", 0.0) - logp[0::2].sum().item() / chosen
        if getattr(model.config, "output_router_logits", False):
            loss = loss + model.config.router_aux_loss_coef * out.aux_loss / len(batches)
        loss.backward()
        total += loss.item()
        for k, v in ms.items():
            metrics[k] = metrics.get(k, 0.0) + v.sum().item() / pairs
        # a pair whose rewards tie up to rounding (dpo at step 0: policy = reference) has no defined accuracy
        metrics["ties"] = metrics.get("ties", 0) + int((ms["rewards/margins"].abs() < 1e-5).sum())
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return total, grads, metrics


def frozen_logps(frozen, batches) -> list[torch.Tensor]:
    with torch.no_grad():
        return [row_logps(frozen(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                          b["labels"])[0] for b in batches]


def assert_pref_trains_like_reference(model_dir, name: str, steps: int, seed: int, n_micro: int = 2,
                                      lengths=(9, 13), **options) -> None:
    ref = load_reference(model_dir)
    frozen = copy.deepcopy(ref).eval()  # the reference model: the policy at step 0
    opt = reference_optimizer(ref)
    mt = Megatrain(model_dir, objective=OBJECTIVES[name], **options)
    for step in range(steps):
        batches = pair_batches(n_micro, 2, 97, list(lengths), seed=seed + step)
        refs = frozen_logps(frozen, batches) if OBJECTIVES[name].needs_reference else [None] * n_micro
        ref_loss, ref_grads, ref_metrics = reference_pref_step(ref, opt, batches, name, refs)
        loss, grads = mt.step(batches, ref_logps=refs if refs[0] is not None else None)
        assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"loss at step {step}: {loss} vs {ref_loss}"
        for k, g in grads.items():
            assert rel(g, ref_grads[k]) <= TOL, f"gradient of {k} at step {step}"
        m = mt.last.metrics
        assert m["pairs"].item() == 2 * n_micro
        for k, v in ref_metrics.items():
            if k == "ties" or (k == "rewards/accuracies" and ref_metrics["ties"]):
                continue
            assert abs(m[k].item() / m["pairs"].item() - v) <= TOL * max(1.0, abs(v)), f"{k} at step {step}"
    ref_params = dict(ref.named_parameters())
    for k, p in mt.params().items():
        assert rel(p, ref_params[k].detach()) <= TOL, f"{k} after {steps} steps"
    mt.close()


CASES = [("dpo", "llama", False), ("ipo", "llama", True), ("simpo", "qwen2", False), ("orpo", "qwen2", True),
         ("dpo", "qwen3_moe", True), ("ipo", "qwen3_moe", False), ("simpo", "mixtral", True),
         ("orpo", "qwen3_moe", False)]


@pytest.mark.parametrize("name,family,tied", CASES, ids=[f"{n}-{f}-{'tied' if t else 'untied'}" for n, f, t in CASES])
def test_twenty_steps_equal_the_written_out_loss(tmp_path, name, family, tied):
    make_model_dir(tmp_path, family, tied=tied, seed=21)
    assert_pref_trains_like_reference(tmp_path, name, steps=20, seed=400)


@pytest.mark.parametrize("name", ["dpo", "orpo"])
def test_bounded_placement_and_wave_groups(tmp_path, name):
    """Checkpoints every 2 layers, the lowest spilled, gradients to host, 3 wave groups parked on the host; the head
    in chunks of 3 targets (both passes cross chunk and row boundaries)."""
    make_model_dir(tmp_path, "llama", tied=name == "orpo", seed=22, layers=5)
    assert_pref_trains_like_reference(
        tmp_path, name, steps=4, seed=500, n_micro=3, lengths=(9, 13, 7), loss_chunk_tokens=3,
        placement=Placement(checkpoint_every=2, spill_layers=3, grads_to_host=3, wave_groups=3, group_grads="host"))


def test_tiling_and_reused_attention(tmp_path):
    make_model_dir(tmp_path, "qwen3_moe", seed=23, layers=4)
    assert_pref_trains_like_reference(tmp_path, "ipo", steps=3, seed=600, n_micro=2,
                                      placement=Placement(seq_tile=4, reuse_attention=2, wave_groups=2))


def test_ssd_tier(tmp_path):
    make_model_dir(tmp_path / "m", "llama", seed=24)
    (tmp_path / "ssd").mkdir()
    assert_pref_trains_like_reference(tmp_path / "m", "simpo", steps=3, seed=700, disk_path=str(tmp_path / "ssd"),
                                      disk_states=("v", "m"))


def test_gemma2_logit_softcap(tmp_path):
    """gemma2 caps its final logits (softcap·tanh): both passes of the head go through the cap."""
    make_model_dir(tmp_path, "gemma2", seed=25)
    assert_pref_trains_like_reference(tmp_path, "dpo", steps=3, seed=800)
