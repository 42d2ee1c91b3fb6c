"""`megatrain train`, the real command line in a subprocess, on the same model and batch as bench_megatrain.py, so
the two can be compared in one device call: step time, wall time per step, tokens/s, TFLOP/s, stream busy shares,
GPU peak and the child's host peak RSS, read from the run's metrics.jsonl.

    python bench/bench_cli.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --compile

In --workdir (default: a temporary folder, removed afterwards) it writes
  model/      the model's config.json (init: random, seeded by train.seed);
  tokenizer/  a word-level tokenizer of at most 4,096 words plus 4 special tokens (never more than the model's
              vocab_size), saved with transformers' PreTrainedTokenizerFast.save_pretrained, and given as
              model.tokenizer: beside a config.json, AutoTokenizer would load it as the model family's tokenizer
              class (Qwen2Tokenizer for qwen2), which does not tokenise these words;
  data.jsonl  synthetic text rows of --seq + 16 words, one token each, so every row is truncated to exactly
              data.max_seq_len tokens (no padding, no packing: every row is full, as bench_megatrain.py's random
              full-length rows; every token but the last predicts one, as there); with --docs LOW:HIGH instead
              documents of LOW..HIGH tokens packed into the rows (data.packing: true; the result's
              packing_efficiency is the share of the rows' positions they fill); with --lengths LOW:HIGH rows of
              LOW..HIGH tokens, unpacked, each micro-batch padded to its longest (varied_rows.py);
  run.yaml    train.steps = --warmup + --steps, micro_batch_size --micro, grad_accum_steps --seqs / --micro,
              precision bf16, lr 1e-5 constant, weight decay 0.1, clipping 1.0 (bench_megatrain.py's optimizer),
              engine.compile on with --compile (off without, as bench_megatrain.py), no evaluation,
              checkpoint.at_end and export.at_end false; --set KEY=VALUE adds overrides (--disk-path DIR and
              --host-budget-gb G are memory.disk_path and memory.host_budget_gb: the SSD tier's runs, whose step
              records add the disk's GB read and written and GB/s);
  run/        output.dir (metrics.jsonl), and cli.log, the command's output;
then runs `python3 -m megatrain.cli train run.yaml` and reads metrics.jsonl. Per step: `step_time_s` (the trainer's
step: engine.train_step to the optimizer's hand-off) and the wall time per step, the difference of consecutive
`elapsed_s` (wall time since the metrics logger opened: data, logging and the saver's turn included). Reports their
means over the steps after --warmup (`step_s`, `wall_step_s`), and the stall check: every measured step's time,
their median, the slowest step over it with its GPU idle time and idle stretches (the records' `idle_gaps`); prints
those, a table last, and writes JSON (--json).
`--device cpu` sets train.device=cpu (a check of the script, with a tiny config.json).

`--pretrained` loads weights as a user's first run does: model/ gets random bf16 safetensors shards of the config's
tensors (pretrained_files.py) and model.init: pretrained; the disk under --workdir is measured first (O_DIRECT, 8 GiB,
runtime/disk_probe.py) and the files' pages are evicted (`--cached`: read once instead, so the run finds them in the
page cache). `pretrained` reports the files' bytes, the disk's rates, and the start-up phase that read them: its
seconds, GB/s and share of the disk's read rate; `time_to_step_1_s` (every run) is the process's start to step 1's
(phases that ran at once counted once), `step_1_done_s` adds step 1's wall time.

`--objective dpo` (ipo, simpo, orpo) trains that preference objective on synthetic pairs instead: --seqs and --micro
still count rows (sequences), a pair being two (its chosen and rejected side), so `--seqs 128 --micro 64` is 64
pairs per step in micro-batches of 32 pairs, the same tokens as SFT's `--seqs 128 --micro 64`. data.jsonl then holds
{"prompt", "chosen", "rejected"} rows of 16 prompt words and two different completions of --seq - 17 words (with
the end-of-sequence token each side is --seq tokens); `--reference` sets preference.reference. A precomputed
reference's pass, before step 1, is timed by the run (its record `reference_pass_s`): `tokens_per_s_with_reference`
spreads it over the run's steps (the pass scores each pair of the run once), against `tokens_per_s`.

`--nproc-per-node N` runs it as N ranks of one node (`torchrun --standalone --nproc-per-node N -m megatrain train`):
--seqs and --micro stay per rank (the step is N times larger), and the node's host memory is sampled every 0.5 s
while it runs: the processes' anonymous and file-backed resident memory plus the shared store once, and the
machine's used memory above what it was before the launch (`host_node_rss_gib`, `host_node_used_gib`, peaks;
NodeMemory says why these are kernel counters, not PSS).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from common import spread_lines, step_spread, table, write_json  # noqa: E402
from host_trace import HostTrace, trace_lines  # noqa: E402
import varied_rows  # noqa: E402
import pretrained_files  # noqa: E402

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
# the precomputed reference pass's record (run/reference.py), copied into the result
REFERENCE_FIELDS = ["reference_pass_s", "reference_waves", "reference_first_wave_s", "reference_wave_s"]
MAX_WORDS = 4096
# per-step fields kept from metrics.jsonl (those a megatrain version does not write are None)
STEP_FIELDS = ["step_time_s", "wall_s", "data_wait_s", "queue_s", "gpu_wait_s", "tokens_per_s", "wall_tokens_per_s",
               "tflops_6n", "tflops_attn", "mfu", "busy_compute", "busy_h2d", "busy_d2h", "gpu_peak_gib",
               "gpu_reserved_gib", "host_rss_gib", "tflops_6n_active", "router_loss", "expert_load_min",
               "expert_load_max", "expert_entropy", "disk_read_gb", "disk_write_gb", "disk_read_gbps",
               "disk_write_gbps", "disk_gbps_step", "disk_busy_s", "disk_gbps", "disk_busy", "host_pinned_cache_gib",
               "optimizer_update_s", "optimizer_copy_wait_s", "optimizer_gparams_per_s", "optimizer_longest_s",
               "optimizer_longest_usual_s", "idle_gaps", "compiled_graphs", "compile_limit_hits", "gc_s",
               "attn_len"]  # (packed rows: the step's documents' attention span, which sets its work)


def model_config(args) -> dict:
    """config.json of --model, with --layers applied (and layer_types kept consistent)."""
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
        if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
            types = cfg["layer_types"]  # the first --layers of the real pattern (gemma's sliding/full alternation)
            cfg["layer_types"] = (types * (args.layers // len(types) + 1))[:args.layers]
    if args.extend_context and cfg.get("max_position_embeddings", args.seq) < args.seq:
        cfg.update(extended_context(cfg, args.seq))
    return cfg


def extended_context(cfg: dict, seq: int) -> dict:
    """The config.json keys that extend a model's context to `seq` tokens the way model publishers document it
    (Qwen2.5's long-context note: YaRN over the original window): RoPE without scaling gets YaRN with factor
    seq / max_position_embeddings over the original max_position_embeddings; YaRN's factor grows by the same ratio;
    llama3 and linear scaling are kept as they are (their tables do not depend on max_position_embeddings); and
    max_position_embeddings becomes `seq`."""
    old = int(cfg["max_position_embeddings"])
    rope = dict(cfg.get("rope_parameters") or {})
    kind = rope.get("rope_type", "default")
    if kind == "default":
        rope.update(rope_type="yarn", factor=seq / old, original_max_position_embeddings=old)
    elif kind == "yarn":
        rope["factor"] = float(rope.get("factor", 1.0)) * seq / old
        rope.setdefault("original_max_position_embeddings", old)
    return {"rope_parameters": rope, "max_position_embeddings": seq}


def write_model_dir(path: Path, cfg: dict) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))


def write_tokenizer(path: Path, cfg: dict) -> int:
    """A word-level tokenizer (words w0, w1, ... and 4 special tokens); returns the number of words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    n_words = min(MAX_WORDS, cfg["vocab_size"] - len(SPECIALS))
    if n_words < 1:
        raise SystemExit(f"vocab_size {cfg['vocab_size']} is too small for a tokenizer")
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{k}" for k in range(n_words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    # as the run loads it (megatrain.data.load_tokenizer): one token per word, or rows would not be full
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(path), local_files_only=True)("w0 w1 w2")["input_ids"]
    if ids != [vocab["w0"], vocab["w1"], vocab["w2"]]:
        raise SystemExit(f"the tokenizer in {path} does not load as written: 'w0 w1 w2' -> {ids}")
    return n_words


def write_data(path: Path, rows: int, words_per_row: int, n_words: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(n_words)}" for _ in range(words_per_row))}) + "\n")


def write_documents(path: Path, tokens: int, low: int, high: int, n_words: int, seed: int = 0) -> int:
    """Documents of low..high words (uniform, seeded; each one token a word, plus the EOS the run appends) until
    `tokens` tokens are written, for packing into rows (--docs); returns how many."""
    rng = random.Random(seed)
    n = total = 0
    with path.open("w") as f:
        while total < tokens:
            k = rng.randint(low, high)
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(n_words)}" for _ in range(k))}) + "\n")
            n, total = n + 1, total + k + 1
    return n


def write_pairs(path: Path, pairs: int, seq: int, n_words: int, seed: int = 0) -> None:
    """Preference rows: a 16-word prompt and two different completions of seq - 17 words."""
    rng = random.Random(seed)
    words = lambda k: " ".join(f"w{rng.randrange(n_words)}" for _ in range(k))  # noqa: E731
    with path.open("w") as f:
        for _ in range(pairs):
            f.write(json.dumps({"prompt": words(16), "chosen": words(seq - 17), "rejected": words(seq - 17)}) + "\n")


def write_config(path: Path, args, model_dir: Path, tokenizer: Path, data: Path, out_dir: Path) -> dict:
    import yaml

    cfg = {
        "model": {"path": str(model_dir), "init": "pretrained" if args.pretrained else "random",
                  "tokenizer": str(tokenizer)},
        "data": {"path": str(data), "format": "text", "max_seq_len": args.seq, "packing": bool(args.docs),
                 "overlong": "truncate", "cache_dir": str(path.parent / "data-cache")},
        "train": {"steps": args.warmup + args.steps, "micro_batch_size": args.micro,
                  "grad_accum_steps": args.seqs // args.micro, "lr": 1e-5, "lr_schedule": "constant",
                  "warmup_steps": 0, "weight_decay": 0.1, "max_grad_norm": 1.0, "seed": 0,
                  "precision": args.precision, "device": args.device, "eval_every": 0},
        "engine": {"compile": "on" if args.compile else "off"},
        "checkpoint": {"every": 0, "at_end": False},
        "export": {"at_end": False},
        "output": {"dir": str(out_dir), "overwrite": True},
    }
    if args.objective != "sft":  # micro_batch_size counts pairs: two rows each
        cfg["data"].update(format="preference")
        cfg["train"].update(objective=args.objective, micro_batch_size=args.micro // 2)
        if args.objective in ("dpo", "ipo"):
            cfg["preference"] = {"reference": args.reference}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


class NodeMemory:
    """Peaks of a process tree's resident memory and of the machine's used memory above a baseline, sampled every
    0.5 s on a thread from kernel counters (/proc/PID/status, /proc/meminfo; no psutil on the device images).

    Only counters: reading /proc/PID/smaps or smaps_rollup walks the process's page tables under its memory-map lock,
    and a page fault in the run waits until the walk is done. Read twice a second they stalled the optimizer's first
    pass six times for 0.4-0.6 s, a step 1.18x the median, the CPU AdamW at 1.5 Gparam/s instead of 2.2
    (bench/results/stall-smaps-sampler-qwen2.5-7b-158x1024-h200-cli). So there is no PSS here:
    `host_node_rss_gib` is the tree's anonymous resident bytes, the file-backed ones of its process that has the most
    (the processes map the same libraries: counted per process, torch.compile's workers added several GiB the machine
    did not use; anonymous pages a forked worker shares with its parent are still counted in each), plus the machine's shared memory above the baseline (/proc/meminfo's Shmem: the
    ranks' shared store, a memfd, counted once, as PSS counts it). `host_rss_parts_gib`: the launched
    process's RssAnon, RssFile and RssShmem at its RSS peak; `host_children_rss_gib`: the peak summed RSS of its
    descendants (torch.compile's workers)."""

    def __init__(self):
        info = self._meminfo()
        self.base = float(info["MemTotal"] - info["MemAvailable"])
        self.base_shmem = float(info.get("Shmem", 0))
        self.node = self.used = 0.0
        self.rss, self.parts, self.children = 0.0, {}, 0.0
        self._stop = None

    @staticmethod
    def _meminfo() -> dict[str, int]:
        info = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            info[k] = int(v.split()[0]) * 1024
        return info

    @staticmethod
    def _tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            for task in Path(f"/proc/{p}/task").glob("*"):
                try:
                    todo += [int(c) for c in (task / "children").read_text().split()]
                except OSError:
                    pass
        return out

    @staticmethod
    def _status(pid: int) -> dict[str, float]:
        """/proc/PID/status's resident counters in bytes (empty once the process is gone)."""
        out = {}
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024.0
        except (OSError, ValueError, IndexError):
            pass
        return out

    def sample(self, pid: int) -> None:
        tree = [(p, self._status(p)) for p in self._tree(pid)]
        info = self._meminfo()
        shmem = max(0.0, info.get("Shmem", 0) - self.base_shmem)
        self.node = max(self.node, sum(st.get("RssAnon", 0.0) for _, st in tree)
                        + max(st.get("RssFile", 0.0) for _, st in tree) + shmem)
        own = tree[0][1]
        if own.get("VmRSS", 0.0) > self.rss:
            self.rss = own["VmRSS"]
            self.parts = {k: own.get(f, 0.0) / 2**30 for k, f in (("rss", "VmRSS"), ("anon", "RssAnon"),
                                                                 ("file", "RssFile"), ("shmem", "RssShmem"))}
        self.children = max(self.children, sum(st.get("VmRSS", 0.0) for _, st in tree[1:]))
        self.used = max(self.used, info["MemTotal"] - info["MemAvailable"] - self.base)

    def start(self, pid: int) -> None:
        import threading

        self._stop = threading.Event()

        def sample():
            while not self._stop.wait(0.5):
                self.sample(pid)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> dict:
        if self._stop is not None:
            self._stop.set()
            self._thread.join(timeout=5)
        return {"host_node_rss_gib": self.node / 2**30, "host_node_used_gib": self.used / 2**30,
                "host_rss_parts_gib": self.parts, "host_children_rss_gib": self.children / 2**30}


def node_host_per_param(res: dict, nproc: int) -> dict:
    """A distributed run's host bytes per parameter are the node's (the shared store counted once), not one rank's
    RSS, which holds only the part of the store that rank touched (9.8 B/param by rank 0's RSS at 4 ranks, 16.7 by
    the node's)."""
    if nproc <= 1 or not res.get("host_node_rss_gib") or not res.get("params"):
        return {}
    return {"host_bytes_per_param": res["host_node_rss_gib"] * 2**30 / res["params"],
            "host_bytes_per_param_of": "node resident (the shared store once)"}


def run_cli(config: Path, overrides: list[str], log: Path, nproc: int = 1,
            memory: NodeMemory | None = None, started=None) -> tuple[int, float, list[str]]:
    """`python3 -m megatrain.cli train CONFIG [overrides]` from the repository root (under torchrun with nproc > 1),
    its output shown and logged; `started(pid)` is called once it runs. Returns (exit status, wall seconds, the
    command)."""
    cmd = [sys.executable, "-m", "megatrain.cli", "train", str(config), *overrides]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
               "megatrain", "train", str(config), *overrides]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("PYTHONUNBUFFERED", "1")
    print("running:", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                bufsize=1)
        previous = {sig: signal.signal(sig, stop_tree(proc.pid)) for sig in (signal.SIGTERM, signal.SIGINT)}
        rc = None
        try:
            if memory is not None:
                memory.start(proc.pid)
            if started is not None:
                started(proc.pid)
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                f.write(line)
            rc = proc.wait()
        except StoppedFromOutside:  # the run is killed: what it measured until then is still summarised
            proc.wait()
            rc = STOPPED
        finally:
            if rc != STOPPED:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    return rc, time.perf_counter() - t0, cmd


STOPPED = 124  # the exit status of a benchmark stopped from outside (timeout's)


class StoppedFromOutside(Exception):
    """Raised in the benchmark's main thread by `stop_tree`'s handler, once the run is killed."""


def stop_tree(pid: int):
    """A signal handler for the benchmark stopped from outside (a call script's `timeout`): SIGKILL to the run it
    launched and every process under it, then StoppedFromOutside, so that the steps measured until then are
    summarised and written (the result then says it was stopped) and the benchmark exits with STOPPED. A run stopped
    with SIGTERM would save a checkpoint first, as `megatrain train` does for users, holding its GPU meanwhile
    (torchrun's ranks run in sessions of their own, out of reach of a process-group signal), and a run started
    after it would find the GPU taken."""
    def handler(signum, frame):
        for p in reversed(NodeMemory._tree(pid)):  # the tree as it is now, leaves first
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        print(f"bench_cli: stopped by signal {signum}: the run (pid {pid}) and its processes were killed; "
              f"summarising the steps it logged", file=sys.stderr, flush=True)
        # `timeout` signals the process and then its group, so a second SIGTERM follows: ignored while the steps are
        # summarised (a second Ctrl-C still ends the benchmark at once)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        raise StoppedFromOutside(signum)
    return handler


def step_records(metrics: Path) -> list[dict]:
    """The step records of metrics.jsonl (evaluation records have no loss), with `wall_s` per step."""
    steps = []
    for line in metrics.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if "loss" in r:
                steps.append(r)
            elif "reference_pass_s" in r and steps == []:  # the precomputed reference's pass, before step 1
                steps.append(r)
    reference = [steps.pop(0)] if steps and "loss" not in steps[0] else []
    prev = 0.0  # step 1's wall time runs from the logger's start
    for r in steps:
        r["wall_s"] = r["elapsed_s"] - prev
        prev = r["elapsed_s"]
        r["wall_tokens_per_s"] = r["tokens"] / r["wall_s"] if r["wall_s"] > 0 else None
    for r in reference:  # step 1's wall time runs from the logger's start, before the pass: the pass is not a step's
        steps[0]["wall_s"] -= r["reference_pass_s"] if steps else 0.0
        for s in steps:  # (with the pass's waves on the GPU: the first, and the median of the others)
            s.update({k: r.get(k) for k in REFERENCE_FIELDS})
    return steps


def pretrained(model_dir: Path, cached: bool) -> dict:
    """Writes the model's random bf16 safetensors, measures the disk they are on (O_DIRECT, the SSD tier's way), and
    evicts their pages (cold) or reads them once (cached): the run's load is then the disk's, or the page cache's."""
    from megatrain.runtime.disk_probe import describe, measure_disk

    t0 = time.perf_counter()
    nbytes = pretrained_files.write_weights(model_dir)
    written_s = time.perf_counter() - t0
    disk = measure_disk(model_dir.parent, 8 << 30)
    print(describe(disk))
    pretrained_files.evict(model_dir)
    if cached:
        for f in sorted(model_dir.glob("*.safetensors")):
            with f.open("rb") as fh:
                while fh.read(64 << 20):
                    pass
    return {"bytes": nbytes, "files_written_s": written_s, "page_cache": "cached" if cached else "evicted",
            "disk_read_bps": disk["read_bps"], "disk_write_bps": disk["write_bps"]}


def load_phase(startup: dict, weights: dict) -> dict:
    """The start-up phase that read the weights ("store filled (weights read X GB at Y GB/s)"): its seconds, its
    rate over the files' bytes and that rate over the disk's read rate."""
    for name, seconds in startup.items():
        if name.startswith("store filled (weights read"):
            rate = weights["bytes"] / max(seconds, 1e-9)
            return {"load_phase": name, "load_s": seconds, "load_bps": rate,
                    "load_fraction_of_read": rate / weights["disk_read_bps"]}
    return {}


def time_to_first_step(startup: dict) -> float:
    """Seconds from the process's start to step 1's: the start-up phases in order, those that ran at once counted by
    the wall time the record gives them ("wall time of the N phases above, which ran at once")."""
    spans = []
    for name, seconds in startup.items():
        if name.startswith("wall time of the "):
            n = int(name.split()[4])
            spans = spans[:-n]
        spans.append(seconds)
    return sum(spans)


def num_params(model_dir: Path) -> int:
    from megatrain.models import get_adapter, load_hf_config

    return sum(u.numel for u in get_adapter(load_hf_config(model_dir)).units())


def summarise(args, steps: list[dict], params: int) -> dict:
    measured = [r for r in steps if r["step"] > args.warmup]

    def mean(k):
        vals = [r[k] for r in measured if r.get(k) is not None]
        return sum(vals) / len(vals) if vals else None

    peak = lambda k: max((r[k] for r in measured if r.get(k) is not None), default=None)  # noqa: E731
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the largest child: the run
    busy = mean("busy_compute")
    return {
        "label": args.label, "device": args.device, "compile": args.compile, "model": Path(args.model).name,
        "nproc_per_node": args.nproc_per_node,
        "layers": args.layers, "params": params, "seq": args.seq, "seqs_per_step": args.seqs, "micro": args.micro,
        "tokens_per_step": measured[0]["tokens"] if measured else None, "precision": args.precision,
        "steps_measured": len(measured),
        "step_s": mean("step_time_s"), "wall_step_s": mean("wall_s"), "data_wait_s": mean("data_wait_s"),
        "queue_s": mean("queue_s"), "gpu_wait_s": mean("gpu_wait_s"), "tokens_per_s": mean("tokens_per_s"),
        "wall_tokens_per_s": mean("wall_tokens_per_s"), "tflops_6n": mean("tflops_6n"),
        "tflops_attn": mean("tflops_attn"), "mfu": mean("mfu"),
        "tflops_6n_active": mean("tflops_6n_active"), "router_loss": mean("router_loss"),  # MoE
        "expert_load_max": peak("expert_load_max"),
        "objective": args.objective, "pairs_per_step": args.seqs // 2 if args.objective != "sft" else None,
        **{k: measured[0].get(k) if measured else None for k in REFERENCE_FIELDS},
        "tokens_per_s_with_reference": with_reference(measured, len(steps)),
        "busy_compute": busy, "busy_h2d": mean("busy_h2d"), "busy_d2h": mean("busy_d2h"),
        "gpu_idle": 1.0 - busy if busy is not None else None,
        "gpu_peak_gib": peak("gpu_peak_gib"), "gpu_reserved_gib": peak("gpu_reserved_gib"),
        "host_rss_gib": peak("host_rss_gib"), "host_peak_rss_gib": child_rss / 2**30,
        "host_bytes_per_param": child_rss / params,
        "steps": [{k: r.get(k) for k in ["step", "loss", "grad_norm", "tokens", *STEP_FIELDS, "elapsed_s"]}
                  for r in steps],
        **step_spread(measured, "step_time_s"),  # every measured step, the slowest over the median, its idle
    }


def with_reference(measured: list[dict], steps: int) -> float | None:
    """Tokens per second of the measured steps with the reference pass's time spread over the run's steps (None
    without a pass)."""
    if not measured or not measured[0].get("reference_pass_s"):
        return None
    seconds = sum(r["step_time_s"] for r in measured) + measured[0]["reference_pass_s"] * len(measured) / steps
    return sum(r["tokens"] for r in measured) / seconds


def planned(path: Path) -> dict:
    """What the run planned at its start (output.dir/plan.json, which `megatrain train` writes): the placement it ran
    and the plan's step time, GPU peak and host peak, for bench/plan_vs_measured.py; empty when there is none."""
    if not path.is_file():
        return {}
    p = json.loads(path.read_text())
    return {"placement": p["placement"], "clipping": p["clipping"],
            "plan": {k: p[k] for k in ("step_time_s", "gpu_peak_gib", "gpu_needed_gib", "host_peak_gib", "bound",
                                       "fits", "placement_why", "host")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="folder with config.json")
    p.add_argument("--label", default=None)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--seqs", type=int, default=158, help="sequences per optimizer step (a multiple of --micro)")
    p.add_argument("--micro", type=int, default=79, help="sequences per micro-batch (micro_batch_size)")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not measured")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--compile", action="store_true", help="engine.compile: on (default off)")
    p.add_argument("--extend-context", action="store_true",
                   help="--seq beyond max_position_embeddings: extend the context in config.json (extended_context)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="train.device (cpu: check the script)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra config override passed to megatrain train (repeatable), e.g. plan.check=false")
    p.add_argument("--disk-path", default=None, help="memory.disk_path: the SSD tier's folder (created if missing)")
    p.add_argument("--host-budget-gb", type=float, default=None, help="memory.host_budget_gb")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="N",
                   help="ranks on this node, under torchrun (--seqs and --micro are per rank)")
    p.add_argument("--workdir", default=None, help="where the model dir, data, config and run go (kept); "
                                                   "default a temporary folder, removed afterwards")
    p.add_argument("--trace-host", action="store_true",
                   help="sample /proc during the run: each step's CPU, busiest threads and memory events (host_trace.py)")
    p.add_argument("--docs", default=None, metavar="LOW:HIGH",
                   help="packed rows (data.packing): documents of LOW..HIGH tokens, uniform, packed into --seq rows")
    p.add_argument("--lengths", default=None, metavar="LOW:HIGH",
                   help="unpacked rows of LOW..HIGH tokens, uniform (data.packing false; varied_rows.py)")
    p.add_argument("--objective", default="sft", choices=["sft", "dpo", "ipo", "simpo", "orpo"],
                   help="train.objective; a preference objective trains on pairs (--seqs, --micro: rows, 2 a pair)")
    p.add_argument("--reference", default="auto", choices=["auto", "precompute", "stream"],
                   help="preference.reference (dpo, ipo)")
    p.add_argument("--pretrained", action="store_true",
                   help="model.init: pretrained, from random bf16 safetensors written into the model folder "
                        "(pretrained_files.py); the disk's rates measured there first, the files' pages evicted")
    p.add_argument("--cached", action="store_true", help="with --pretrained: the files read once before the run "
                                                         "(in the page cache), not evicted")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.cached and not args.pretrained:
        p.error("--cached: only with --pretrained")
    if args.docs:
        low, high = (int(x) for x in args.docs.split(":"))
        if not 1 <= low <= high < args.seq:
            p.error(f"--docs {args.docs}: need 1 <= LOW <= HIGH < --seq")
        args.docs = (low, high)
    if args.lengths:
        try:
            args.lengths = varied_rows.parse(args.lengths, args.seq)
        except ValueError as e:
            p.error(str(e))
        if args.docs or args.objective != "sft":
            p.error("--lengths: unpacked SFT rows (no --docs, --objective sft)")
    if args.objective != "sft" and (args.micro % 2 or args.seqs % 2 or args.docs):
        p.error("--objective: --seqs and --micro count rows, two per pair: give even numbers (and no --docs: pairs "
                "are not packed)")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.seqs % args.micro:
        p.error(f"--seqs ({args.seqs}) must be a multiple of --micro ({args.micro}): the CLI's step is "
                f"grad_accum_steps micro-batches of micro_batch_size rows")
    args.label = args.label or f"cli-{Path(args.model).name}"
    if args.disk_path:  # the SSD tier: --set memory.disk_path=... with its folder made
        Path(args.disk_path).mkdir(parents=True, exist_ok=True)
        args.set.append(f"memory.disk_path={args.disk_path}")
        noclip = any(o.replace(" ", "") in ("train.max_grad_norm=null", "train.max_grad_norm=None") for o in args.set)
        if args.warmup < (1 if noclip else 2):  # the first optimizer pass finds the tier's files never written
            print(f"bench_cli: note: --warmup {args.warmup} with the SSD tier: the first optimizer pass (step "
                  f"{1 if noclip else 2}{'' if noclip else ', clipping on'}) reads nothing from the disk, so a "
                  f"measured step is steady only after it (--warmup {1 if noclip else 2})", file=sys.stderr)
    if args.host_budget_gb:
        args.set.append(f"memory.host_budget_gb={args.host_budget_gb}")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_cli-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cfg = model_config(args)
        if cfg.get("max_position_embeddings", args.seq) < args.seq:
            p.error(f"--seq {args.seq} exceeds the model's max_position_embeddings {cfg['max_position_embeddings']} "
                    "(--extend-context extends it: YaRN for unscaled RoPE)")
        t0 = time.perf_counter()
        write_model_dir(work / "model", cfg)
        n_words = write_tokenizer(work / "tokenizer", cfg)
        rows = args.seqs * args.nproc_per_node * (args.warmup + args.steps)
        if args.objective != "sft":
            write_pairs(work / "data.jsonl", rows // 2, args.seq, n_words)
        elif args.lengths:
            row_lengths = varied_rows.write_rows(work / "data.jsonl", rows, *args.lengths, n_words=n_words)
        elif args.docs:  # a quarter more than the steps need: the packer's last rows of an epoch are the emptiest
            write_documents(work / "data.jsonl", rows * args.seq * 5 // 4, *args.docs, n_words=n_words)
        else:
            write_data(work / "data.jsonl", rows=rows, words_per_row=args.seq + 16, n_words=n_words)
        out_dir = work / "run"
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        write_config(work / "run.yaml", args, work / "model", work / "tokenizer", work / "data.jsonl", out_dir)
        prep_s = time.perf_counter() - t0
        weights = pretrained(work / "model", args.cached) if args.pretrained else {}
        memory = NodeMemory()
        traces = []
        start_trace = (lambda pid: traces.append(HostTrace(pid, out_dir / "metrics.jsonl"))) if args.trace_host else None
        rc, total_s, cmd = run_cli(work / "run.yaml", args.set, work / "cli.log", args.nproc_per_node, memory,
                                   start_trace)
        for t in traces:
            t.stop()
        metrics = out_dir / "metrics.jsonl"
        steps = step_records(metrics) if metrics.is_file() else []
        res = summarise(args, steps, num_params(work / "model"))
        res.update(cli_exit_status=rc, cli_total_s=total_s, inputs_s=prep_s, cli_command=shlex.join(cmd),
                   overrides=args.set, workdir=str(work) if args.workdir else None, **memory.stop())
        res.update(node_host_per_param(res, args.nproc_per_node))
        if steps and steps[0].get("startup_s"):  # where the time before the first step went (rank 0's)
            res["startup_s"] = steps[0]["startup_s"]
            res["time_to_step_1_s"] = time_to_first_step(res["startup_s"])
            res["step_1_done_s"] = res["time_to_step_1_s"] + steps[0]["wall_s"] if steps[0].get("wall_s") else None
        if weights:
            res["pretrained"] = dict(weights, **load_phase(res.get("startup_s") or {}, weights))
        res.update(planned(out_dir / "plan.json"))
        if traces:
            res["host_trace"] = traces[0].per_step()
        full = args.seqs * args.seq * args.nproc_per_node
        # (pairs: each side's end-of-sequence token is the data layer's; the steps must at least be alike)
        if args.lengths:
            res.update(varied_rows.summary(steps, args.warmup, row_lengths, args.seq))
        short = [] if args.docs or args.lengths else [r["step"] for r in steps if r.get("tokens") != (
            full if args.objective == "sft" else steps[0].get("tokens"))]
        if args.docs:  # packed rows: the share of the rows' positions that hold a document's token
            res["packing_efficiency"] = min((r["tokens"] for r in steps), default=0) / full
        ok = rc == 0 and res["steps_measured"] == args.steps and not short
        if rc == STOPPED:
            res["error"] = f"stopped from outside after {res['steps_measured']} of {args.steps} measured steps"
        elif rc:
            res["error"] = f"megatrain train exited with {rc}"
        elif res["steps_measured"] != args.steps:
            res["error"] = f"{res['steps_measured']} measured steps in {metrics}, expected {args.steps}"
        elif short:  # rows not full: the comparison with bench_megatrain.py would not hold
            res["error"] = f"steps {short} did not have {full} real tokens ({args.seqs} full rows of {args.seq})"
        write_json(args.json, {"command": " ".join(sys.argv), "result": res})
        print("host RSS at its peak (GiB):", {k: round(v, 2) for k, v in res["host_rss_parts_gib"].items()},
              f"descendants {res['host_children_rss_gib']:.2f}")
        print(spread_lines(res))
        if args.lengths:
            print(varied_rows.line(res))
        if res.get("host_trace"):
            print("\n".join(trace_lines(res["host_trace"])))
        print(table([res], ["label", "objective", "params", "tokens_per_step", "step_s", "wall_step_s", "tokens_per_s",
                            "reference_pass_s", "tokens_per_s_with_reference",
                            "tflops_6n", "tflops_6n_active", "mfu", "gpu_idle", "busy_h2d", "busy_d2h", "gpu_peak_gib",
                            "host_peak_rss_gib", "host_node_rss_gib", "host_node_used_gib",
                            "host_bytes_per_param", "step_median_s", "slowest_step", "slowest_over_median",
                            "slowest_idle_s"]))
        if not ok:
            print(f"bench_cli: {res['error']}", file=sys.stderr)
        return 0 if ok else STOPPED if rc == STOPPED else 1
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
