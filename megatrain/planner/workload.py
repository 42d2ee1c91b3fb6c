"""What a run asks of the engine: the planner's one input besides the model and the machine.

A `Workload` is the step's shape (micro-batches, tokens per row) and the engine's settings that change what it
allocates or how long it takes (streaming precision, weight slots, LM-head chunk, compile, and the `Placement`,
whose knobs runtime/knobs.py declares with their memory.* keys). Each field names the runtime argument
it stands for: `EngineOptions` in megatrain/runtime, the micro-batches the trainer builds (megatrain/run).
`workload_from_config` reads it from a validated `megatrain.config.Config` (the memory keys a config sets; the
planner chooses the rest: plan.py); bench/plan_vs_measured.py builds one from a benchmark's command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import MegatrainError
from ..runtime.knobs import knobs
from ..runtime.schedule import Placement, group_sizes
from .precision import resolve_precision

PLACEMENT_KEYS = tuple(k.name for k in knobs(Placement))  # each a memory.* config key


@dataclass(frozen=True)
class Workload:
    micro_batches: tuple[int, ...]  # sequences in each micro-batch of one optimizer step
    seq_len: int  # tokens per row (an upper bound when rows are padded only to the batch's longest)
    device: str = "cuda"
    precision: str = "bf16"  # streaming dtype; the engine computes in it too
    loss_chunk_tokens: int = 0
    num_slots: int = 2
    compile: bool = False
    packed: bool = False
    targets_per_row: int | None = None  # default seq_len - 1 (every position but the last predicts a token)
    placement: Placement = field(default_factory=Placement)  # EngineOptions.placement (runtime/schedule.py)
    head_kernels: bool = True  # CUDA: the fused cross-entropy kernel and the in-GEMM accumulation of the head
    #                            (False: the eager head of the first H200 runs, for bench/plan_vs_measured.py)
    clipping: bool = True  # train.max_grad_norm set: the updates wait for the step's global norm (False: they
    #                        start during backward; OptimizerPipeline.begin_step)
    disk_states: tuple[str, ...] = ()  # states on the SSD tier (memory.disk_states: 'v', 'm', 'master';
    #                                    HostStore's disk_states, runtime/disk_tier.py)
    tune_first: bool = False  # the kernels compiled and tuned on a copy of the model before the store exists
    #                           (engine.tune_first, run/tune_first.py): the autotuner's copies are not on the peak
    attn_len: float | None = None  # packed rows: the span attention's work counts each of a row's tokens at (data.
    #                                sampler.packed_span, over the rows' documents and padding pieces; None: seq_len, a
    #                                bound); attention's FLOPs and time scale with it, memory not
    rows_span: float | None = None  # unpacked rows timed at the data's micro-batches (estimate.retime_unpacked):
    #                                 sum(r·L²)/sum(r·L) over micro-batches of r rows padded to L (None: seq_len)

    @property
    def span_len(self) -> float:
        """The length attention's work per token is counted at: attn_len for packed rows when known, rows_span for
        unpacked rows timed at the data's lengths, else seq_len."""
        if self.packed:
            return min(self.attn_len, self.seq_len) if self.attn_len else self.seq_len
        return self.rows_span or self.seq_len

    @property
    def tokens_per_step(self) -> int:
        return sum(self.micro_batches) * self.seq_len

    @property
    def groups(self) -> list[range]:
        """The micro-batches of each wave group the engine runs (runtime/schedule.group_sizes)."""
        return group_sizes(len(self.micro_batches), self.placement.wave_groups)

    @property
    def elem(self) -> int:
        """Bytes per element of the compute dtype (slots, activations)."""
        return 2 if self.precision == "bf16" else 4

    @property
    def stream_elem(self) -> int:
        """Bytes per parameter streamed to the device (the host's streaming copy, or the fp32 master)."""
        return 4 if self.fp32_stream else self.elem

    @property
    def fp32_stream(self) -> bool:
        """bf16 compute streamed from the fp32 master (placement.stream_dtype): no bf16 copy on the host."""
        return self.precision == "bf16" and self.placement.stream_dtype == "fp32"

    def describe(self) -> str:
        sizes: dict[int, int] = {}
        for b in self.micro_batches:
            sizes[b] = sizes.get(b, 0) + 1
        mbs = " + ".join(f"{n}x{b}" for b, n in sizes.items())
        return (f"{len(self.micro_batches)} micro-batch{'es' if len(self.micro_batches) > 1 else ''} ({mbs} rows) "
                f"x {self.seq_len} tokens = {self.tokens_per_step:,} tokens per step")


def fixed_placement(cfg) -> dict:
    """The placement keys a validated Config sets (memory.*): the planner chooses the others."""
    return {k: v for k in PLACEMENT_KEYS if (v := getattr(cfg.memory, k)) is not None}


def compiles_layers(engine, device: str) -> bool:
    """engine.compile (a validated EngineConfig): on, or auto on CUDA."""
    return engine.compile == "on" or (engine.compile == "auto" and device == "cuda")


def tunes_first(engine, device: str, distributed: bool = False) -> bool:
    """engine.tune_first: on, or auto where the autotuner's page-locked copies occur (compiled layers on CUDA) in a
    run of one process (each rank of a torchrun would build a copy of its own)."""
    if engine.tune_first != "auto":
        return engine.tune_first == "on"
    return device == "cuda" and not distributed and compiles_layers(engine, device)


def workload_from_config(cfg, device: str, distributed: bool = False) -> Workload:
    """The workload of a validated megatrain.config.Config on `device` ('cuda' or 'cpu'), with the placement keys
    it sets and defaults for the rest (plan_for_config then chooses those). distributed: several ranks."""
    t, eng = cfg.train, cfg.engine
    precision = resolve_precision(t.precision, device)  # auto: bf16 where the device computes it natively
    if precision == "fp32" and cfg.memory.stream_dtype == "bf16":
        raise MegatrainError("memory.stream_dtype: bf16 streaming cannot feed train.precision=fp32 (fp32 runs stream "
                             "the fp32 master); leave memory.stream_dtype unset or set fp32")
    if precision != t.precision and precision == "fp32" and "master" in (cfg.memory.disk_states or ()):
        raise MegatrainError(f"memory.disk_states: 'master' on disk needs the bf16 streaming copy, and "
                             f"train.precision: auto is fp32 on {device} (planner/precision.py); set "
                             f"train.precision: bf16 or use [v, m]")
    return Workload(
        micro_batches=(t.micro_batch_size * (1 if t.objective in ("sft", "grpo") else 2),) * t.grad_accum_steps,
        # (pairs: 2 rows)
        seq_len=cfg.data.max_seq_len, device=device,
        precision=precision, loss_chunk_tokens=eng.loss_chunk_tokens, num_slots=eng.num_slots,
        compile=compiles_layers(eng, device), packed=cfg.data.packing,
        placement=Placement(**fixed_placement(cfg)), clipping=t.clipping,
        disk_states=tuple(k for k in ("v", "m", "master") if k in (cfg.memory.disk_states or ())),
        tune_first=tunes_first(eng, device, distributed))


def checkpoint_copies(cfg) -> int:
    """Checkpoints on disk at once at most, from a validated Config's checkpoint section (0: no saves)."""
    ck = cfg.checkpoint
    saves = (cfg.train.steps // ck.every if ck.every else 0) + (1 if ck.at_end else 0)
    return min(saves, ck.keep + 1) if ck.keep else saves
