"""The toy task of issue 38 (docs/grpo.md, "The toy task"): the demo's reversal model learns exact-match reversal by
GRPO from its own samples, on the CPU, through `megatrain train`.

    1. SFT warm-start: the embedded demo (megatrain/defaults/default.yaml: a random-init 4-layer Llama, alpaca rows
       "reverse abc" -> "cba") for --sft-steps steps, exported as a Hugging Face folder.
    2. held-out check of the warm-start: the 100 held-out prompts (reverse-heldout.jsonl, never trained on), greedy
       exact match and the mean exact-match reward of --generations samples each with the GRPO run's sampling
       settings, by the rollout sampler (megatrain/rollout) on the exported weights.
    3. GRPO from that export: train.objective grpo, the built-in exact_match reward on the training prompts; the
       reward of each rollout batch (the mean over its prompts x completions, sampled before the step) is the curve.
    4. the same held-out check of the GRPO export.

Prints the curve (one line per rollout batch: step, mean reward, its group std, mean completion length) and writes
everything to --out (JSON). The defaults are the settings of docs/grpo.md's curve.

    python3 bench/grpo_toy.py --out /tmp/grpo_toy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = ROOT / "megatrain" / "defaults"


def megatrain_train(args: list[str], log: Path) -> float:
    """`python -m megatrain train ARGS` in a fresh process (default torch threads); its output to `log`; seconds."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "megatrain", "train", *args], stdout=f, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
    if rc:
        sys.exit(f"megatrain train failed ({rc}): see {log}\n" + log.read_text()[-3000:])
    return time.perf_counter() - t0


def sft(work: Path, steps: int, seed: int, more: int = 0, more_lr: float = 1e-3) -> Path:
    """The demo's SFT run for `steps` steps (its cosine schedule over them), then, with `more`, a second run of
    `more` steps from that export (a fresh AdamW: 10 warmup steps to more_lr, cosine after; seed + 1): the
    warm-start's export folder."""
    common = ["train.device=cpu", "train.precision=fp32", "train.eval_every=0", "export.at_end=true",
              "export.dtype=fp32", "checkpoint.at_end=false", f"data.cache_dir={work / 'cache'}"]
    secs = megatrain_train([str(DEFAULTS / "default.yaml"), f"train.steps={steps}", f"train.seed={seed}", *common,
                            f"output.dir={work / 'sft'}"], work / "sft.log")
    print(f"sft: {steps} steps in {secs:.0f}s", flush=True)
    if not more:
        return work / "sft" / "export"
    secs = megatrain_train([str(DEFAULTS / "default.yaml"), f"model.path={work / 'sft' / 'export'}",
                            "model.init=pretrained", f"train.steps={more}", f"train.lr={more_lr}",
                            "train.warmup_steps=10", f"train.seed={seed + 1}", *common, f"output.dir={work / 'sft2'}"],
                           work / "sft2.log")
    print(f"sft: {more} more steps in {secs:.0f}s", flush=True)
    return work / "sft2" / "export"


def grpo_config(work: Path, model: Path, a) -> Path:
    import yaml

    cfg = {"model": {"path": str(model)},
           "data": {"path": str(DEFAULTS / "reverse-train.jsonl"), "format": "prompt",
                    "columns": {"prompt": "instruction"}, "max_seq_len": 32, "cache_dir": str(work / "cache")},
           "train": {"objective": "grpo", "steps": a.steps, "micro_batch_size": a.micro_batch,
                     "grad_accum_steps": a.prompts * a.generations // a.micro_batch // a.steps_per_rollout,
                     "precision": "fp32", "lr": a.lr, "lr_schedule": "constant", "warmup_steps": a.warmup,
                     "weight_decay": 0.0, "max_grad_norm": 1.0, "device": "cpu", "seed": a.seed},
           "grpo": {"prompts_per_rollout": a.prompts, "num_generations": a.generations, "max_new_tokens": 8,
                    "temperature": a.temperature, "loss_type": a.loss_type, "epsilon": 0.2,
                    "rewards": [{"name": "exact_match", "field": "output"}]},
           "checkpoint": {"at_end": False}, "export": {"at_end": True, "dtype": "fp32"},
           "output": {"dir": str(work / "grpo")}}
    path = work / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def heldout(model: Path, generations: int, temperature: float, seed: int) -> dict:
    """Greedy exact match and the mean sampled exact-match reward over the held-out prompts, as the run renders and
    scores them (the chat template's user turn, the built-in exact_match), by megatrain's rollout sampler."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    from megatrain.rl.config import RewardSpec
    from megatrain.rl.rewards import builtin
    from megatrain.rollout import DictWeights, Sampler, SamplingParams

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in (DEFAULTS / "reverse-heldout.jsonl").read_text().splitlines() if line]
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["instruction"]}], tokenize=True,
                                       add_generation_prompt=True) for r in rows]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    tensors = {}
    for f in sorted(model.glob("*.safetensors")):
        tensors.update(load_file(f))
    sampler = Sampler(AutoConfig.from_pretrained(model), DictWeights(tensors, torch.float32), "cpu",
                      dtype=torch.float32)
    out = {}
    for name, params in (("greedy", SamplingParams(8, top_k=1, eos_token_ids=(tok.eos_token_id,))),
                         ("sampled", SamplingParams(8, temperature=temperature, n=generations,
                                                    eos_token_ids=(tok.eos_token_id,), seed=seed))):
        c = sampler.generate(prompts, params)
        texts = [tok.decode(ids, skip_special_tokens=True) for ids in c.completion_ids]
        scores = builtin(RewardSpec(name="exact_match", field="output"))(None, texts, [rows[i] for i in c.prompt_index])
        out[name] = sum(scores) / len(scores)
    sampler.close()
    return out


def curve(metrics: Path) -> list[dict]:
    """One point per rollout batch (its first optimizer step's record): the batch's rewards, sampled before it."""
    points, seen = [], set()
    for line in metrics.read_text().splitlines():
        r = json.loads(line)
        if "reward" not in r or r.get("rollout_batch") in seen:
            continue
        seen.add(r.get("rollout_batch"))
        points.append({"step": r["step"], "reward": r["reward"], "reward_std": r["reward_std"],
                       "mean_length": r["completions/mean_length"], "frac_reward_zero_std": r["frac_reward_zero_std"]})
    return points


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sft-steps", type=int, default=100)
    p.add_argument("--sft-more", type=int, default=60, help="a second SFT run's steps from the first's export")
    p.add_argument("--sft-more-lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=300, help="GRPO optimizer steps")
    p.add_argument("--prompts", type=int, default=32, help="prompts per rollout batch")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--steps-per-rollout", type=int, default=1, help="optimizer steps per rollout batch")
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.8)
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", type=Path, default=None, help="working folder (default: a new temporary one)")
    p.add_argument("--sft-from", type=Path, default=None, help="reuse an SFT export instead of step 1")
    p.add_argument("--out", type=Path, default=None, help="the JSON written")
    a = p.parse_args(argv)
    import tempfile

    work = a.work or Path(tempfile.mkdtemp(prefix="grpo_toy_"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    start = a.sft_from or sft(work, a.sft_steps, a.seed, a.sft_more, a.sft_more_lr)
    before = heldout(start, a.generations, a.temperature, a.seed)
    print(f"held-out before GRPO: greedy exact match {before['greedy']:.3f}, sampled reward {before['sampled']:.3f}",
          flush=True)
    secs = megatrain_train([str(grpo_config(work, start, a))], work / "grpo.log")
    points = curve(work / "grpo" / "metrics.jsonl")
    print("step  reward  reward_std  mean_length")
    for q in points:
        print(f"{q['step']:4d}  {q['reward']:.3f}   {q['reward_std']:.3f}       {q['mean_length']:.2f}")
    after = heldout(work / "grpo" / "export", a.generations, a.temperature, a.seed + 1)
    print(f"held-out after GRPO: greedy exact match {after['greedy']:.3f}, sampled reward {after['sampled']:.3f}")
    print(f"grpo: {a.steps} steps in {secs:.0f}s; total {time.perf_counter() - t0:.0f}s")
    result = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
              "curve": points, "heldout_before": before, "heldout_after": after, "grpo_seconds": secs,
              "command": "python3 bench/grpo_toy.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    if a.out:
        a.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
