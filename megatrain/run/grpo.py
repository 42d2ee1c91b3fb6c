"""GRPO's rollout cycle inside the run's step loop (train.objective: grpo; docs/grpo.md).

A grpo run's "loader" is `Rollouts`: the step loop asks it for each optimizer step's micro-batches as it asks the
SFT loader (run/prefetch.py, drawn on the training thread: a rollout needs the weights of the step just trained).
When its rollout batch is used up it makes the next one:

    prompts     PromptSource.next_prompts(prompts_per_rollout)
    rollout     the sampler (megatrain/rollout) on the store's current weights, num_generations completions per
                prompt; its GPU copy and KV cache freed before training goes on
    rewards     megatrain.rl.rewards.score: the weighted sum per completion, each reward's values for the log
    advantages  per group of one prompt's completions: (r - mean) / (std + 1e-4) (TRL's unbiased std;
                scale_rewards false: r - mean)
    rows        prompt + completion, labels -100 on the prompt, right-padded to one length per rollout batch
                (row_length: compiled layers run one shape)
    log-probs   the old ones (the rollout's weights) when the batch feeds more than one optimizer step, the
                reference's (the store's frozen copy) when grpo.beta > 0: Engine.token_logps, forward only
    steps       num_iterations passes over the batch, each in an order shuffled from (train.seed, batch, pass),
                micro_batch_size * grad_accum_steps completions per optimizer step

Resume is exact mid-batch: the state after each step (`state_dict`) holds the prompt source's state and the
sampler's RNG after the batch was drawn, the step's position in the batch and, while the batch is not used up, the
batch itself (tokens, advantages, old and reference log-probs, its log fields). The batch cannot be made again
after a step has changed the weights, so it travels with the checkpoint (a few MB: the completions' token ids and
one float per completion token for each log-prob kind).
"""

from __future__ import annotations

import base64
import time

import torch

from ..errors import MegatrainError

STD_EPS = 1e-4  # TRL's: advantages = (r - mean) / (std + 1e-4)
ROW_GRANULE = 64  # a rollout batch's rows are padded to a multiple of this many tokens (row_length)


def group_advantages(rewards: torch.Tensor, n: int, scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [G*n] (grouped: a prompt's n completions together) -> (advantages [G*n], each group's std [G])."""
    g = rewards.double().reshape(-1, n)
    mean, std = g.mean(1, keepdim=True), g.std(1, keepdim=True)  # unbiased, as TRL's torch.std
    adv = g - mean
    if scale:
        adv = adv / (std + STD_EPS)
    return adv.reshape(-1).float(), std.reshape(-1).float()


def checked_advantages(total: torch.Tensor, per: dict, rewards, wheres: list[str], n: int,
                       scale: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """group_advantages, refused where an advantage or a group's std is beyond float32's range (rewards near its
    limit: r - mean can be twice the largest), which the loss would turn into NaN: one line naming the reward of
    the group's largest weighted value and the group's rows (`wheres`, one per completion)."""
    adv, std = group_advantages(total, n, scale)
    bad = ~(torch.isfinite(adv).reshape(-1, n).all(1) & torch.isfinite(std))
    if bad.any():
        g = int(bad.nonzero()[0])
        rows = slice(g * n, (g + 1) * n)
        r = max(rewards, key=lambda r: float((r.weight * per[r.name][rows].double()).abs().max()))
        raise MegatrainError(f"{r.key} ({r.name}): the rewards of {wheres[g * n]} ... {wheres[g * n + n - 1]} (a "
                             f"group, up to {float(total[rows].abs().max()):g}) give advantages or a std beyond "
                             f"float32's range (+-{torch.finfo(torch.float32).max:.4g}); scale the rewards down "
                             f"(their weights)")
    return adv, std


def row_weights(lengths: list[int], loss_type: str, max_new_tokens: int) -> list[float]:
    """w_r of each row of one optimizer step of rows with these completion lengths (runtime/objective.py's
    grpo_row_weights: grpo 1/(n_r S), dr_grpo 1/(S max_new_tokens), dapo 1/T)."""
    from ..runtime.objective import grpo_row_weights

    n = torch.tensor(lengths, dtype=torch.int64)
    return grpo_row_weights(loss_type, n, len(lengths), sum(lengths), max_new_tokens).tolist()


def row_length(rows: list[dict], cap: int) -> int:
    """The length every micro-batch of a rollout batch is right-padded to: its longest row rounded up to a multiple
    of ROW_GRANULE, at most `cap` (data.max_seq_len, the plan's). Compiled layers are specialised to a micro-batch's
    shape: padding each to its own longest row gave nearly every micro-batch a new length, so the layers compiled
    again until torch's recompile limit and then ran uncompiled."""
    longest = max(len(r["prompt"]) + len(r["completion"]) for r in rows)
    return max(longest, min(cap, -(-longest // ROW_GRANULE) * ROW_GRANULE))


def collate(rows: list[dict], pad_id: int, length: int = 0) -> dict:
    """Rows {prompt, completion (token ids), advantage, row_weight, old, ref (per completion token, or None)} ->
    one micro-batch's dict: input_ids, labels (-100 on the prompt and padding), attention_mask, right-padded to its
    longest row or `length`, and the grpo fields in target order."""
    T = max(max(len(r["prompt"]) + len(r["completion"]) for r in rows), length)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        p, c = r["prompt"], r["completion"]
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(c)
        mask[i, :len(p) + len(c)] = 1
    out = {"input_ids": ids, "labels": labels, "attention_mask": mask, "num_real_tokens": int(mask.sum()),
           "advantages": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
           "row_weight": torch.tensor([r.get("row_weight", 1.0) for r in rows], dtype=torch.float32)}
    for k, key in (("old", "old_logps"), ("ref", "ref_token_logps")):
        if rows[0].get(k) is not None:
            out[key] = torch.tensor([x for r in rows for x in r[k]], dtype=torch.float32)
    return out


def split_targets(values: list[torch.Tensor], rows: list[list[dict]]) -> list[list[float]]:
    """Each micro-batch's per-target values (target order: row-major) -> one list per row, in rows' order."""
    out = []
    for v, group in zip(values, rows):
        v = v.detach().float().cpu().tolist()
        at = 0
        for r in group:
            out.append(v[at:at + len(r["completion"])])
            at += len(r["completion"])
        if at != len(v):
            raise RuntimeError(f"token_logps gave {len(v)} log-probs for {at} completion tokens")
    return out


def batch_fields(per_reward: dict, total: torch.Tensor, group_std: torch.Tensor, lengths: list[int],
                 finished: list[bool]) -> dict:
    """A rollout batch's log fields, as TRL names them."""
    f = {"reward": float(total.mean()), "reward_std": float(group_std.mean()),
         "frac_reward_zero_std": float(torch.isclose(group_std, torch.zeros_like(group_std)).float().mean())}
    for name, v in per_reward.items():
        v = torch.as_tensor(v, dtype=torch.float64)
        f[f"rewards/{name}/mean"] = float(v.mean())
        f[f"rewards/{name}/std"] = float(v.std()) if v.numel() > 1 else 0.0
    n = torch.tensor(lengths, dtype=torch.float64)
    f.update({"completions/mean_length": float(n.mean()), "completions/min_length": float(n.min()),
              "completions/max_length": float(n.max()),
              "completions/clipped_ratio": 1.0 - sum(finished) / max(len(finished), 1)})
    return f


def grpo_fields(metrics: dict) -> dict:
    """StepOutput.metrics of a grpo step (token sums, and `tokens`) as a record's fields: clip_ratio/low_mean,
    clip_ratio/high_mean, clip_ratio/region_mean and kl as token means."""
    tokens = float(metrics.get("tokens", 0.0)) or 1.0
    return {k: float(v) / tokens for k, v in metrics.items() if k != "tokens"}


def _enc(values: list[list[float]] | None) -> dict | None:
    if values is None:
        return None
    flat = torch.tensor([x for v in values for x in v], dtype=torch.float32)
    return {"lengths": [len(v) for v in values], "data": base64.b64encode(flat.numpy().tobytes()).decode()}


def _dec(d: dict | None) -> list[list[float]] | None:
    if d is None:
        return None
    flat = torch.frombuffer(bytearray(base64.b64decode(d["data"])), dtype=torch.float32).tolist()
    out, at = [], 0
    for n in d["lengths"]:
        out.append(flat[at:at + n])
        at += n
    return out


class Rollouts:
    """The loader of a grpo run (next_step, state_dict, load_state_dict, summary; prefetch.StepPrefetcher draws
    from it on the training thread). `attach(run)` gives it the store and engine once the runtime is built."""

    def __init__(self, cfg, source, tokenizer, rewards, *, seed: int, rank: int = 0):
        g, t = cfg.grpo, cfg.train
        self.cfg, self.g, self.source, self.tokenizer, self.rewards = cfg, g, source, tokenizer, rewards
        self.seed, self.rank = seed, rank
        self.batch_rows = g.prompts_per_rollout * g.num_generations
        self.step_rows = t.micro_batch_size * t.grad_accum_steps
        if self.batch_rows % self.step_rows:
            raise MegatrainError(f"grpo: a rollout batch of {g.prompts_per_rollout} prompts x {g.num_generations} "
                                 f"completions = {self.batch_rows} rows does not split into optimizer steps of "
                                 f"train.micro_batch_size x grad_accum_steps = {self.step_rows} rows")
        self.steps_per_batch = self.batch_rows // self.step_rows * g.num_iterations
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        self.run = None
        self.generator = None
        self.batch = 0  # rollout batches drawn
        self.k = 0  # optimizer steps taken from the current batch (steps_per_batch: used up)
        self.rows: list[dict] | None = None
        self.fields: dict = {}  # the current batch's log fields
        self.last: dict = {}  # the log fields of the step last drawn (rollout_s, logps_s on its batch's first)

    @property
    def examples(self):
        return self.source

    def summary(self) -> str:
        s = self.source.summary
        s = "; ".join(s) if isinstance(s, (list, tuple)) else str(s)
        return (f"{s}; grpo: {self.g.prompts_per_rollout} prompts x {self.g.num_generations} completions per "
                f"rollout, {self.steps_per_batch} optimizer step(s) per rollout batch")

    def attach(self, run) -> None:
        self.run = run
        if self.generator is None:
            self.generator = torch.Generator(device=run.engine.device).manual_seed(self.seed * 1000003 + self.rank)

    # ---- the cycle ------------------------------------------------------------------------------------------
    def next_step(self) -> list[dict]:
        self.last = {"rollout_s": 0.0, "logps_s": 0.0}
        if self.rows is None or self.k >= self.steps_per_batch:
            self._rollout()
        per_pass = self.batch_rows // self.step_rows
        it, j = divmod(self.k, per_pass)
        perm = torch.randperm(self.batch_rows, generator=torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.batch * 1009 + it) & 0x7FFFFFFF)).tolist()
        rows = [self.rows[i] for i in perm[j * self.step_rows:(j + 1) * self.step_rows]]
        w = row_weights([len(r["completion"]) for r in rows], self.g.loss_type, self.g.max_new_tokens)
        rows = [{**r, "row_weight": x} for r, x in zip(rows, w)]
        mbs = self.cfg.train.micro_batch_size
        self.k += 1
        self.last.update(self.fields, rollout_batch=self.batch, rollout_step=self.k)
        T = row_length(self.rows, self.cfg.data.max_seq_len)
        return [collate(rows[i:i + mbs], self.pad_id, T) for i in range(0, len(rows), mbs)]

    def _rollout(self) -> None:
        from ..rl.rewards import score
        from ..rollout import SamplingParams, Sampler
        from ..rollout.weights import StoreWeights

        run, g = self.run, self.g
        if run is None:
            raise RuntimeError("Rollouts.attach(run) before the first step")
        t0 = time.perf_counter()
        run.pipeline.drain()  # the store's streaming copy holds the last step's weights
        t_drain = time.perf_counter()
        prompts = self.source.next_prompts(g.prompts_per_rollout)
        params = SamplingParams(g.max_new_tokens, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                n=g.num_generations, stop=tuple(g.stop), eos_token_ids=self.eos, seed=self.seed)
        sampler = Sampler(run.adapter.hf_config, StoreWeights(run.store, run.adapter), run.engine.device,
                          mode=self.mode(), dtype=run.store.compute_dtype, kv_on_host=self.kv_on_host())
        if run.engine.device.type == "cuda":
            torch.cuda.synchronize(run.engine.device)  # (resident: the weights' copy to the device is done)
        t_setup = time.perf_counter()
        try:
            out = sampler.generate([p.ids for p in prompts], params, tokenizer=self.tokenizer,
                                   generator=self.generator)
        finally:
            sampler.close()  # its GPU copy and KV cache are freed before training goes on
        if run.engine.device.type == "cuda":
            torch.cuda.empty_cache()
        rollout_s = time.perf_counter() - t0
        src = [prompts[i] for i in out.prompt_index]
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in out.completion_ids]
        total, per = score(self.rewards, [p.text for p in src], texts, src)  # (PromptRows: errors name file:line)
        adv, std = checked_advantages(torch.as_tensor(total), per, self.rewards, [p.where for p in src],
                                      g.num_generations, g.scale_rewards)
        rows = [{"prompt": list(p.ids), "completion": list(c), "advantage": float(a), "old": None, "ref": None}
                for p, c, a in zip(src, out.completion_ids, adv.tolist())]
        t1 = time.perf_counter()
        self._logps(rows)
        logps_s = time.perf_counter() - t1
        self.rows, self.k, self.batch = rows, 0, self.batch + 1
        lengths = [len(c) for c in out.completion_ids]
        self.fields = batch_fields(per, torch.as_tensor(total), std, lengths, list(out.finished))
        self.fields["rollout_tokens_per_s"] = out.stats.get("tokens_per_s", sum(lengths) / max(rollout_s, 1e-9))
        self.fields["rollout_mode"] = out.stats.get("mode", self.mode())
        # where a slow rollout's time went: the wait for the last step's updates, the sampler's set-up (resident:
        # the weights' copy to the device), its prefill and decode steps (median and slowest)
        self.fields.update(rollout_drain_s=t_drain - t0, rollout_setup_s=t_setup - t_drain)
        for k in ("prefill_s", "decode_s", "decode_step_median_s", "decode_step_max_s"):
            self.fields[f"rollout_{k}"] = out.stats.get(k)
        self.last.update(rollout_s=rollout_s, logps_s=logps_s)

    def mode(self) -> str:
        """grpo.rollout, or the plan's choice with auto (resident without a plan: the CPU)."""
        if self.g.rollout != "auto":
            return self.g.rollout
        plan = self.run.plan if self.run is not None else None
        return (getattr(plan, "rollout", None) or {}).get("mode", "resident")

    def kv_on_host(self) -> bool:
        """The plan's: a streamed rollout's KV cache in pinned host memory when the GPU cannot hold it."""
        plan = self.run.plan if self.run is not None else None
        return bool((getattr(plan, "rollout", None) or {}).get("kv_on_host", False)) and self.mode() == "streamed"

    @property
    def needs_old(self) -> bool:
        """The old log-probs differ from the current ones' detached values once an optimizer step has changed the
        weights within the batch: num_iterations > 1, or a batch of several optimizer steps."""
        return self.steps_per_batch > 1

    def _logps(self, rows: list[dict]) -> None:
        """The old (rollout weights) and reference (grpo.beta > 0) log-probs of every completion token."""
        kinds = [k for k, on in (("old", self.needs_old), ("ref", self.g.beta > 0)) if on]
        if not kinds:
            return
        from ..runtime import MicroBatch

        mbs = self.cfg.train.micro_batch_size
        groups = [rows[i:i + mbs] for i in range(0, len(rows), mbs)]
        T = row_length(rows, self.cfg.data.max_seq_len)
        batches = [collate(gr, self.pad_id, T) for gr in groups]
        wave = max(1, self.cfg.train.grad_accum_steps)
        for kind in kinds:
            values = []
            for i in range(0, len(batches), wave):
                mb = [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"])
                      for b in batches[i:i + wave]]
                values += self.run.engine.token_logps(mb, weights="policy" if kind == "old" else "reference")
            for r, v in zip(rows, split_targets(values, groups)):
                r[kind] = v

    # ---- checkpoint -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The position after the last step drawn: prompt source and sampler RNG (after the current batch was
        drawn), batch count and step within it, and the batch while steps of it are left."""
        out = {"grpo": 1, "prompts": self.source.state_dict(), "batch": self.batch, "k": self.k,
               "rng": None if self.generator is None else
               base64.b64encode(self.generator.get_state().numpy().tobytes()).decode(),
               "rng_device": None if self.generator is None else str(self.generator.device)}
        if self.rows is not None and self.k < self.steps_per_batch:
            out["rows"] = {"prompt": [r["prompt"] for r in self.rows],
                           "completion": [r["completion"] for r in self.rows],
                           "advantage": _enc([[r["advantage"]] for r in self.rows]),
                           "old": _enc([r["old"] for r in self.rows]) if self.rows[0]["old"] is not None else None,
                           "ref": _enc([r["ref"] for r in self.rows]) if self.rows[0]["ref"] is not None else None,
                           "fields": self.fields}
        return out

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("grpo") != 1:
            raise MegatrainError("resume: the checkpoint was not written by a grpo run (train.objective: grpo); "
                                 "resume it with its own objective, or start over")
        self.source.load_state_dict(state["prompts"])
        self.batch, self.k = int(state["batch"]), int(state["k"])
        if state.get("rng") is not None:
            dev = state.get("rng_device") or "cpu"
            self.generator = torch.Generator(device=dev)
            self.generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state["rng"])), dtype=torch.uint8))
        self.rows, self.fields = None, {}
        if (r := state.get("rows")) is not None:
            adv, old, ref = _dec(r["advantage"]), _dec(r["old"]), _dec(r["ref"])
            n = len(r["prompt"])
            self.rows = [{"prompt": r["prompt"][i], "completion": r["completion"][i], "advantage": adv[i][0],
                          "old": old[i] if old else None, "ref": ref[i] if ref else None} for i in range(n)]
            self.fields = r["fields"]
        elif self.k < self.steps_per_batch and self.batch:
            raise MegatrainError("resume: the checkpoint's grpo state lacks its rollout batch")
        if self.rows is None:
            self.k = self.steps_per_batch  # the next step makes a batch


def check_world(world_size: int) -> None:
    if world_size > 1:
        raise MegatrainError("train.objective: grpo runs in one process (its rollouts use the node's one store and "
                             "GPU); run `megatrain train` without torchrun")


def rollouts(cfg, tokenizer, rank: int = 0) -> Rollouts:
    """A grpo run's loader, its inputs checked: every reward imported (grpo.rewards) and every prompt read and
    tokenised (data.*), each error one line naming the culprit; nothing written."""
    from pathlib import Path

    from ..data.prompts import build_prompt_source
    from ..rl.rewards import load_rewards

    rewards = load_rewards(cfg.grpo.rewards, Path.cwd())  # (config.py resolves a .py path against its file)
    source = build_prompt_source(cfg, tokenizer, seed=cfg.train.seed, rank=rank, world=1)
    return Rollouts(cfg, source, tokenizer, rewards, seed=cfg.train.seed, rank=rank)


def step_split(fields: dict, step_s: float) -> dict:
    """A grpo step's fields with its time split: rollout_s and logps_s (on a rollout batch's first step, else 0)
    and train_s, the rest of the step."""
    out = dict(fields)
    out["train_s"] = max(0.0, step_s - out.get("rollout_s", 0.0) - out.get("logps_s", 0.0))
    return out
