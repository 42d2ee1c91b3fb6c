#!/usr/bin/env bash
# Device call 11: the depth sweep (Llama-style width 2048; 16/32/64/128 layers; 131,072 tokens per step) under one
# GPU memory budget of 40 GiB, enforced as a hard cap on PyTorch's caching allocator
# (torch.cuda.set_per_process_memory_fraction): a run that needed more would fail with out-of-memory. Checkpoints
# of all but 16 layers are spilled to pinned host memory (all but 64 at 128 layers, where the 125 GB host holds the
# 81 GB store and 32 GB of spill). Expandable segments keep the allocator's reserve close to what is allocated.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown} PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
for L in 16 32 64 128; do
  S=$(( L <= 16 ? 0 : (L == 128 ? 64 : L - 16) ))
  timeout 200 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers $L --seq 2048 --seqs 64 --micro 16 \
    --steps 2 --compile --spill $S --gpu-budget 40 --label depth-$L-131k-spill$S-budget40 \
    --json "$OUT/depth_budget40_$L.json" 2>&1 | tee -a "$OUT/depth_budget40.log" | tail -2
done
python3 bench/summarize.py "$OUT"
