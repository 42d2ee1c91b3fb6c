"""GRPO through `megatrain train` (train.objective: grpo): the step split into rollout, log-probs and training, beside
the plan's, on a model's real shape with random weights.

    python bench/bench_grpo.py --model bench/model-configs/qwen2.5-7b --prompts 64 --n 8 --prompt-len 128 \
        --max-new 512 --micro 64 --steps 2 --compile

In a temporary folder (bench_cli.py's model folder and word-level tokenizer) it writes prompts.jsonl: --prompts x
--steps-worth of rows {"prompt": --prompt-min to --prompt-len words (uniform; the batch is then left-padded),
"answer": "w7"}; the rollout batch is --prompts prompts x --n
completions, each taken to --max-new tokens (random weights seldom draw EOS, so the batch's every row runs the
whole decode, as the plan assumes), and one optimizer step trains the whole batch (micro_batch_size --micro,
grad_accum_steps batch / --micro) unless --iterations or --accum say otherwise. The reward is a regex over the decoded
completion (a known word ending in 7: some completions have one, so the advantages are not all zero; the reward's
value does not change the work). beta --beta (> 0: the reference copy and its log-prob pass).

Reads metrics.jsonl's per-step split (rollout_s, logps_s, train_s, rollout_tokens_per_s, rollout_mode) and the
run's plan.json (`rollout`: mode, decode step, rollout and log-prob seconds, the step with rollout) and reports each
measured step beside the plan: rollout seconds, tokens/s (the completions' tokens over the rollout's wall time),
log-prob seconds, the training part's seconds and tokens/s (every row's prompt and completion tokens), and the step.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_cli import (STOPPED, NodeMemory, model_config, num_params, run_cli, step_records,  # noqa: E402
                       write_model_dir, write_tokenizer)
from common import table, write_json  # noqa: E402

SPLIT = ["step_time_s", "rollout_s", "logps_s", "train_s", "rollout_tokens_per_s", "rollout_mode", "rollout_drain_s",
         "rollout_setup_s", "rollout_prefill_s", "rollout_decode_s", "rollout_decode_step_median_s",
         "rollout_decode_step_max_s", "tokens", "tokens_per_s", "gpu_peak_gib", "busy_compute", "loss", "reward",
         "completions/mean_length", "elapsed_s"]


def write_prompts(path: Path, rows: int, words: int, n_words: int, low: int, seed: int = 0) -> None:
    """Prompts of low..words words (uniform, seeded; one token each)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            prompt = " ".join(f"w{rng.randrange(n_words)}" for _ in range(rng.randint(low, words)))
            f.write(json.dumps({"prompt": prompt, "answer": "w7"}) + "\n")


def write_config(path: Path, args, work: Path) -> dict:
    import yaml

    batch = args.prompts * args.n
    accum = args.accum or batch // args.micro
    cfg = {
        "model": {"path": str(work / "model"), "init": "random", "tokenizer": str(work / "tokenizer")},
        "data": {"path": str(work / "prompts.jsonl"), "format": "prompt",
                 "max_seq_len": args.prompt_len + 1 + args.max_new, "cache_dir": str(work / "data-cache")},
        "train": {"objective": "grpo", "steps": args.steps, "micro_batch_size": args.micro,
                  "grad_accum_steps": accum, "lr": 1e-6, "lr_schedule": "constant", "warmup_steps": 0,
                  "weight_decay": 0.0, "max_grad_norm": 1.0, "seed": 0, "precision": "bf16",
                  "device": args.device, "eval_every": 0},
        "grpo": {"prompts_per_rollout": args.prompts, "num_generations": args.n, "num_iterations": args.iterations,
                 "max_new_tokens": args.max_new, "temperature": 1.0, "beta": args.beta, "rollout": args.rollout,
                 "rewards": [{"name": "regex", "pattern": r"\bw\d*7\b"}]},
        "engine": {"compile": "on" if args.compile else "off"},
        "checkpoint": {"every": 0, "at_end": False},
        "export": {"at_end": False},
        "output": {"dir": str(work / "run"), "overwrite": True},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return cfg


def planned_rollout(path: Path) -> dict:
    if not path.is_file():
        return {}
    p = json.loads(path.read_text())
    r = p.get("rollout") or {}
    keep = ("mode", "why", "kv_bytes", "drain_s", "setup_s", "decode_step_s", "prefill_s", "rollout_s", "tokens_per_s",
            "logps_s", "train_step_s", "steps_per_batch", "step_with_rollout_s")
    return {"placement": p.get("placement"), "plan_step_s": p.get("step_time_s"),
            "plan_rollout": {k: r.get(k) for k in keep}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--label", default=None)
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    ap.add_argument("--prompts", type=int, default=64, help="grpo.prompts_per_rollout")
    ap.add_argument("--n", type=int, default=8, help="grpo.num_generations")
    ap.add_argument("--prompt-len", type=int, default=128, help="words (tokens) per prompt, the longest")
    ap.add_argument("--prompt-min", type=int, default=None,
                    help="the shortest prompt (default --prompt-len: all of one length, no padding)")
    ap.add_argument("--max-new", type=int, default=512, help="grpo.max_new_tokens")
    ap.add_argument("--micro", type=int, default=64, help="train.micro_batch_size (completions)")
    ap.add_argument("--accum", type=int, default=None, help="train.grad_accum_steps (default: the whole batch)")
    ap.add_argument("--iterations", type=int, default=1, help="grpo.num_iterations")
    ap.add_argument("--beta", type=float, default=0.0, help="grpo.beta")
    ap.add_argument("--rollout", default="auto", choices=["auto", "resident", "streamed"])
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (train.steps)")
    ap.add_argument("--warmup", type=int, default=1, help="steps not counted in the means")
    ap.add_argument("--compile", action="store_true", help="engine.compile: on")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if (args.prompts * args.n) % args.micro:
        ap.error(f"--micro {args.micro} must divide the batch of {args.prompts * args.n} completions")
    if args.warmup >= args.steps:
        ap.error("--warmup must be below --steps")
    args.extend_context, args.seq = False, args.prompt_len + 1 + args.max_new  # what model_config reads
    args.label = args.label or f"grpo-{Path(args.model).name}"
    work = Path(tempfile.mkdtemp(prefix="bench_grpo-"))
    try:
        cfg = model_config(args)
        write_model_dir(work / "model", cfg)
        n_words = write_tokenizer(work / "tokenizer", cfg)
        batches = -(-args.steps * args.micro * (args.accum or args.prompts * args.n // args.micro)
                    // (args.prompts * args.n * args.iterations))
        write_prompts(work / "prompts.jsonl", args.prompts * (batches + 1), args.prompt_len, n_words,
                      args.prompt_min or args.prompt_len)
        write_config(work / "run.yaml", args, work)
        memory = NodeMemory()
        rc, total_s, cmd = run_cli(work / "run.yaml", args.set, work / "cli.log", 1, memory, None)
        memory.stop()
        metrics = work / "run" / "metrics.jsonl"
        steps = step_records(metrics) if metrics.is_file() else []
        rows = [{"step": s["step"], **{k: s.get(k) for k in SPLIT}} for s in steps]
        measured = [r for r in rows if r["step"] > args.warmup]
        first = [r for r in measured if r.get("rollout_s")]  # a rollout batch's first step

        def mean(k, rs):
            vals = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            return sum(vals) / len(vals) if vals else None

        res = {"label": args.label, "model": Path(args.model).name, "layers": args.layers,
               "params": num_params(work / "model"), "prompts": args.prompts, "n": args.n,
               "prompt_len": args.prompt_len, "prompt_min": args.prompt_min or args.prompt_len,
               "max_new": args.max_new, "micro": args.micro,
               "iterations": args.iterations, "beta": args.beta, "compile": args.compile,
               "rollout_s": mean("rollout_s", first), "rollout_tokens_per_s": mean("rollout_tokens_per_s", first),
               "rollout_mode": first[0]["rollout_mode"] if first else None, "logps_s": mean("logps_s", first),
               "train_s": mean("train_s", measured), "step_s": mean("step_time_s", measured),
               "train_tokens_per_s": None, "steps": rows, "cli_exit_status": rc, "cli_total_s": total_s,
               "cli_command": shlex.join(cmd), "startup_s": steps[0].get("startup_s") if steps else None,
               **planned_rollout(work / "run" / "plan.json")}
        if measured and res["train_s"]:
            res["train_tokens_per_s"] = mean("tokens", measured) / res["train_s"]
        ok = rc == 0 and len(measured) == args.steps - args.warmup
        if not ok:
            res["error"] = (f"stopped from outside after {len(measured)} measured steps" if rc == STOPPED else
                            f"megatrain train exited with {rc}" if rc else f"{len(measured)} measured steps")
            print((work / "cli.log").read_text()[-3000:], file=sys.stderr)
        write_json(args.json, {"command": " ".join(sys.argv), "result": res})
        for r in rows:
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
        pr = res.get("plan_rollout") or {}
        plan_row = {"label": "plan", "rollout_mode": pr.get("mode"), "rollout_s": pr.get("rollout_s"),
                    "rollout_tokens_per_s": pr.get("tokens_per_s"), "logps_s": pr.get("logps_s"),
                    "train_s": pr.get("train_step_s"), "step_s": pr.get("step_with_rollout_s")}
        print(table([res, plan_row], ["label", "rollout_mode", "rollout_s", "rollout_tokens_per_s", "logps_s",
                                      "train_s", "train_tokens_per_s", "step_s"]))
        return 0 if ok else STOPPED if rc == STOPPED else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
