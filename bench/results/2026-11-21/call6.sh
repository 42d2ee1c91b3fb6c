#!/usr/bin/env bash
# Device call 6: the machine probe (plan calibration), spill/offload re-measured after the engine stopped holding
# handed-off gradients, and 128 layers at 131,072 tokens/step with as much spill as the 125 GB host allows.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
timeout 70 python3 bench/bench_megatrain.py --model $M/qwen2.5-7b --layers 4 --seqs 32 --micro 16 --steps 2 \
  --spill 4 --offload 6 --label spill4-offload6 --json "$OUT/spillcheck_4_6.json" 2>&1 | grep "^step"
timeout 170 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers 128 --seq 2048 --seqs 64 --micro 16 \
  --steps 2 --compile --spill 64 --label depth-128-131k-spill64 --json "$OUT/depth131k_128.json" 2>&1 | tail -2
timeout 300 python3 -m megatrain.probe --out "$OUT/h200_profile.json" --compile on \
  --layer $M/qwen2.5-7b:79x1024 --layer $M/llama-3.1-8b:16x4096 --layer $M/llama-2048-shape:16x2048 2>&1 | tail -25
