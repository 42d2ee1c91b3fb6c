"""What a grpo run (train.objective: grpo) adds to the plan of its step: the rollout phase (docs/grpo.md).

A grpo step trains micro_batch_size completions per micro-batch (one row each), so the layers' work, memory and
streaming are the SFT plan's for those rows; the LM head runs a forward-only pass over every target before its chunk
loop (each token's log-prob first, then its weight in the loss), as a preference objective's does. On top of it,
once per rollout batch (prompts_per_rollout x num_generations completions, `steps_per_batch` optimizer steps):

    rollout    the last step's updates finished first (the store's copy is what the sampler reads: with clipping
               the whole update, which otherwise overlaps the next forward), a resident sampler's copy of the
               weights to the device, then the sampler (megatrain/rollout): prefill + max_new_tokens decode steps, every sequence taken to
               max_new_tokens (an upper bound: finished rows leave the live batch). resident: the bf16 weights on
               the GPU beside the KV cache; streamed: each decode step streams the layers once (the bus bound),
               the KV cache on the GPU or, when it does not fit there, in pinned host memory. Figures from the
               rollout_estimate.py.
    log-probs  a forward-only pass over the batch for the old log-probs (a batch of more than one optimizer step)
               and one for the reference's (grpo.beta > 0, from the store's frozen bf16 copy, +2 B/param host RAM)

`auto` picks resident when the weights and the KV cache fit in the GPU's limit (the training phase's memory is
freed first: the phases never overlap), else streamed; on a CPU device the weights are in host memory already.
The step time with rollout spreads a batch's rollout and log-probs over its optimizer steps.
"""

from __future__ import annotations

from .profile import GiB
from .timing import executed_flops

REFERENCE_COPY = "reference copy (bf16, grpo.beta > 0)"


def choose_mode(asked: str, device: str, resident_need: float, gpu_limit: float | None) -> tuple[str, str]:
    """(mode, why): grpo.rollout unless auto."""
    if asked != "auto":
        return asked, f"grpo.rollout: {asked}"
    if device != "cuda":
        return "resident", f"auto: on {device} the weights are in host memory already"
    if gpu_limit is None:
        return "resident", "auto: the GPU's memory is unknown, resident assumed"
    if resident_need <= gpu_limit:
        return "resident", (f"auto: the bf16 weights and the KV cache ({resident_need / GiB:.1f} GiB) fit in the "
                            f"GPU's {gpu_limit / GiB:.1f} GiB")
    return "streamed", (f"auto: the bf16 weights and the KV cache ({resident_need / GiB:.1f} GiB) exceed the GPU's "
                        f"{gpu_limit / GiB:.1f} GiB")


def plan_rollout(plan, cfg, adapter) -> None:
    """Add the rollout phase to `plan` (Plan.rollout; report.py prints it). No-op unless train.objective is grpo."""
    if cfg.train.objective != "grpo":
        plan.rollout = {}
        return
    from .rollout_estimate import rollout_estimate

    g, t, w, prof = cfg.grpo, cfg.train, plan.workload, plan.profile
    seqs = g.prompts_per_rollout * g.num_generations
    prompt_len = max(1, cfg.data.max_seq_len - g.max_new_tokens)
    step_rows = t.micro_batch_size * t.grad_accum_steps
    steps = max(1, seqs // step_rows) * g.num_iterations

    def est(mode: str) -> dict:
        return rollout_estimate(adapter.hf_config, seqs, prompt_len, g.max_new_tokens, mode, prof)

    resident = est("resident")
    mode, why = choose_mode(g.rollout, w.device, resident["resident_bytes"] + resident["kv_bytes"], plan.gpu_limit)
    e = resident if mode == "resident" else est("streamed")
    kv_on_host = mode == "streamed" and plan.gpu_limit is not None and e["kv_bytes"] > plan.gpu_limit * 0.9
    if kv_on_host:
        why += "; the KV cache does not fit on the GPU either: it lives in pinned host memory"
    tm = plan.time
    # before the sampler starts: the last step's updates finish (with clipping all of them run after its GPU work;
    # without, the tail that outlasts the backward), and a resident sampler copies the bf16 weights to the device
    drain_s = tm.get("optimizer_s", 0.0) if w.clipping else tm.get("optimizer_wait_s", 0.0)
    setup_s = e["resident_bytes"] / prof.h2d_bps if mode == "resident" and w.device == "cuda" else 0.0
    rollout_s = drain_s + setup_s + e["prefill_s"] + e["decode_step_s"] * g.max_new_tokens
    # the head's forward-only pass (every target's log-prob first), and the forward-only log-prob passes
    units = adapter.units()
    fl = executed_flops(adapter, units, w)
    targets = sum(w.micro_batches) * (w.seq_len - 1)
    head_fwd = 2.0 * adapter.vocab_size * adapter.hidden_size * targets
    rate = tm["executed_flops"] / max(tm["compute_s"], 1e-12)
    extra_head = head_fwd / (prof.head_flops if w.device == "cuda" else rate)
    h2d = plan.params * w.stream_elem / prof.h2d_bps if w.device == "cuda" else 0.0
    wave = max((fl["forward"] + head_fwd) / rate, h2d)  # one step's rows, forward only
    kinds = (["old"] if steps > 1 else []) + (["reference"] if g.beta > 0 else [])
    logps_s = len(kinds) * wave * max(1, seqs // step_rows)
    if g.beta > 0:
        plan.host[REFERENCE_COPY] = 2.0 * plan.params
    base = tm["step_s"]
    train_s = base + extra_head
    step = train_s + (rollout_s + logps_s) / steps
    plan.rollout = {"mode": mode, "why": why, "kv_on_host": kv_on_host, "seqs": seqs, "prompt_len": prompt_len,
                    "max_new_tokens": g.max_new_tokens, "kv_bytes": e["kv_bytes"],
                    "resident_bytes": e["resident_bytes"], "decode_step_s": e["decode_step_s"],
                    "drain_s": drain_s, "setup_s": setup_s, "prefill_s": e["prefill_s"], "rollout_s": rollout_s, "tokens_per_s": e["tokens_per_s"],
                    "bound": e.get("bound", ""), "logps": kinds, "logps_s": logps_s, "extra_head_s": extra_head,
                    "train_step_s": train_s, "steps_per_batch": steps, "step_with_rollout_s": step}


def rollout_lines(plan) -> list[str]:
    """The plan report's section on the rollout phase (empty unless grpo)."""
    r = getattr(plan, "rollout", None)
    if not r:
        return []
    where = "pinned host memory" if r["kv_on_host"] else "the GPU" if plan.workload.device == "cuda" else "host memory"
    lines = [f"rollout (grpo): {r['mode']} ({r['why']})",
             f"  {r['seqs']:,} completions per batch, prompts up to {r['prompt_len']:,} tokens + "
             f"{r['max_new_tokens']:,} new; KV cache {r['kv_bytes'] / GiB:.2f} GiB in {where}"
             + (f", resident weights {r['resident_bytes'] / GiB:.2f} GiB" if r["mode"] == "resident" else ""),
             f"  decode step {r['decode_step_s'] * 1e3:.2f} ms" + (f" (bound by {r['bound']})" if r["bound"] else "")
             + f", prefill {r['prefill_s']:.2f} s, rollout {r['rollout_s']:.1f} s per batch, "
             f"{r['tokens_per_s']:,.0f} rollout tokens/s",
             f"  before it: the last step's updates {r['drain_s']:.2f} s"
             + (f", the weights to the device {r['setup_s']:.2f} s" if r["setup_s"] else ""),
             f"  log-probs: " + (f"{' and '.join(r['logps'])}, {r['logps_s']:.2f} s per batch" if r["logps"] else
                                 "none (the batch feeds one optimizer step, no KL term)"),
             f"  training step {r['train_step_s']:.2f} s (the head's forward-only pass +{r['extra_head_s']:.3f} s); "
             f"{r['steps_per_batch']} optimizer step(s) per rollout batch",
             f"  step with rollout: {r['step_with_rollout_s']:.2f} s"]
    return lines
