"""The run: validate every input, then wire store, engine, optimizer, data and metrics; the step loop.

Nothing is written to output.dir until the model directory, the data and the tokenizer have been checked.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import data as data_lib
from .config import Config
from .engine import Engine, MicroBatch
from .errors import MegatrainError
from .flops import flops_per_token
from .metrics import MetricsLogger
from .models import get_adapter, load_hf_config
from .offload import OptimizerPipeline
from .optim import CpuAdamW, clip_coefficient, lr_at
from .store import HostStore


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise MegatrainError("train.device: 'cuda' was asked for but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


@dataclass
class Run:
    cfg: Config
    adapter: object
    store: HostStore
    engine: Engine
    pipeline: OptimizerPipeline
    loader: object
    eval_batches: list | None
    exact_match: list | None
    tokenizer: object
    out_dir: Path


def to_microbatches(batches) -> list[MicroBatch]:
    return [MicroBatch.from_labels(b["input_ids"], b["labels"], b.get("position_ids")) for b in batches]


def real_tokens(batches) -> int:
    return sum(int(b["num_real_tokens"]) if "num_real_tokens" in b else b["input_ids"].numel() for b in batches)


def prepare(cfg: Config) -> Run:
    """Every check that can fail on the user's input, then the allocations. Writes nothing."""
    device = resolve_device(cfg.train.device)
    hf_config = load_hf_config(cfg.model.path)
    adapter = get_adapter(hf_config)
    if cfg.data.max_seq_len > getattr(hf_config, "max_position_embeddings", cfg.data.max_seq_len):
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's max_position_embeddings "
                             f"({hf_config.max_position_embeddings})")
    if adapter.sliding_window and cfg.data.max_seq_len > adapter.sliding_window:
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's sliding_window "
                             f"({adapter.sliding_window}), which megatrain does not implement; use at most that")
    data_lib.validate_inputs(cfg.data)
    out_dir = Path(cfg.output.dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not cfg.output.overwrite:
        raise MegatrainError(f"output.dir: {out_dir} is not empty; choose another or set output.overwrite=true")
    tokenizer = _load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    if len(tokenizer) > adapter.vocab_size:
        raise MegatrainError(f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"vocab_size is {adapter.vocab_size}")
    loader = data_lib.build_train_loader(cfg.data, tokenizer, seed=cfg.train.seed,
                                         micro_batch_size=cfg.train.micro_batch_size,
                                         grad_accum_steps=cfg.train.grad_accum_steps)
    eval_batches = data_lib.build_eval_batches(cfg.data, tokenizer, micro_batch_size=cfg.train.micro_batch_size)
    exact = _load_exact_match(cfg.train.exact_match_path) if cfg.train.exact_match_path else None

    stream_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    store = HostStore(adapter, stream_dtype)
    if cfg.model.init == "random":
        std = cfg.train.init_std or getattr(hf_config, "initializer_range", 0.02)
        store.init_random(cfg.train.seed, std)
    else:
        store.load_safetensors(cfg.model.path)
    if device.type == "cuda":
        store.pin()
    compile_layers = cfg.engine.compile == "on" or (cfg.engine.compile == "auto" and device.type == "cuda")
    engine = Engine(store, adapter, device, cfg.engine.loss_chunk_tokens, cfg.engine.num_slots, compile_layers)
    optimizer = CpuAdamW(betas=cfg.train.betas, eps=cfg.train.eps, weight_decay=cfg.train.weight_decay)
    pipeline = OptimizerPipeline(store, optimizer, device)
    engine.wait_for_update = pipeline.wait_for_update
    return Run(cfg, adapter, store, engine, pipeline, loader, eval_batches, exact, tokenizer, out_dir)


def _load_tokenizer(path: str):
    loader = getattr(data_lib, "load_tokenizer", None)  # the data pipeline's, once it has one
    if loader is not None:
        return loader(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise MegatrainError(f"model.tokenizer: no usable tokenizer in {path} ({e})") from None


def _load_exact_match(path: str) -> list[tuple[str, str]]:
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["instruction"] + (f"\n{row['input']}" if row.get("input") else "")
            pairs.append((prompt, row["output"]))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise MegatrainError(f"train.exact_match_path: {path}:{n}: expected an alpaca row ({e})") from None
    return pairs


def train_step(run: Run, step: int, batches) -> tuple[float, float, float]:
    """One optimizer step: the engine's waves, then the CPU update handed to the pipeline, which overlaps it
    with the next step's forward. Returns (loss, grad norm, lr)."""
    t = run.cfg.train
    out = run.engine.train_step(to_microbatches(batches), run.pipeline)
    grad_norm = math.sqrt(out.grad_sq_norm.item())  # the step's GPU work is all queued: this wait costs nothing
    loss = out.loss_sum.item()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise MegatrainError(f"step {step + 1}: loss {loss}, grad norm {grad_norm}; the update was not applied. "
                             f"Lower train.lr or check the data.")
    lr = lr_at(step, lr=t.lr, warmup_steps=t.warmup_steps, total_steps=t.steps, schedule=t.lr_schedule,
               min_lr_ratio=t.min_lr_ratio)
    run.pipeline.finish_step(lr=lr, clip_coef=clip_coefficient(grad_norm, t.max_grad_norm))
    run.engine.weights_version += 1
    return loss, grad_norm, lr


def evaluate(run: Run, step: int, log: MetricsLogger) -> dict:
    record = {"step": step}
    if run.eval_batches:
        total, count = 0.0, 0
        for b in run.eval_batches:
            loss, n = run.engine.eval_loss(to_microbatches([b]))
            total, count = total + loss * n, count + n
        record["eval_loss"] = total / max(count, 1)
    if run.exact_match:
        from .evaluate import exact_match

        record["eval_exact_match"] = exact_match(run.engine, run.tokenizer, run.exact_match)
    if len(record) > 1:
        log.log(record)
    return record


def train(cfg: Config) -> dict:
    run = prepare(cfg)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2))
    t = cfg.train
    log = MetricsLogger(run.out_dir, t.steps, tensorboard=cfg.output.tensorboard)
    n_params = run.store.num_params
    fpt6, fpt_attn = flops_per_token(run.adapter, cfg.data.max_seq_len)
    log.info(f"megatrain: {run.adapter.model_type} {n_params / 1e6:.2f}M params, {run.adapter.num_layers} layers, "
             f"{cfg.train.precision} on {run.engine.device}; host store {run.store.host_bytes() / 2**30:.2f} GiB; "
             f"data: {run.loader.summary()}")
    first = evaluate(run, 0, log)
    summary = {"first_eval": first}
    losses = []
    try:
        for step in range(t.steps):
            t0 = time.perf_counter()
            batches = run.loader.next_step()
            loss, grad_norm, lr = train_step(run, step, batches)
            dt = time.perf_counter() - t0
            tokens = real_tokens(batches)
            losses.append(loss)
            log.log({"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": tokens,
                     "tokens_per_s": tokens / dt, "step_time_s": dt,
                     "tflops_6n": fpt6 * tokens / dt / 1e12, "tflops_attn": fpt_attn * tokens / dt / 1e12})
            if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                evaluate(run, step + 1, log)
        summary["last_eval"] = evaluate(run, t.steps, log)
        run.pipeline.drain()
    finally:
        run.pipeline.close()
        log.close()
        run.store.unpin()
    summary["first_loss"], summary["last_loss"] = losses[0], losses[-1]
    log.info(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}; metrics in {run.out_dir / 'metrics.jsonl'}")
    return summary
