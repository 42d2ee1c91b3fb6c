"""What a preference objective (train.objective dpo, ipo, simpo, orpo) adds to the plan of its step.

A preference step is a step of 2 x train.micro_batch_size rows per micro-batch (each pair's chosen and rejected;
workload_from_config), so the layers' work, memory and the weights' streaming are the SFT plan's. On top of it:

- the LM head needs each row's log-prob before the objective's per-row gradient: where a pair's targets fit one
  head chunk it walks chunks of whole pairs, each chunk's logits computed once (no extra work:
  runtime/head_objective.pair_chunks); else a forward-only pass over every target comes before its usual chunk
  loop: 2 FLOPs per head parameter and target;
- dpo and ipo need the reference model's log-probs, in one of two ways (preference.reference):
  precompute  a forward-only streaming pass over every training and held-out pair before step 1: a forward wave
              per group of grad_accum_steps micro-batches, each the larger of its compute and the weights' H2D;
  stream      that forward for each step's micro-batches, from a frozen bf16 copy of the weights in host RAM
              (+2 B/param), its own H2D each step.
  `auto` picks precompute when the pass is no more work than streaming (the run uses every pair at least once:
  each step would redo its pairs' forward) or host RAM cannot take the copy; else stream (the run sees fewer pairs
  than the set holds, which the pass would all score).

`plan_objective` adds these figures to a Plan (Plan.objective; report.py prints them, the step time includes the
per-step work); `choose` is the decision alone, which the run takes again with the data's pair counts.
"""

from __future__ import annotations

from ..runtime.lmhead import default_chunk
from .profile import GiB
from .timing import executed_flops

REFERENCE_COPY = "reference copy (bf16, preference.reference: stream)"


def choose(asked: str, pass_pairs: int, stream_pairs: int, fits_stream: bool = True) -> tuple[str, str]:
    """(strategy, why): `asked` unless auto. pass_pairs: the pairs the precompute pass scores (training set + held
    out); stream_pairs: the pairs the run scores with a streamed copy (steps x pairs per step + held out at each
    evaluation)."""
    if asked != "auto":
        return asked, f"preference.reference: {asked}"
    if not fits_stream:
        return "precompute", "auto: host RAM cannot also hold the stream's reference copy (+2 B/param)"
    if pass_pairs <= stream_pairs:
        return "precompute", (f"auto: the pass scores {pass_pairs:,} pairs once, streaming would score "
                              f"{stream_pairs:,} (the run sees each pair {stream_pairs / max(pass_pairs, 1):.1f}x), "
                              f"and needs no reference copy in host RAM")
    return "stream", (f"auto: the run scores {stream_pairs:,} pairs, fewer than the {pass_pairs:,} a pass over the "
                      f"whole set would")


def plan_objective(plan, cfg, adapter, set_pairs: int | None = None, eval_pairs: int = 0, evals: int = 0) -> None:
    """Add the objective's figures to `plan` (idempotent: a later call with the data's counts replaces them).
    set_pairs: training pairs in the data (None: unknown at plan time, taken as the pairs the run draws);
    eval_pairs, evals: held-out pairs and evaluations of the run."""
    objective = cfg.train.objective
    plan.time.update(plan.objective.get("sft_time", {}))  # a second call starts from the SFT step's figures
    plan.host.pop(REFERENCE_COPY, None)
    plan.problems[:] = [p for p in plan.problems if "reference copy" not in p]
    base, scaled = plan.time["step_s"], ("step_s", "tokens_per_s", "executed_tflops", "tflops_6n", "tflops_6n_active",
                                         "mfu")
    sft_time = {k: plan.time[k] for k in scaled if k in plan.time}
    if objective in ("sft", "grpo"):  # (grpo's head pass and rollouts: rollout_plan.py)
        plan.objective = {}
        return
    w, t, prof = plan.workload, plan.time, plan.profile
    pairs_step = sum(w.micro_batches) // 2 * plan.world.size
    units = adapter.units()
    fl = executed_flops(adapter, units, w)
    targets = sum(w.micro_batches) * (w.seq_len - 1)
    head_fwd = 2.0 * adapter.vocab_size * adapter.hidden_size * targets
    rate = t["executed_flops"] / max(t["compute_s"], 1e-12)  # the step's own rate, FLOPs per second
    head_rate = prof.head_flops if w.device == "cuda" else rate
    chunk = w.loss_chunk_tokens or default_chunk(adapter.vocab_size)  # the Engine's head chunk
    one_pass = 2 * (w.targets_per_row or w.seq_len - 1) <= chunk
    extra_head = 0.0 if one_pass else head_fwd / head_rate
    forward_s = (fl["forward"] + head_fwd) / rate  # a forward-only wave over one step's rows
    out = {"objective": objective, "pairs_per_step": pairs_step, "extra_head_s": extra_head, "one_pass": one_pass,
           "base_step_s": base,
           "forward_s": forward_s}  # (the host and problems keys named REFERENCE_COPY are this function's)
    if objective in ("dpo", "ipo"):
        used = cfg.train.steps * pairs_step
        n_set = used if set_pairs is None else set_pairs
        pass_pairs, stream_pairs = n_set + eval_pairs, used + eval_pairs  # held-out pairs: scored once either way
        copy = 2.0 * plan.params
        h2d_copy = copy / prof.h2d_bps if w.device == "cuda" else 0.0
        h2d_policy = plan.params * w.stream_elem / prof.h2d_bps if w.device == "cuda" else 0.0
        wave_pass = max(forward_s, h2d_copy if cfg.preference.reference_path else h2d_policy)
        wave_stream = max(forward_s, h2d_copy)
        fits = plan.host_available is None or plan.host_total + copy <= plan.host_available
        strategy, why = choose(cfg.preference.reference, pass_pairs, stream_pairs, fits)
        if set_pairs is None and cfg.preference.reference == "auto":
            why += "; the set's pairs are counted when the run reads the data, and it decides again"
        waves = -(-pass_pairs // max(pairs_step, 1))
        out.update(reference=strategy, why=why, pass_pairs=pass_pairs, stream_pairs=stream_pairs,
                   pass_s=waves * wave_pass, stream_step_s=wave_stream, stream_h2d_s=h2d_copy,
                   stream_host_bytes=copy, stream_run_s=cfg.train.steps * wave_stream)
        if strategy == "stream":
            plan.host[REFERENCE_COPY] = copy
            if plan.host_available is not None and plan.host_total > plan.host_available:
                plan.problems.append(f"host RAM: needs {plan.host_total / GiB:.1f} GiB with the stream's "
                                     f"reference copy, {plan.host_available / GiB:.1f} GiB available "
                                     f"({plan.host_source}); set preference.reference: precompute")
    step = base + extra_head + (out["stream_step_s"] if out.get("reference") == "stream" else 0.0)
    for k in scaled[1:]:  # rates over the longer step
        if t.get(k):
            t[k] *= base / step
    t["step_s"] = step
    out["sft_time"] = sft_time
    plan.objective = out


def objective_lines(plan) -> list[str]:
    """The plan report's section on the objective (empty for sft)."""
    o = plan.objective
    if not o:
        return []
    head = ("the LM head takes chunks of whole pairs, each chunk's logits once: no extra pass" if o.get("one_pass")
            else f"the LM head's forward-only pass for each row's log-prob: +{o['extra_head_s']:.3f} s per step")
    lines = [f"objective: {o['objective']}, {o['pairs_per_step']:,} pairs per step (2 rows each); {head}"]
    if "reference" in o:
        lines.append(f"  reference: {o['reference']} ({o['why']})")
        lines.append(f"    precompute: a forward pass over {o['pass_pairs']:,} pairs before step 1, "
                     f"{o['pass_s']:.1f} s")
        lines.append(f"    stream: {o['stream_host_bytes'] / GiB:.2f} GiB host RAM (bf16 copy), a forward per step "
                     f"{o['stream_step_s']:.3f} s (H2D {o['stream_h2d_s']:.3f} s), {o['stream_run_s']:.1f} s over "
                     f"the run")
    else:
        lines.append("  reference: none (the objective is reference-free)")
    lines.append(f"  step with the objective: {o['base_step_s']:.2f} s -> {plan.time['step_s']:.2f} s")
    return lines
