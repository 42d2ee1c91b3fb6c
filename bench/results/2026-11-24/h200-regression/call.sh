# Issue 11, one nvidia-h200 (141 GB, 128 GiB host): is the default path as fast as before the bounded-memory work?
# Qwen2.5-7B 158 x 1024 (2 micro-batches of 79) was 14.76-14.81 s (2026-11-23 layout-speed), Llama-3.1-8B 64 x 4096
# (4 micro-batches of 16) 27.1 s (2026-11-21 call10). No memory keys: --auto runs the planner's placement from free
# GPU and host memory, as `megatrain train` does, and records the plan beside the measurement.
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 2 --compile --auto"
TAIL=4 run_logged qwen7b 200 python3 bench/bench_megatrain.py $Q --label qwen2.5-7b-auto --json "$OUT/qwen7b.json"
L="--model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 --steps 2 --warmup 1 --compile --auto"
TAIL=4 run_logged llama8b 230 python3 bench/bench_megatrain.py $L --label llama-3.1-8b-64x4096-auto \
  --json "$OUT/llama8b.json"
