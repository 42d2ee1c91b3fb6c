#!/usr/bin/env bash
# Device call 12: the peers in one run with the final code (3B Llama shape, 65,536 tokens per step): megatrain,
# the in-GPU transformers reference, DeepSpeed ZeRO-3 CPU offload. Then the small-step regime's CPU-optimizer
# bound: the optimizer thread's in-step AdamW rate with a shorter GIL switch interval and fewer AdamW threads.
set -uo pipefail
export PYTHONUNBUFFERED=1 MEGATRAIN_REV=${MEGATRAIN_REV:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=bench/model-configs
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
B3="--model $M/llama-3b-shape --seq 1024 --seqs 64"
timeout 120 python3 bench/bench_megatrain.py $B3 --micro 32 --steps 3 --compile --label megatrain-llama-3b-shape \
  --json "$OUT/mt_3b.json" 2>&1 | tee "$OUT/peers.log" | tail -5
timeout 150 python3 bench/bench_reference.py $B3 --micro 8 --json "$OUT/ref_3b.json" 2>&1 | tee -a "$OUT/peers.log" | tail -2
timeout 240 python3 bench/bench_deepspeed.py $B3 --micro 32 --steps 2 --label deepspeed-zero3-offload-llama-3b-shape \
  --json "$OUT/ds_3b.json" 2>&1 | grep -v "Warning\|return func" | tee -a "$OUT/peers.log" | tail -2
timeout 120 python3 bench/bench_megatrain.py $B3 --micro 32 --steps 3 --compile --switch-interval 0.0002 \
  --label megatrain-3b-switch0.2ms --json "$OUT/mt_3b_switch.json" 2>&1 | tee "$OUT/adamw.log" | tail -4
timeout 120 python3 bench/bench_megatrain.py $B3 --micro 32 --steps 3 --compile --adam-threads 12 \
  --label megatrain-3b-adam12 --json "$OUT/mt_3b_adam12.json" 2>&1 | tee -a "$OUT/adamw.log" | tail -4
python3 bench/summarize.py "$OUT"
