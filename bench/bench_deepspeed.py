"""The DeepSpeed peer: ZeRO-3 with parameters and optimizer state offloaded to pinned CPU memory, on one GPU.

A transformers model built under `deepspeed.zero.Init` (through `HfDeepSpeedConfig`, as the HF Trainer does),
bf16 compute with fp32 master weights and Adam state on the host (DeepSpeedCPUAdam, compiled on first use),
gradient checkpointing, SDPA attention, gradient accumulation over micro-batches and global-norm clipping 1.0:
the same model, batch and optimizer settings as bench_megatrain.py and bench_reference.py.

    python bench/bench_deepspeed.py --model bench/model-configs/llama-3b-shape --seq 1024 --seqs 64 --micro 8

DeepSpeed is not a megatrain dependency: build its wheel from the PyPI source release (bench/README.md says how)
and install it where this runs. Before building the model the script compares what ZeRO-3 offload keeps in host
memory (fp32 master, Adam m and v, fp32 gradients, bf16 parameters: 18 B/param; DeepSpeed's own estimator adds a
1.5x buffer factor) with the host's memory; a watchdog ends the run cleanly, with a JSON record of how far it got
and what it held, if the host's available memory runs out, instead of letting the kernel kill it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import H200_BF16_PEAK, hf_config, peak_rss_bytes, rss_bytes, table, write_json  # noqa: E402
from megatrain.planner.flops import flops_per_token  # noqa: E402
from megatrain.models import get_adapter  # noqa: E402

GiB = 2**30
DS_HOST_BYTES_PER_PARAM = 18  # ZeRO-3, offload_param + offload_optimizer: 2 (bf16 param) + 4 (fp32 grad) + 12


def ds_config(args) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.seqs // args.micro,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": args.bucket,
            "stage3_prefetch_bucket_size": args.bucket,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "sub_group_size": 1e9,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
                                                   "weight_decay": 0.1}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class Watchdog:
    """Ends the process with a JSON record when the host's available memory falls below `floor` bytes."""

    def __init__(self, floor: float, on_trip):
        self.floor, self.on_trip, self.phase = floor, on_trip, "start"
        self.min_available = float("inf")
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        import psutil

        while True:
            avail = psutil.virtual_memory().available
            self.min_available = min(self.min_available, avail)
            if avail < self.floor:
                self.on_trip(self.phase, avail)
                os._exit(3)
            time.sleep(0.2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--label", default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--bucket", type=float, default=5e8, help="reduce and prefetch bucket size (elements)")
    p.add_argument("--host-floor-gib", type=float, default=3.0,
                   help="stop (and record) when the host's available memory falls below this")
    p.add_argument("--try-anyway", action="store_true",
                   help="build the model even when 18 B/param exceeds the host's memory")
    p.add_argument("--progress", type=int, default=0, help="print the step's time every N micro-batches")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    assert args.seqs % args.micro == 0, "--seqs must be a multiple of --micro (DeepSpeed's accumulation)"
    import psutil

    cuda = torch.cuda.is_available()  # CPU only for a smoke test of this script (DS_ACCELERATOR=cpu)
    for k, v in {"DS_ACCELERATOR": "cuda" if cuda else "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517",
                 "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(k, v)
    cfg = hf_config(args.model)
    adapter = get_adapter(cfg)
    n_params = sum(u.numel for u in adapter.units())
    largest = max(u.numel for u in adapter.units())
    fpt6, fpt_model = flops_per_token(adapter, args.seq)
    label = args.label or f"deepspeed-zero3-offload {Path(args.model).name}"
    vm = psutil.virtual_memory()
    wanted = DS_HOST_BYTES_PER_PARAM * n_params
    base = {"label": label, "params": n_params, "seq": args.seq, "seqs_per_step": args.seqs, "micro": args.micro,
            "tokens_per_step": args.seqs * args.seq, "host_total_gib": vm.total / GiB,
            "host_available_at_start_gib": vm.available / GiB,
            "host_wanted_gib": wanted / GiB,
            "host_wanted_note": f"{DS_HOST_BYTES_PER_PARAM} B/param: bf16 params 2, fp32 grads 4, fp32 master 4, "
                                f"Adam m 4, v 4 (all pinned)",
            "ds_estimate_gib": 1.5 * wanted / GiB,  # estimate_zero3_model_states_mem_needs: 18 B/param x 1.5
            "ds_config": ds_config(args)}
    command = " ".join(sys.argv)

    def record(status: str, **more):
        res = {**base, "status": status, "host_peak_rss_gib": peak_rss_bytes() / GiB, **more}
        if cuda:
            res["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GiB
        write_json(args.json, {"command": command, "result": res})
        return res

    if wanted > vm.available and not args.try_anyway:
        res = record("does not fit in host RAM (not built)")
        print(f"{label}: ZeRO-3 offload wants >= {wanted / GiB:.0f} GiB of host memory "
              f"({DS_HOST_BYTES_PER_PARAM} B/param); {vm.available / GiB:.0f} GiB available")
        print(table([res], ["label", "params", "status", "host_wanted_gib", "host_available_at_start_gib"]))
        return

    def tripped(phase, avail):
        res = record("does not fit in host RAM (stopped by the watchdog)", stopped_in=phase,
                     host_available_at_stop_gib=avail / GiB, host_rss_at_stop_gib=rss_bytes() / GiB)
        print(f"\n{label}: host memory ran out during {phase}: {res['host_rss_at_stop_gib']:.1f} GiB resident, "
              f"{avail / GiB:.1f} GiB available; it wants >= {wanted / GiB:.0f} GiB", flush=True)
        print(table([res], ["label", "params", "status", "stopped_in", "host_rss_at_stop_gib", "host_wanted_gib"]),
              flush=True)

    dog = Watchdog(args.host_floor_gib * GiB, tripped)
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = ds_config(args)
    hf_ds = HfDeepSpeedConfig(config)  # turns zero.Init on inside from_config; kept alive to the end
    dog.phase = "model construction under zero.Init"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    dog.phase = "deepspeed.initialize (optimizer state, pinned buffers, cpu_adam build)"
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    init_s = time.perf_counter() - t0
    inner = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    base.update(optimizer=f"{type(engine.optimizer).__name__} / {inner}", deepspeed_version=deepspeed.__version__)
    print(f"{label}: initialised in {init_s:.0f} s ({base['optimizer']}), host RSS {rss_bytes() / GiB:.1f} GiB",
          flush=True)
    g = torch.Generator().manual_seed(0)
    records = []
    accum = args.seqs // args.micro
    for step in range(args.warmup + args.steps):
        dog.phase = f"step {step}"
        sync()
        t = time.perf_counter()
        total = 0.0
        for i in range(accum):
            ids = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach()
            if args.progress and (i + 1) % args.progress == 0:  # a long step's rate, should the run be cut short
                sync()
                print(f"  step {step}: {i + 1}/{accum} micro-batches in {time.perf_counter() - t:.1f} s, host RSS "
                      f"{rss_bytes() / GiB:.1f} GiB", flush=True)
        sync()
        dt = time.perf_counter() - t
        tokens = args.seqs * args.seq
        records.append({"step": step, "loss": float(total) / accum, "step_s": dt, "tokens_per_s": tokens / dt,
                        "tflops_6n": fpt6 * tokens / dt / 1e12, "mfu": fpt_model * tokens / dt / H200_BF16_PEAK})
        print(f"step {step}: loss {records[-1]['loss']:.4f} {dt:.2f}s {records[-1]['tflops_6n']:.0f} TFLOP/s(6N) "
              f"host RSS {rss_bytes() / GiB:.1f} GiB", flush=True)
    m = records[args.warmup:]
    mean = lambda k: sum(r[k] for r in m) / len(m)
    res = record("ran", init_s=init_s, step_s=mean("step_s"), tokens_per_s=mean("tokens_per_s"),
                 tflops_6n=mean("tflops_6n"), mfu=mean("mfu"),
                 gpu_reserved_gib=torch.cuda.max_memory_reserved() / GiB if cuda else None,
                 host_bytes_per_param=peak_rss_bytes() / n_params, host_min_available_gib=dog.min_available / GiB,
                 largest_unit_params=largest, steps=records)
    del hf_ds
    print(table([res], ["label", "params", "tokens_per_step", "step_s", "tokens_per_s", "tflops_6n", "mfu",
                        "gpu_peak_gib", "host_peak_rss_gib", "host_bytes_per_param"]))


if __name__ == "__main__":
    main()
