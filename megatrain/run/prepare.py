"""Before the first step: check every input, then build the run (store, runtime, data). Writes nothing.

`check_inputs` reads everything the run will read and refuses what is wrong with one message naming the key,
file and line (config, model directory, tokenizer, data, eval and exact-match files, resume checkpoint, output
and export directories) and what will not fit (the plan); `prepare` then allocates and loads. Nothing is
written to output.dir before both have succeeded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import data as data_lib
from ..checkpoint import resume as resume_lib
from ..config import Config
from ..errors import MegatrainError
from ..models import get_adapter, load_hf_config
from ..runtime import CpuAdamW, EngineOptions, HostStore, Runtime, RuntimeOptions, build_runtime
from .oom import host_allocation


def resolve_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        raise MegatrainError("train.device: 'cuda' was asked for but torch sees no CUDA device")
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(choice)


@dataclass
class Inputs:
    """What `check_inputs` read and validated."""

    device: torch.device
    hf_config: object
    adapter: object
    plan: object  # megatrain.planner.Plan (None: it could not be computed)
    out_dir: Path
    resumed: resume_lib.Resumed | None
    tokenizer: object
    loader: object
    eval_batches: list | None
    exact_match: list | None


@dataclass
class Run:
    cfg: Config
    adapter: object
    runtime: Runtime
    loader: object
    eval_batches: list | None
    exact_match: list | None
    tokenizer: object
    out_dir: Path
    resumed: resume_lib.Resumed | None = None  # the checkpoint this run continues, loaded into the store
    plan: object = None  # megatrain.planner.Plan of this run (None: it could not be computed)

    @property
    def store(self) -> HostStore:
        return self.runtime.store

    @property
    def engine(self):
        return self.runtime.engine

    @property
    def pipeline(self):
        return self.runtime.pipeline


def check_inputs(cfg: Config) -> Inputs:
    """Every check that can fail on the user's input, before any large allocation. Writes nothing."""
    device = resolve_device(cfg.train.device)
    hf_config = load_hf_config(cfg.model.path)
    adapter = get_adapter(hf_config)
    if cfg.data.max_seq_len > getattr(hf_config, "max_position_embeddings", cfg.data.max_seq_len):
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's max_position_embeddings "
                             f"({hf_config.max_position_embeddings})")
    if adapter.sliding_window and cfg.data.max_seq_len > adapter.sliding_window:
        raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's sliding_window "
                             f"({adapter.sliding_window}), which megatrain does not implement; use at most that")
    from ..planner import check_before_run

    plan = check_before_run(cfg, adapter, device.type)  # refuses a run that cannot fit, before any weight is read
    data_lib.validate_inputs(cfg.data)
    out_dir = Path(cfg.output.dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not cfg.output.overwrite and not cfg.resume:
        raise MegatrainError(f"output.dir: {out_dir} is not empty; choose another, set output.overwrite=true, "
                             f"or resume=auto to continue its run")
    resumed = None
    if (resume_path := resume_lib.resolve(cfg.resume, out_dir)) is not None:
        resumed = resume_lib.open_checkpoint(resume_path)
        resume_lib.check_model_config(resumed, hf_config, cfg.model.path)
        resume_lib.check_no_newer(resumed, out_dir)
    if cfg.export.at_end:
        from ..checkpoint.export import check_export_target

        check_export_target(Path(cfg.export.dir or out_dir / "export"), replace_export=True)
    tokenizer = data_lib.load_tokenizer(cfg.model.tokenizer or cfg.model.path)
    if len(tokenizer) > adapter.vocab_size:
        raise MegatrainError(f"model.tokenizer: the tokenizer has {len(tokenizer)} tokens but config.json's "
                             f"vocab_size is {adapter.vocab_size}")
    loader = data_lib.build_train_loader(cfg.data, tokenizer, seed=cfg.train.seed,
                                         micro_batch_size=cfg.train.micro_batch_size,
                                         grad_accum_steps=cfg.train.grad_accum_steps)
    eval_batches = data_lib.build_eval_batches(cfg.data, tokenizer, micro_batch_size=cfg.train.micro_batch_size)
    exact = load_exact_match(cfg.train.exact_match_path) if cfg.train.exact_match_path else None
    return Inputs(device, hf_config, adapter, plan, out_dir, resumed, tokenizer, loader, eval_batches, exact)


def prepare(cfg: Config) -> Run:
    """Check every input, then allocate and fill the store and build the runtime. Writes nothing."""
    inp = check_inputs(cfg)
    adapter, plan = inp.adapter, inp.plan
    stream_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    with host_allocation("host store (fp32 master, Adam m and v, streaming copy)", plan, adapter):
        store = HostStore(adapter, stream_dtype)
    if inp.resumed is not None:  # instead of the model's weights, not after them: the weights are read once
        resume_lib.load_store(inp.resumed, store)
        inp.loader.load_state_dict(inp.resumed.state["loader"])
    elif cfg.model.init == "random":
        std = cfg.train.init_std or getattr(inp.hf_config, "initializer_range", 0.02)
        store.init_random(cfg.train.seed, std)
    else:
        store.load_safetensors(cfg.model.path)
    with host_allocation("pinned buffers (gradient landing buffers, offloaded gradients)", plan, adapter):
        runtime = build_runtime(store, inp.device, CpuAdamW(cfg.train.betas, cfg.train.eps, cfg.train.weight_decay),
                                runtime_options(cfg, inp.device))
    return Run(cfg, adapter, runtime, inp.loader, inp.eval_batches, inp.exact_match, inp.tokenizer, inp.out_dir,
               inp.resumed, plan)


def runtime_options(cfg: Config, device: torch.device) -> RuntimeOptions:
    e = cfg.engine
    compile_layers = e.compile == "on" or (e.compile == "auto" and device.type == "cuda")
    return RuntimeOptions(
        engine=EngineOptions(loss_chunk_tokens=e.loss_chunk_tokens, num_slots=e.num_slots,
                             compile_layers=compile_layers, spill_layers=e.spill_layers),
        offload_grad_units=e.offload_grad_units)


def load_exact_match(path: str) -> list[tuple[str, str]]:
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
