#!/usr/bin/env bash
# Device call 5: depth sweep at 131,072 tokens/step with checkpoints beyond 16 layers spilled to pinned host memory;
# spill + gradient offload on CUDA against the same run without (losses must agree).
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
for L in 16 32 64 128; do
  S=$(( L > 16 ? L - 16 : 0 ))
  timeout 150 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers $L --seq 2048 --seqs 64 --micro 16 \
    --steps 2 --compile --spill $S --label depth-$L-131k-spill$S --json "$OUT/depth131k_$L.json" 2>&1 | tee -a "$OUT/depth131k.log" | tail -3
done
for V in "0 0" "4 6"; do set -- $V
  timeout 100 python3 bench/bench_megatrain.py --model $M/qwen2.5-7b --layers 4 --seqs 32 --micro 16 --steps 2 \
    --spill $1 --offload $2 --label spill$1-offload$2 --json "$OUT/spillcheck_$1_$2.json" 2>&1 | tee -a "$OUT/spillcheck.log" | grep "^step"
done
