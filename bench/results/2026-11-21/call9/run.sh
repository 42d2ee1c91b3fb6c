#!/usr/bin/env bash
# Device call 9: fused q/k/v + gate/up projections and the fused LM-head accumulation. Kernel A/B at the
# Llama-3.1-8B shapes (LM head variants, one compiled layer separate vs fused), the Llama-3.1-8B benchmark with
# the new defaults, and the GPU equivalence check (the CUDA path now runs the fused forms).
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
timeout 240 python3 bench/gpu_equivalence.py --json "$OUT/gpu_equivalence_fused.json" 2>&1 \
  | tee "$OUT/gpu_equivalence_fused.log" | tail -4
timeout 200 python3 bench/head_attn_variants.py --model $M/llama-3.1-8b --micro 16 --seq 4096 --parts head,layers \
  --json "$OUT/kernel_variants_call9.json" 2>&1 | tee "$OUT/kernel_variants_call9.log" | tail -9
timeout 260 python3 bench/bench_megatrain.py --model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 --steps 2 \
  --compile --label llama-3.1-8b-4k-fused --json "$OUT/llama8b_fused.json" 2>&1 | tee "$OUT/llama8b_fused.log" | tail -5
