"""A step's batch bounded before it is planned or drawn, against what megatrain's structures and the machine hold.

A train.grad_accum_steps of 10^9 made the planner list a billion micro-batches, memory growing, with no output; a
micro_batch_size of 10^9 had it trace a head of billions of tokens. Each is bounded here first, in time independent
of its value, with one line naming the key and the bound (config.json's sizes: models/limits.py). The finer check
(what fits once placed) is the planner's: these bounds never refuse a run it could fit.
"""

from __future__ import annotations

from ..errors import MegatrainError

GiB = 2**30
MAX_MICRO_BATCHES = 16384  # micro-batches of one optimizer step (train.grad_accum_steps x ranks): each is walked


def device_bytes(device: str, profile=None) -> tuple[int, str]:
    """(bytes, what they are) of the memory a micro-batch's activations live in: this GPU's, the profile's GPU
    where this machine has none, or host RAM on a CPU device."""
    import torch

    if device == "cuda":
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name()
        if profile is not None:
            return int(profile.gpu_total_bytes), profile.gpu_name
        return 0, ""
    return host_bytes(), "host RAM"


def host_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def check_run_batch(cfg, hidden_size: int, device: str, ranks: int = 1, ranks_per_node: int = 1,
                    profile=None) -> None:
    """check_batch against this machine (device: "cuda" or "cpu"; profile: the plan's, for a GPU this machine
    lacks)."""
    memory, name = device_bytes(device, profile)
    check_batch(cfg, hidden_size, memory, name, host_bytes(), ranks, ranks_per_node)


def check_batch(cfg, hidden_size: int, device_memory: int, device_name: str, host_memory: int,
                ranks: int = 1, ranks_per_node: int = 1) -> None:
    """A step's batch before it is planned or drawn: train.grad_accum_steps x ranks micro-batches at most
    MAX_MICRO_BATCHES; one micro-batch's hidden states (micro_batch_size x max_seq_len tokens x hidden_size, in the
    compute dtype: a lower bound of its activations) within the device's memory; a step's token ids and labels
    (8 bytes each, all of the step's micro-batches are drawn at once) within host RAM, for the node's ranks.
    device_memory 0: unknown, not checked."""
    t, seq = cfg.train, cfg.data.max_seq_len
    steps = t.grad_accum_steps * ranks
    if steps > MAX_MICRO_BATCHES:
        raise MegatrainError(f"train.grad_accum_steps: {t.grad_accum_steps:,}{f' x {ranks} ranks' if ranks > 1 else ''}"
                             f" micro-batches per step is more than megatrain plans and draws (at most "
                             f"{MAX_MICRO_BATCHES:,}); raise train.micro_batch_size instead")
    tokens = t.micro_batch_size * seq * (1 if t.objective in ("sft", "grpo") else 2)  # a pair is two rows
    elem = 4 if t.precision == "fp32" else 2  # (auto: the smaller)
    need = tokens * hidden_size * elem
    if device_memory and need > device_memory:
        raise MegatrainError(f"train.micro_batch_size: {t.micro_batch_size:,} rows of data.max_seq_len {seq:,} tokens "
                             f"make a micro-batch whose hidden states alone ({tokens:,} x hidden_size {hidden_size:,} "
                             f"x {elem} bytes = {need / GiB:,.1f} GiB) exceed {device_name}'s {device_memory / GiB:.1f}"
                             f" GiB; lower train.micro_batch_size or data.max_seq_len")
    ids = tokens * t.grad_accum_steps * ranks_per_node * 16
    if host_memory and ids > host_memory:
        raise MegatrainError(f"train.grad_accum_steps: a step of {t.grad_accum_steps * ranks_per_node:,} micro-batches of {tokens:,} tokens holds "
                             f"{ids / GiB:,.1f} GiB of token ids and labels alone, more than this machine's "
                             f"{host_memory / GiB:.1f} GiB of RAM; lower train.grad_accum_steps or "
                             f"train.micro_batch_size")
