"""Evaluation with the streaming engine: held-out loss, and greedy decoding for exact match; for a preference
objective, the held-out pairs' objective loss, TRL's rewards and log-probs, and preference accuracy."""

from __future__ import annotations

import torch

from ..runtime import Engine, MicroBatch

TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
               "logps/rejected")  # a preference objective's metrics, as TRL names them (runtime/objective.py)
ORPO_METRICS = ("log_odds_ratio", "log_odds_chosen")


def evaluate(run, step: int, log, stop=None) -> dict:
    """Held-out loss (data.eval_*) and exact match (train.exact_match_path) at `step`; logged when any. In a
    distributed run each rank evaluates its share of the examples and the sums are all-reduced. stop: a
    StopOnSignal; once it holds a request the evaluation ends between two batches (or two decoding steps), its
    numbers are neither logged nor returned, and the record says `eval_stopped_by`."""
    record = {"step": step}
    rank, world = run.ranks.world.rank, run.ranks.world.size
    stopping = (lambda: stop.requested is not None) if stop is not None else (lambda: False)
    if run.eval_batches and run.preference:
        record.update(preference_eval(run, stopping))
    elif run.eval_batches:
        total, count = 0.0, 0
        for b in run.eval_batches[rank::world]:
            if stopping():
                break
            loss, n = run.engine.eval_loss([MicroBatch.from_labels(b["input_ids"], b["labels"],
                                                                   b.get("position_ids"))])
            total, count = total + loss * n, count + n
        total, count = run.ranks.all_sum([total, count])
        record["eval_loss"] = total / max(count, 1)
    if run.exact_match:  # (cut short, it returns at once: every rank still takes part in the sums)
        hits = exact_match_hits(run.engine, run.tokenizer, run.exact_match[rank::world], stopping=stopping)
        (hits,) = run.ranks.all_sum([hits])
        record["eval_exact_match"] = hits / len(run.exact_match)
    if stopping():  # cut short: partial numbers would mislead
        log.info(f"evaluation at step {step} cut short by {stop.requested}: not logged")
        return {"step": step, "eval_stopped_by": stop.requested}
    if len(record) > 1:
        log.log(record)
    return record


@torch.no_grad()
def preference_eval(run, stopping) -> dict:
    """Over the held-out pairs (this rank's share; sums over every rank): eval_loss, the objective's mean pair loss;
    eval_rewards/* and eval_logps/* as TRL names them; eval_preference_accuracy, the share of pairs whose chosen
    side the policy gives the higher log-prob (length-normalised for ipo, simpo and orpo, as their rewards are)."""
    from ..runtime.objective import pair_loss
    from .reference import microbatches

    obj = run.engine.options.objective
    sums: dict[str, float] = {}
    rank, world = run.ranks.world.rank, run.ranks.world.size
    for i in range(rank, len(run.eval_batches), world):
        if stopping():
            break
        b = run.eval_batches[i]
        mbs = microbatches([b])
        run.reference.eval_refs(run.engine, mbs[0], b, i)
        logp, n = run.engine.sequence_logps(mbs)
        logp, n = logp.detach().double().cpu(), n.cpu()
        ref = mbs[0].ref_logps.double() if obj.needs_reference else None
        loss, metrics = pair_loss(obj, logp, n, ref)
        score = logp if obj.name == "dpo" else logp / n
        wins = float((score[0::2] > score[1::2]).sum())
        for k, v in {"loss": float(loss), "preference_accuracy": wins, "pairs": float(len(b["pair_ids"])),
                     "nll": -float(logp[0::2].sum()), "chosen_tokens": float(n[0::2].sum()),
                     **{k: float(v) for k, v in metrics.items() if k != "pairs"}}.items():
            sums[k] = sums.get(k, 0.0) + v
    keys = ["loss", "preference_accuracy", "pairs", "nll", "chosen_tokens", *TRL_METRICS,
            *(ORPO_METRICS if obj.name == "orpo" else ())]
    totals = dict(zip(keys, run.ranks.all_sum([sums.get(k, 0.0) for k in keys])))  # the same keys on every rank
    pairs, nll = max(totals.pop("pairs"), 1.0), totals.pop("nll") / max(totals.pop("chosen_tokens"), 1.0)
    out = {f"eval_{k}": v / pairs for k, v in totals.items()}
    if obj.name == "orpo":  # its SFT term: the chosen sides' token NLL, a token mean over the held-out pairs
        out.update(eval_loss=out["eval_loss"] + nll, eval_nll_loss=nll)
    return out


@torch.no_grad()
def greedy_generate(engine: Engine, prompts: list[list[int]], max_new_tokens: int, eos_id: int | None,
                    pad_id: int, stopping=lambda: False) -> list[list[int]]:
    """Greedy continuation of each prompt (no KV cache: meant for small held-out checks); stopping() true: the
    continuations so far."""
    seqs = [list(p) for p in prompts]
    done = [False] * len(seqs)
    outs: list[list[int]] = [[] for _ in seqs]
    for _ in range(max_new_tokens):
        live = [i for i, d in enumerate(done) if not d]
        if not live or stopping():
            break
        T = max(len(seqs[i]) for i in live)
        ids = torch.full((len(live), T), pad_id, dtype=torch.long)
        for r, i in enumerate(live):
            ids[r, : len(seqs[i])] = torch.tensor(seqs[i])
        lengths = torch.tensor([len(seqs[i]) for i in live])
        nxt = engine.next_token_logits(ids, lengths).argmax(-1).tolist()
        for i, t in zip(live, nxt):
            if eos_id is not None and t == eos_id:
                done[i] = True
                continue
            seqs[i].append(t)
            outs[i].append(t)
    return outs


def exact_match_hits(engine: Engine, tokenizer, examples: list[tuple[str, str]], max_new_tokens: int = 32,
                     stopping=lambda: False) -> int:
    """How many (prompt, expected answer) pairs' greedy answer equals the expected one, after strip()."""
    if not examples:
        return 0
    prompts = []
    for prompt, _ in examples:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                            add_generation_prompt=True)
        prompts.append(ids["input_ids"] if hasattr(ids, "keys") else ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    outs = greedy_generate(engine, prompts, max_new_tokens, tokenizer.eos_token_id, pad, stopping)
    return sum(tokenizer.decode(o, skip_special_tokens=True).strip() == want.strip()
               for o, (_, want) in zip(outs, examples))


def exact_match(engine: Engine, tokenizer, examples: list[tuple[str, str]], max_new_tokens: int = 32) -> float:
    """Share of (prompt, expected answer) pairs whose greedy answer equals the expected one, after strip()."""
    return exact_match_hits(engine, tokenizer, examples, max_new_tokens) / max(1, len(examples))
