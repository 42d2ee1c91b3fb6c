#!/usr/bin/env bash
# Device call 7: Llama-3.1-8B 4096x64 and Qwen2.5-7B 1024x158 with the compiled LM-head cross-entropy.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
timeout 250 python3 bench/bench_megatrain.py --model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 --steps 2 \
  --compile --label llama-3.1-8b-4k-headc --json "$OUT/llama8b_headc.json" 2>&1 | grep -v "^sdpa" | tail -5
timeout 230 python3 bench/bench_megatrain.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 \
  --compile --label qwen2.5-7b-headc --json "$OUT/qwen7b_headc.json" 2>&1 | grep -v "^sdpa" | tail -5
