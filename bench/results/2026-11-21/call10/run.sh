#!/usr/bin/env bash
# Device call 10: the fused cross-entropy kernel (megatrain/ce_triton.py) with 4096-row LM-head chunks and the
# fp32 weight-gradient accumulation inside the GEMM: kernel checks against the eager version and an fp32
# reference, GPU equivalence, then the two throughput targets (Llama-3.1-8B 64 x 4096, Qwen2.5-7B 158 x 1024) with
# these defaults, and the DeepSpeed peer's host-memory check for Llama-3.1-8B.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
timeout 150 python3 bench/head_attn_variants.py --model $M/llama-3.1-8b --micro 16 --seq 4096 --parts ce,head \
  --json "$OUT/kernel_variants_call10.json" 2>&1 | tee "$OUT/kernel_variants_call10.log" | tail -10
timeout 150 python3 bench/gpu_equivalence.py --json "$OUT/gpu_equivalence_call10.json" 2>&1 \
  | tee "$OUT/gpu_equivalence_call10.log" | tail -3
timeout 230 python3 bench/bench_megatrain.py --model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 --steps 2 \
  --compile --label llama-3.1-8b-4k-cekernel --json "$OUT/llama8b_call10.json" 2>&1 | tee "$OUT/llama8b_call10.log" | tail -4
timeout 200 python3 bench/bench_megatrain.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 \
  --compile --label qwen2.5-7b-cekernel --json "$OUT/qwen7b_call10.json" 2>&1 | tee "$OUT/qwen7b_call10.log" | tail -4
timeout 60 python3 bench/bench_deepspeed.py --model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 \
  --label deepspeed-zero3-offload-llama-3.1-8b --json "$OUT/ds_llama8b.json" 2>&1 | tail -3
