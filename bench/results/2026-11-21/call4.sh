#!/usr/bin/env bash
# Device call 4: in-GPU transformers peer vs megatrain on a 3B Llama shape (same tokens per step), then the depth
# sweep (width 2048, 16/32/64/128 layers, 65,536 tokens per step).
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
timeout 120 python3 bench/bench_reference.py --model $M/llama-3b-shape --seq 1024 --seqs 64 --micro 8 \
  --json "$OUT/ref_3b.json" 2>&1 | tee "$OUT/peers.log"
timeout 130 python3 bench/bench_megatrain.py --model $M/llama-3b-shape --seq 1024 --seqs 64 --micro 32 --steps 2 \
  --compile --label megatrain-llama-3b-shape --json "$OUT/mt_3b.json" 2>&1 | tee -a "$OUT/peers.log"
for L in 16 32 64 128; do
  timeout 130 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers $L --seq 2048 --seqs 32 --micro 16 \
    --steps 2 --compile --label depth-$L --json "$OUT/depth_$L.json" 2>&1 | grep -v "^step" | tail -2 | tee -a "$OUT/depth.log"
done
