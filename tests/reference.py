"""A plain transformers + torch.optim.AdamW reference, and megatrain driven the same way, for equivalence tests."""

from __future__ import annotations

import copy

import torch

from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime import CpuAdamW, EngineOptions, HostStore, MicroBatch, RuntimeOptions, build_runtime
from megatrain.runtime.adamw import clip_coefficient

# eps = 1e-6: with eps = 1e-8, AdamW's first steps turn an fp32 rounding difference dg in a near-zero gradient
# element into an update difference of up to lr * dg / eps, and two correct fp32 implementations (megatrain and
# transformers here) drift apart by ~1e-5 within a few steps. A standard, larger eps bounds that amplification.
LR, WD, MAX_NORM, EPS = 1e-3, 0.1, 1.0, 1e-6


def reference_optimizer(model) -> torch.optim.AdamW:
    """Weight decay on matrices and embeddings, none on norms and biases (megatrain's default split; gpt_oss's expert
    biases are [experts, width] and still biases)."""
    def decayed(n, p):
        return p.ndim >= 2 and not n.endswith("bias")

    decay = [p for n, p in model.named_parameters() if decayed(n, p)]
    rest = [p for n, p in model.named_parameters() if not decayed(n, p)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}],
                             lr=LR, betas=(0.9, 0.999), eps=EPS, fused=True)


def reference_step(model, opt, batches, max_norm=MAX_NORM) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step over micro-batches: loss = sum of token losses / all target tokens of the step."""
    opt.zero_grad(set_to_none=True)
    total = _backward(model, batches)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    if max_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    opt.step()
    return total, grads


def _backward(model, batches) -> float:
    """The step's loss (sum of token losses / all target tokens of the step) backpropagated into model's .grad."""
    n_items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    total = 0.0
    moe = getattr(model.config, "output_router_logits", False)
    for b in batches:
        out = model(input_ids=b["input_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"],
                    num_items_in_batch=n_items)
        loss = out.loss
        if moe:  # transformers adds coef * aux per micro-batch; megatrain's step takes their mean (router_loss.py)
            loss = loss - (1 - 1 / len(batches)) * model.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        total += loss.item()
    return total


def exact_grads(model, params: dict[str, torch.Tensor], batches) -> dict[str, torch.Tensor]:
    """The step's gradients in float64 at the weights `params` (HF name -> tensor, megatrain's layout allowed):
    a float64 copy of the reference model given those weights, the loss of reference_step."""
    m = copy.deepcopy(model).double()
    if getattr(m.config, "_experts_implementation", None) not in (None, "eager"):
        m.set_experts_implementation("eager")  # (grouped_mm takes no float64)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(params[n].reshape(p.shape))
    m.zero_grad(set_to_none=True)
    _backward(m, batches)
    return {n: p.grad for n, p in m.named_parameters()}


class Megatrain:
    """megatrain's runtime as the trainer builds it (`build_runtime`), driven step by step, on CPU.

    Engine options (placement, compile_layers, loss_chunk_tokens, ...) and threaded_optimizer are passed through
    to RuntimeOptions."""

    def __init__(self, model_dir, dtype=torch.float32, *, threaded_optimizer: bool | None = None,
                 disk_path=None, disk_states=(), **engine_options):
        self.adapter = get_adapter(load_hf_config(model_dir))
        stream = engine_options["placement"].stream_dtype if "placement" in engine_options else "bf16"
        self.store = HostStore(self.adapter, torch.float32 if stream == "fp32" else dtype, dtype, disk_path=disk_path,
                               disk_states=tuple(disk_states))
        self.store.load_safetensors(model_dir)
        self.opt = CpuAdamW(eps=EPS, weight_decay=WD)
        self.runtime = build_runtime(self.store, "cpu", self.opt, RuntimeOptions(
            engine=EngineOptions(**engine_options), threaded_optimizer=threaded_optimizer))
        self.engine, self.pipeline = self.runtime.engine, self.runtime.pipeline

    def train_step(self, batches, max_norm=MAX_NORM, lr=LR, keep_grads: bool = False, ref_logps=None, mbs=None):
        """One step as the trainer takes it: the engine's waves, the norm, the pipeline's update. Returns
        (loss, grad norm, {HF name: gradient} when keep_grads); the engine's StepOutput is kept as `last`.
        ref_logps: each micro-batch's reference log-probs (a preference objective). mbs: the step's MicroBatches
        as given (grpo's carry their advantages, weights and log-probs), instead of built from `batches`."""
        mbs = self.microbatches(batches, ref_logps) if mbs is None else mbs
        out = self.last = self.engine.train_step(mbs)
        norm = out.grad_sq_norm.sqrt().item()
        grads = {}
        if keep_grads:  # the finished gradients, before the update consumes them
            for i, tile in enumerate(self.store.tiles):
                for s, g in zip(tile.unit.specs, tile.views(self.pipeline.gradient(i)).values()):
                    grads[s.hf_name] = g.clone()
        self.pipeline.finish_step(lr=lr, clip_coef=clip_coefficient(norm, max_norm))
        return out.loss_sum.item(), norm, grads

    def step(self, batches, max_norm=MAX_NORM, lr=LR, ref_logps=None) -> tuple[float, dict[str, torch.Tensor]]:
        loss, _, grads = self.train_step(batches, max_norm, lr, keep_grads=True, ref_logps=ref_logps)
        return loss, grads

    @staticmethod
    def microbatches(batches, ref_logps=None) -> list[MicroBatch]:
        return [MicroBatch.from_labels(b["input_ids"], b["labels"], None, b.get("attention_mask"),
                                       ref_logps=None if ref_logps is None else ref_logps[m])
                for m, b in enumerate(batches)]

    def params(self) -> dict[str, torch.Tensor]:
        self.pipeline.drain()
        return {s.hf_name: v for t in self.store.tiles for s, v in zip(t.unit.specs, t.views(t.master).values())}

    def close(self) -> None:
        self.pipeline.drain()
        self.runtime.close()


def random_batches(n_micro: int, batch: int, vocab: int, lengths: list[int], seed: int, pad_id: int = 0):
    """Micro-batches of unequal lengths, right-padded, with a masked prompt prefix in some rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(n_micro):
        T = lengths[m % len(lengths)]
        ids = torch.randint(3, vocab, (batch, T), generator=g)
        labels = ids.clone()
        mask = torch.ones(batch, T, dtype=torch.long)
        for r in range(batch):
            real = int(torch.randint(T // 2, T + 1, (1,), generator=g))
            ids[r, real:] = pad_id
            labels[r, real:] = -100
            mask[r, real:] = 0
            labels[r, : int(torch.randint(0, 3, (1,), generator=g))] = -100  # a masked prompt
        out.append({"input_ids": ids, "labels": labels, "attention_mask": mask})
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of a to b; a may hold b's elements in another shape (megatrain's stacked experts
    [E, 2, I, H] against transformers' gate_up_proj [E, 2I, H])."""
    a = a.reshape(b.shape)
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def pair_batches(n_micro: int, pairs: int, vocab: int, lengths: list[int], seed: int, pad_id: int = 0):
    """Preference micro-batches: rows 2i / 2i+1 the chosen / rejected completion of one prompt (masked in the labels),
    of unequal lengths, right-padded; every row has at least two completion tokens."""
    return completion_batches(n_micro, pairs, 2, vocab, lengths, seed, pad_id, min_new=2)


def row_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(label) over each row's labelled tokens, their count) from a model's logits [B, T, V] and the
    unshifted labels [B, T] (-100: no token)."""
    y = labels[:, 1:]
    mask = y != -100
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
    return (lp * mask).sum(-1), mask.sum(-1)


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(label) of each labelled token, flat in row-major order (a MicroBatch's target order), from a model's
    logits [B, T, V] and the unshifted labels [B, T]."""
    y = labels[:, 1:]
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, y.clamp_min(0)[..., None]).squeeze(-1)
    return lp[y != -100]


def completion_batches(n_micro: int, groups: int, per_group: int, vocab: int, lengths: list[int], seed: int,
                       pad_id: int = 0, min_new: int = 1):
    """GRPO micro-batches: `groups` prompts per micro-batch, each with `per_group` completions (rows; the prompt
    masked in the labels, the completion labelled, right-padded), of unequal lengths; every completion has at least
    `min_new` tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for m in range(n_micro):
        T = lengths[m % len(lengths)]
        B = groups * per_group
        ids = torch.full((B, T), pad_id, dtype=torch.long)
        labels = torch.full((B, T), -100, dtype=torch.long)
        for i in range(groups):
            prompt = torch.randint(3, vocab, (int(torch.randint(1, T // 2, (1,), generator=g)),), generator=g)
            for r in range(i * per_group, (i + 1) * per_group):
                real = int(torch.randint(len(prompt) + min_new, T + 1, (1,), generator=g))
                ids[r, :len(prompt)] = prompt
                ids[r, len(prompt):real] = torch.randint(3, vocab, (real - len(prompt),), generator=g)
                labels[r, len(prompt):real] = ids[r, len(prompt):real]
        out.append({"input_ids": ids, "labels": labels, "attention_mask": (ids != pad_id).long()})
    return out


def step_and_grads(tmp_path, objective, mbs, totals=None):
    """One train_step of these micro-batches on a fresh Megatrain (the same seeded init every time): its StepOutput
    and every unit's gradient, the update not applied (lr 0). Whole steps against their shares split over ranks."""
    mt = Megatrain(tmp_path, objective=objective)
    out = mt.engine.train_step(mbs, totals)
    grads = {i: mt.pipeline.gradient(i).clone() for i in range(len(mt.store.tiles))}
    mt.pipeline.finish_step(lr=0.0, clip_coef=1.0)
    mt.close()
    return out, grads
