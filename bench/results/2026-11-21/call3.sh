#!/usr/bin/env bash
# Device call 3: Llama-3.1-8B 4096x64 variants (cuDNN attention; larger micro-batches); Qwen2.5-7B host RSS with
# smaller landing buffers.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 bench/bench_megatrain.py --model bench/model-configs/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 \
  --steps 2 --compile --attn cudnn --label llama-3.1-8b-4k-cudnn --json "$OUT/llama8b_cudnn.json" 2>&1 | tee "$OUT/llama8b_cudnn.log"
timeout 190 python3 bench/bench_megatrain.py --model bench/model-configs/llama-3.1-8b --seq 4096 --seqs 64 --micro 32 \
  --steps 2 --compile --attn cudnn --label llama-3.1-8b-4k-cudnn-m32 --json "$OUT/llama8b_cudnn_m32.json" 2>&1 | tee "$OUT/llama8b_m32.log"
timeout 200 python3 bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 \
  --steps 2 --compile --attn cudnn --label qwen2.5-7b-compile-m79-cudnn --json "$OUT/qwen7b_cudnn.json" 2>&1 | tee "$OUT/qwen7b_cudnn.log"
