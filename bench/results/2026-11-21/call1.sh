#!/usr/bin/env bash
# Device call 1: GPU equivalence, a 4-layer smoke of the 7B shape, then Qwen2.5-7B at the paper's configuration.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
free -g | head -2
timeout 240 python3 bench/gpu_equivalence.py --json "$OUT/gpu_equivalence.json" 2>&1 | tee "$OUT/gpu_equivalence.log"
timeout 150 python3 bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --layers 4 --seqs 64 --micro 32 \
  --steps 2 --label qwen7b-4layers --json "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log"
timeout 420 python3 bench/bench_megatrain.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 32 \
  --steps 2 --label qwen2.5-7b --json "$OUT/qwen7b.json" 2>&1 | tee "$OUT/qwen7b.log"
