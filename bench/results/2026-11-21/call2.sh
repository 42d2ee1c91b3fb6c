#!/usr/bin/env bash
# Device call 2: Qwen2.5-7B with the compiled template and 2 micro-batches of 79; Llama-3.1-8B 4096 x 64.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 280 python3 bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 \
  --steps 2 --compile --label qwen2.5-7b-compile-m79 --json "$OUT/qwen7b_compile.json" 2>&1 | tee "$OUT/qwen7b_compile.log"
timeout 300 python3 bench/bench_megatrain.py --model bench/model-configs/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 \
  --steps 2 --compile --label llama-3.1-8b-4k --json "$OUT/llama8b.json" 2>&1 | tee "$OUT/llama8b.log"
