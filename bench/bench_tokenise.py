"""Tokenising alpaca rows through megatrain's own data path (`data.build_train_loader`, what `megatrain train` runs to
build its examples), on first start (empty data.cache_dir) and cached (the same cache_dir, a fresh process).

    python bench/bench_tokenise.py --rows 1000000 --work /tmp/tokbench --json OUT.json [--num-proc N] [--profile]
                                   [--root CHECKOUT]

In --work (kept, so a second call reuses them) it writes once
  tokenizer/  a byte-level BPE of --vocab tokens (the `tokenizers` library, trained on the synthetic text), saved as
              a PreTrainedTokenizerFast folder with Qwen2.5's ChatML chat template (default system prompt);
  alpaca-<rows>-<seed>.jsonl  rows {"instruction", "input", "output"} of seeded synthetic text: pseudo-words of
              a Zipf vocabulary in sentences, a row's total drawn uniform in 150..450 tokens (with the template's
              text: ~300 on average), 40% of the inputs empty;
then runs, each in a fresh process (`--child`), `load_tokenizer`, `build_train_loader` with data.format alpaca,
max_seq_len 2048, data.num_proc --num-proc (unset: megatrain's default) and the first step's batches, twice: `first`
with an empty cache/ and `cached` with the same cache/. Per run: rows, tokens, seconds (build_s) and those of its
phases (read: JSON lines -> Arrow; tokenise: datasets.map; examples: the rest of build_examples; sampler: the epoch's
plan, the run summary's lines, which the run's start prints, and the first step's batches), the process's wall time
from its start (imports included), processes used, CPU count, and CPU seconds of the process and of its worker
processes. --profile adds each run's cProfile summary of the main process (the workers' time is not in it); --root
times another checkout's megatrain (before and after a change); --runs cached alone reuses the cache of before.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (  # Qwen2.5's ChatML without tools: a default system prompt unless the conversation has one
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if not (m.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
STUB = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
        "<|im_start|>assistant\ny<|im_end|>\n")  # what the template adds to a row's x and y


# ---- synthetic text ----------------------------------------------------------------------------------------------
def word_list(n: int, rng) -> list[str]:
    """n distinct pseudo-words of 1..4 syllables, most frequent first."""
    cons = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "st", "tr", "pl", "gr"]
    syll = [c + v + e for c in cons for v in ("a", "e", "i", "o", "u", "ai", "ou") for e in ("", "n", "r", "s")]
    out, seen = [], set()
    while len(out) < n:
        k = min(4, 1 + int(rng.geometric(0.45)) - 1 + (len(out) > 2000))
        w = "".join(syll[i] for i in rng.integers(0, len(syll), k))
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


def sentence_pool(n: int, seed: int) -> list[str]:
    """n sentences of 4..24 Zipf-drawn words (capitalised, some numbers and commas, ending in . or ?)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = np.array(word_list(200_000, rng), dtype=object)
    p = 1.0 / (np.arange(len(words)) + 2.7)
    p /= p.sum()
    lens = rng.integers(4, 25, n)
    idx = rng.choice(len(words), size=int(lens.sum()), p=p)
    out, pos = [], 0
    for k in lens.tolist():
        ws = list(words[idx[pos: pos + k]])
        pos += k
        if rng.random() < 0.2:
            ws[int(rng.integers(0, k))] = str(int(rng.integers(0, 10_000)))
        if k > 8 and rng.random() < 0.5:
            ws[k // 2] += ","
        out.append(" ".join(ws).capitalize() + ("?" if rng.random() < 0.1 else "."))
    return out


def build_tokenizer(folder: Path, pool: list[str], vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(pool + [STUB] * 2000, trainer)  # the template's own words are tokens, as in real ones
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(folder))


def write_rows(path: Path, rows: int, pool: list[str], tok, seed: int) -> None:
    """rows alpaca rows of uniform 150..450 tokens with the template's (the sentences' own counts)."""
    import numpy as np

    rng = np.random.default_rng(seed + 1)
    cost = np.array([len(x) for x in tok(pool, add_special_tokens=False)["input_ids"]])
    template = len(tok(STUB, add_special_tokens=False)["input_ids"]) - 2
    tmp = path.with_suffix(".part")
    with tmp.open("w") as f:
        for _ in range(rows):
            budget = int(rng.integers(150, 451)) - template
            picks = rng.integers(0, len(pool), 64)
            n_ins = 1 + int(rng.random() < 0.4)
            n_in = 0 if rng.random() < 0.4 else int(rng.integers(1, 4))
            used = np.cumsum(cost[picks])
            n_all = max(n_ins + n_in + 1, int(np.searchsorted(used, budget, side="right")))
            s = [pool[i] for i in picks[:n_all].tolist()]
            f.write(json.dumps({"instruction": " ".join(s[:n_ins]), "input": " ".join(s[n_ins: n_ins + n_in]),
                                "output": " ".join(s[n_ins + n_in:])}) + "\n")
    tmp.rename(path)


def prepare(work: Path, rows: int, vocab: int, seed: int) -> tuple[Path, Path]:
    work.mkdir(parents=True, exist_ok=True)
    tok_dir, data = work / f"tokenizer-{vocab}-{seed}", work / f"alpaca-{rows}-{seed}.jsonl"
    if tok_dir.is_dir() and data.is_file():
        return tok_dir, data
    t0 = time.perf_counter()
    pool = sentence_pool(200_000, seed)
    if not tok_dir.is_dir():
        build_tokenizer(tok_dir, pool, vocab)
        print(f"tokenizer: {tok_dir} ({time.perf_counter() - t0:.0f} s)", flush=True)
    if not data.is_file():
        from transformers import AutoTokenizer

        write_rows(data, rows, pool, AutoTokenizer.from_pretrained(str(tok_dir)), seed)
        print(f"data: {data} ({data.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s)", flush=True)
    return tok_dir, data


# ---- one timed run, in its own process ---------------------------------------------------------------------------
def child(args) -> None:
    import cProfile
    import io
    import pstats

    from megatrain.data import DataConfig, build_train_loader, load_tokenizer
    from megatrain.data import encode, examples, loader

    phases: dict[str, float] = {}
    used: list = []

    def timed(mod, name, key):
        fn = getattr(mod, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                phases[key] = phases.get(key, 0.0) + time.perf_counter() - t
        setattr(mod, name, wrapper)

    timed(examples, "read_part" if hasattr(examples, "read_part") else "load_raw", "read")
    timed(examples, "tokenise", "tokenise")
    timed(loader, "build_examples", "examples")
    procs = encode.processes
    encode.processes = lambda n, rows: used.append(procs(n, rows)) or used[-1]
    imported = time.perf_counter()
    cfg = DataConfig(path=args.data, format="alpaca", max_seq_len=2048, cache_dir=args.cache, num_proc=args.num_proc)
    c0, t0 = os.times(), time.perf_counter()
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    tok = load_tokenizer(args.tokenizer)
    t_tok = time.perf_counter()
    ld = build_train_loader(cfg, tok, seed=0, micro_batch_size=8, grad_accum_steps=4)
    ld.summary()  # the run's start prints it (trainer.py): the counts and the plan's padding
    ld.next_step()  # the first step's batches
    t1, c1 = time.perf_counter(), os.times()
    if prof:
        prof.disable()
    counts = ld.examples.counts
    res = {"rows": counts.rows, "examples": counts.examples, "tokens": counts.tokens, "targets": counts.targets,
           "build_s": t1 - t_tok, "tokenizer_load_s": t_tok - t0,
           "read_s": phases.get("read", 0.0), "tokenise_s": phases.get("tokenise", 0.0),
           "examples_rest_s": phases.get("examples", 0.0) - phases.get("read", 0.0) - phases.get("tokenise", 0.0),
           "sampler_s": t1 - t_tok - phases.get("examples", 0.0),
           "process_s": time.time() - _process_start(), "imports_s": imported - _PT0,
           "processes": used[0] if used else None, "cpus": len(os.sched_getaffinity(0)),
           "megatrain": str(Path(encode.__file__).parents[2]),
           "cpu_s": (c1.user + c1.system) - (c0.user + c0.system),
           "cpu_children_s": (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)}
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.top)
        res["profile"] = s.getvalue()
    print("RESULT " + json.dumps(res), flush=True)


_PT0 = time.perf_counter()


def _process_start() -> float:
    """Wall-clock time this process started (Linux: /proc/self/stat's start time in clock ticks since boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def run_child(args, tok_dir: Path, data: Path, cache: Path, label: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--tokenizer", str(tok_dir), "--data", str(data),
           "--cache", str(cache), "--top", str(args.top)] + (["--profile"] if args.profile else []) + \
          (["--num-proc", str(args.num_proc)] if args.num_proc else [])
    env = {**os.environ, "PYTHONPATH": str(Path(args.root or ROOT).resolve()) + os.pathsep +
           os.environ.get("PYTHONPATH", "")}
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode or line is None:
        sys.stderr.write(p.stdout[-4000:] + p.stderr[-4000:])
        raise SystemExit(f"{label}: the run failed (exit {p.returncode})")
    res = {"run": label, **json.loads(line[7:]), "wall_s": wall}
    res["rows_per_s"] = res["rows"] / res["build_s"]
    res["tokens_per_s"] = res["tokens"] / res["build_s"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--work", default="/tmp/megatrain-tokbench", help="tokenizer, data and cache (kept)")
    ap.add_argument("--num-proc", type=int, default=None, help="data.num_proc (unset: megatrain's default)")
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    ap.add_argument("--profile", action="store_true", help="cProfile of each run's main process")
    ap.add_argument("--runs", default="first,cached", help="which runs, in order (cached alone: the cache of before)")
    ap.add_argument("--root", help="time the megatrain of this checkout (default: this one's)")
    ap.add_argument("--top", type=int, default=25, help="lines of each profile")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return 0
    work = Path(args.work).expanduser()
    tok_dir, data = prepare(work, args.rows, args.vocab, args.seed)
    cache = work / "cache"
    runs = []
    for label in args.runs.split(","):
        if label == "first":
            shutil.rmtree(cache, ignore_errors=True)
        runs.append(run_child(args, tok_dir, data, cache, label))
    for r in runs:
        if r.get("profile"):
            print(f"--- {r['run']}: cProfile of the main process\n{r.pop('profile')}")
    sys.path.insert(0, str(HERE))
    from common import table, write_json

    cols = ["run", "rows", "tokens", "build_s", "read_s", "tokenise_s", "examples_rest_s", "sampler_s",
            "process_s", "rows_per_s", "tokens_per_s", "processes", "cpus", "cpu_s", "cpu_children_s"]
    print(table(runs, cols))
    write_json(args.json, {"bench": "bench_tokenise", "rows_asked": args.rows, "vocab": args.vocab,
                           "num_proc": args.num_proc, "data": str(data), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
