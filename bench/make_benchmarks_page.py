"""Write docs/benchmarks.md from the reference runs under bench/results (their result.json files).

    python bench/make_benchmarks_page.py [--check]

Reads only the JSONs (no planner, no GPU), so the page is the same wherever it is made; tests/test_benchmarks_page.py
fails when the committed page differs from what this writes. --check prints the difference and exits 1 instead of
writing. The plots the page shows are written by bench/plot_long_context.py and bench/plot_gpu_memory.py (they plan
with the planner, and need matplotlib).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from refruns import REQUIRED, host_measured, load, names, runs  # noqa: E402

PAGE = HERE.parent / "docs" / "benchmarks.md"

# (title, paragraph, reference runs): the tables of runs, in order. A run not listed here goes under "Other runs".
TOPICS = [
    ("Throughput", "The runtime driven directly (`bench_megatrain.py`) and `megatrain train` itself (`bench_cli.py`, "
     "a `-cli` run) on the reference shapes. Qwen2.5-7B at 158 x 1024 is the run to repeat after a change, "
     "beside the code before it in the same device call (the GPU's speed varies from machine to machine by more "
     "than a change should move it).",
     ["qwen2.5-7b-158x1024-h200", "qwen2.5-7b-158x1024-h100-cli", "qwen2.5-7b-158x1024-tune-first-h100x2-cli",
      "llama-3.1-8b-64x4096-h200", "llama-3.1-8b-64x4096-h100-cli", "qwen2.5-32b-158x1024-h100-cli",
      "placement-no-slower-h200", "planner-fit-h200"]),
    ("Memory", "Runs that bound the GPU (memory.gpu_budget_gb, depth) or measure the host: the planner places layer "
     "inputs, checkpoints and gradients so that the step fits, at the cost shown in its step time. Host bytes per "
     "parameter are the process's peak RSS (several ranks: the node's summed PSS) over N. With the fp32 master "
     "streamed and `engine.tune_first` on, Inductor's autotuning copies stay off the host peak: 87.4 GiB where the "
     "run without it pinned a 4 GiB block on top.",
     ["depth-131k-h200", "depth-128-131k-budget16-h200", "llama-3.1-8b-16x4096-budget22-h100-cli",
      "qwen2.5-14b-158x1024-budget80-h200-cli", "real-width-524k-h200", "qwen2.5-7b-158x1024-fp32-h200-cli",
      "qwen2.5-7b-2l-autotune-host-h200-cli"]),
    ("Long context", "One sequence per step. The layer is tiled along the sequence (memory.seq_tile), some layers "
     "keep their attention for the backward (memory.reuse_attention), and past the GPU the attention's backward "
     "runs over blocks (memory.attn_block) on the kernel SDPA picks: with the flash op per block pair the H100's "
     "blocked backward took 1.66x SDPA's; with cuDNN's it runs at SDPA's speed.",
     ["qwen2.5-7b-long-context-h200-cli", "llama-3.1-8b-131k-h200-cli", "llama-3.1-8b-32k-noclip-h200-cli",
      "llama-3.1-8b-524k-h100-cli", "llama-3.1-8b-3l-1m-h200-cli"]),
    ("Mixtures of experts", "TFLOP/s count the active parameters (the experts a token is routed to). The models are "
     "cut to a few layers where the whole would not fit the host.",
     ["moe-h200-cli"]),
    ("Peers", "The same model, batch and optimizer through transformers on the GPU (no offload: as far as it fits) "
     "(`bench_reference.py`) and DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU "
     "(`bench_deepspeed.py`). A run stopped at its time limit shows the rate of the micro-batches it ran.",
     ["peers-llama-3b-h200", "peers-deepspeed-qwen2.5-7b-h200", "peers-deepspeed-qwen2.5-14b-h100",
      "peers-moe-h200"]),
    ("Several GPUs", "`megatrain train` under torchrun, the same 158 x 1024 per GPU on each: TFLOP/s per GPU.",
     ["qwen2.5-7b-158x1024-scaling-h100x4-cli"]),
    ("SSD tier", "Adam's moments on a local disk (memory.disk_path) with 128 GiB of host RAM. The planner's step for "
     "these runs is made with the disk rates the run measured at its start; a start-up measurement that caught the "
     "disk slower than the steps later found it gave a plan 36% long (the second run of the two-run folder: "
     "`bench/ssd_replan.py` re-plans each step with its own rates).",
     ["qwen2.5-14b-host128-ssd-h100-cli", "qwen2.5-14b-host128-ssd-two-runs-h100-cli"]),
]
PLOTS = [("Long context: planned and measured step time and GPU peak", "img/long_context.png",
          "bench/plot_long_context.py"),
         ("GPU peak against depth and tokens per step, planned and measured", "img/gpu_memory.png",
          "bench/plot_gpu_memory.py")]


def fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def short_kind(payload: dict) -> str:
    device = payload.get("device", "")
    gpu = "H100" if "H100" in device else "H200" if "H200" in device else device.split(",")[0]
    return f"{payload['kind']} ({gpu})" if gpu and gpu.lower() not in payload["kind"] else payload["kind"]


def model_of(r: dict) -> str:
    layers = f", {r['layers']} layers" if r.get("layers") and "-cli" in str(r.get("label", "")) else ""
    return f"{r.get('model') or '?'}{layers}"


def run_row(name: str, payload: dict, run: dict) -> str | None:
    r = run.get("result")
    if not isinstance(r, dict) or "seq" not in r or "label" not in r:  # a benchmark's run, not a kernel table
        return None
    label = r.get("label", "")
    rows = r.get("seqs_per_step")
    shape = f"{rows} x {r['seq']}" if rows else str(r["seq"])
    if r.get("step_s") is not None:
        step = f"{r['step_s']:.2f}"
    elif r.get("partial") and r.get("tokens_per_s"):  # stopped at its time limit: the rate of what it ran
        step = f"stopped in step {r.get('step', 0) + 1} after {r['micro_done']} of {r['micro_total']} micro-batches"
    else:
        why = r.get("status") or "no step measured"
        return (f"| `{name}` | {label} | {shape} | did not finish: {str(why)[:80]} |  |  |  |  |  |  "
                f"| {short_kind(payload)} |")
    gpus = r.get("nproc_per_node") or 1
    tflops = r.get("tflops_6n_active") or r.get("tflops_6n")
    host = host_measured(r) or r.get("host_peak_rss_gib")
    bpp = f" ({r['host_bytes_per_param']:.1f} B/param)" if r.get("host_bytes_per_param") else ""
    return (f"| `{name}` | {label} | {shape} | {step} | {fmt(r.get('tokens_per_s'), ',.0f')} | "
            f"{fmt(tflops / gpus if tflops else None, '.0f')} | {fmt(r.get('mfu'), '.1%')} | "
            f"{fmt(r.get('gpu_peak_gib'))} | {fmt(host)}{bpp} | {gpus} | {short_kind(payload)} |")


def run_table(folders: list[str]) -> list[str]:
    out = ["| reference run | run | rows x tokens | step s | tokens/s | TFLOP/s (6N) per GPU | MFU | GPU peak GiB "
           "| host peak GiB | GPUs | kind |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for name in folders:
        payload = load(name)
        for run in runs(name):
            row = run_row(name, payload, run)
            if row:
                out.append(row)
    return out


def plan_table() -> list[str]:
    """Each `megatrain train` run against the plan it made at its start (from config.json alone)."""
    out = ["| reference run | run | GPU peak GiB plan / measured | host GiB plan / measured | step s plan / measured "
           "| bound |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names():
        for run in runs(name):
            r = run.get("result")
            if not (isinstance(r, dict) and isinstance(r.get("plan"), dict) and r.get("step_s")):
                continue
            p = r["plan"]
            host = host_measured(r)
            out.append(f"| `{name}` | {r['label']} | {p['gpu_peak_gib']:.1f} / {r['gpu_peak_gib']:.1f} "
                       f"({p['gpu_peak_gib'] / r['gpu_peak_gib'] - 1:+.1%}) | {p['host_peak_gib']:.1f} / {host:.1f} "
                       f"({p['host_peak_gib'] / host - 1:+.1%}) | {p['step_time_s']:.2f} / {r['step_s']:.2f} "
                       f"({p['step_time_s'] / r['step_s'] - 1:+.1%}) | {p['bound']} |")
    return out


def index_table() -> list[str]:
    out = ["| reference run | measures | kind | device | revision | date |", "| --- | --- | --- | --- | --- | --- |"]
    for name in names():
        p = load(name)
        out.append(f"| `{name}` | {p['measures']} | {p['kind']} | {p['device']} | {p['revision']} "
                   f"| {p['date']} |")
    return out


def _moved(x: dict) -> str:
    """An export from a checkpoint reads the fp32 master (4 B/param) and writes bf16 (2 B/param): the bytes it moves
    (read and written) against min(read, write), and its time against reading then writing at the disk's rates."""
    f, m = x.get("fraction_of_read_then_write"), x.get("moved_fraction_of_disk")
    moved = f"; bytes read and written: {m:.0%} of min(read, write)" if m is not None else ""
    return moved + (f"; {f:.0%} of reading the master then writing at the disk's rates" if f is not None else "")


def io_table() -> list[str]:
    """bench/bench_io.py's runs: each operation's rate beside the disk's, measured in the same process."""
    out = []
    for name in names():
        for run in runs(name):
            r = run  # bench_io.py's JSON: its figures at the run's top level
            if not isinstance(r.get("results"), dict) or not isinstance(r.get("disk"), dict):
                continue
            d = r["disk"]
            for op, x in r["results"].items():
                out.append(f"| `{name}` | {r.get('params', 0) / 1e9:.2f}B, {r.get('threads') or 'default'} threads "
                           f"| {op} | {x['bytes'] / 1e9:.1f} | {x['seconds']:.1f} | {x['gb_per_s']:.2f} | "
                           f"{d['read_bps'] / 1e9:.2f} / {d['write_bps'] / 1e9:.2f} | {x['fraction_of_disk']:.0%} of "
                           f"{x['against']}{_moved(x)} |")
            if isinstance(p := r.get("periodic"), dict) and "save_bytes" in p:
                out.append(f"| `{name}` | {r.get('params', 0) / 1e9:.2f}B, {r.get('threads') or 'default'} threads "
                           f"| save while training (checkpoint.every={p['every']}) | {p['save_bytes'] / 1e9:.1f} | "
                           f"{p['save_seconds']:.1f} | {p['save_gb_per_s']:.2f} | {d['read_bps'] / 1e9:.2f} / "
                           f"{d['write_bps'] / 1e9:.2f} | {p['save_fraction_of_write']:.0%} of write; wall-time "
                           f"cost {p['cost_s']:.1f} s, bound {p['bound_s']:.1f} s |")
    head = ["| reference run | model, I/O threads | operation | GB | s | GB/s | disk read / write GB/s | share |",
            "| --- | --- | --- | ---: | ---: | ---: | --- | --- |"]
    return head + out if out else []


def page() -> str:
    listed = {n for _, _, folders in TOPICS for n in folders}
    lines = ["# Benchmarks", "",
             "<!-- Generated by bench/make_benchmarks_page.py from bench/results/*/result.json: do not edit. -->", "",
             "Each table row is one measured run of a reference run (a folder under `bench/results/`, named by what it "
             "measures, holding its `result.json` and `log.txt`). Weights are random-initialised from the "
             "`config.json` files in `bench/model-configs/`, tokens are random and every token is a target. "
             "How to run the benchmarks and add a reference run: `bench/README.md`.", "",
             "Counted: step s is the mean of the measured steps (the step's GPU work for the runtime bench, "
             "`step_time_s` of `metrics.jsonl` for `megatrain train`); TFLOP/s is 6·N·tokens/s with N all "
             "parameters, the active ones for a mixture of experts, per GPU; MFU = (6·(N − untied input embedding) "
             "+ causal attention 6·L·d·seq)·tokens/s over the GPU's dense bf16 datasheet peak "
             "(`megatrain/planner/flops.py`), as the run recorded it. megatrain executes 8 FLOP per layer parameter "
             "per token (forward, recompute, backward), so the hardware does more than either count shows. "
             "GPU peak is `torch.cuda.max_memory_allocated`; host peak the process's peak RSS.", ""]
    for title, text, folders in TOPICS:
        lines += [f"## {title}", "", text, ""] + run_table(folders) + [""]
    other = [n for n in names() if n not in listed and any(run_row(n, load(n), r) for r in runs(n))]
    if other:
        lines += ["## Other runs", ""] + run_table(other) + [""]
    io = io_table()
    if io:
        lines += ["## Disk I/O", "", "Load, save, resume and export (`bench/bench_io.py`), each beside the disk's "
                  "O_DIRECT rates measured in the same process the SSD tier's way (8 x 16 MiB requests in flight). "
                  "The export's GB are those written (a checkpoint's export also reads 4 B/param of masters).", ""]
        lines += io + [""]
    lines += ["## Plan against measured", "",
              "Every `megatrain train` run above records the plan it made at its start, from config.json alone; "
              "targets: memory within 10%, time within 15%. `python3 bench/plan_vs_measured.py` re-plans every run "
              "under `bench/results` with today's planner (the runtime-bench runs too), the runs of "
              "`planner-fit-h200` in-sample.", ""] + plan_table() + [""]
    plots = [(what, path, script) for what, path, script in PLOTS if (PAGE.parent / path).is_file()]
    if plots:  # those the plot scripts have written
        lines += ["## Plots", ""]
    for what, path, script in plots:
        lines += [f"{what} (`{script}`):", "", f"![{what}]({path})", ""]
    lines += ["## Reference runs", "",
              "Other reference data: the machine profiles `probe-h200/profile.json` and `probe-h100/profile.json` "
              "(`megatrain probe`; the planner's tests and the plan scripts load them), kernel measurements "
              "(`attention_kernels.py`, `blocked_attention.py`, `head_attn_variants.py`, `autotune_copies.py`) and "
              "the CUDA test suite's records (`MEGATRAIN_GPU_RESULTS`).", ""] + index_table() + [""]
    return "\n".join(lines)


def problems() -> list[str]:
    """Reference runs whose result.json lacks a required key."""
    return [f"{n}: no {k}" for n in names() for k in REQUIRED if not load(n).get(k)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is not what this writes")
    args = ap.parse_args()
    if bad := problems():
        print("\n".join(bad))
        return 1
    text = page()
    if args.check:
        old = PAGE.read_text() if PAGE.exists() else ""
        diff = list(difflib.unified_diff(old.splitlines(), text.splitlines(), "committed", "generated", lineterm=""))
        print("\n".join(diff[:80]) or "docs/benchmarks.md is up to date")
        return 1 if diff else 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
