#!/usr/bin/env bash
# Device call 8: the DeepSpeed ZeRO-3 CPU-offload peer (3B Llama shape, same tokens per step as megatrain and the
# in-GPU peer, run beside megatrain in this call; Qwen2.5-7B attempted to record what it wants of host memory), and
# the LM-head / attention kernel variants at the Llama-3.1-8B benchmark's shapes.
# Needs the wheels in .whl/ (bench/README.md: "DeepSpeed peer") carried to the device.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
timeout 150 python3 bench/head_attn_variants.py --model $M/llama-3.1-8b --micro 16 --seq 4096 \
  --json "$OUT/head_attn_variants.json" 2>&1 | tee "$OUT/head_attn_variants.log" | tail -12
timeout 120 python3 bench/bench_megatrain.py --model $M/llama-3b-shape --seq 1024 --seqs 64 --micro 32 --steps 2 \
  --compile --label megatrain-llama-3b-shape --json "$OUT/mt_3b_call8.json" 2>&1 | tee "$OUT/peers_call8.log" | tail -2
for MB in 32 8; do
  timeout 300 python3 bench/bench_deepspeed.py --model $M/llama-3b-shape --seq 1024 --seqs 64 --micro $MB --steps 2 \
    --label deepspeed-zero3-offload-llama-3b-shape-m$MB --json "$OUT/ds_3b_m$MB.json" 2>&1 \
    | grep -v "Warning\|return func" | tee -a "$OUT/peers_call8.log" | tail -4
done
timeout 240 python3 bench/bench_deepspeed.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --try-anyway \
  --label deepspeed-zero3-offload-qwen2.5-7b --json "$OUT/ds_qwen7b.json" 2>&1 | grep -v "Warning\|return func" \
  | tee -a "$OUT/peers_call8.log" | tail -4
python3 bench/summarize.py "$OUT"
