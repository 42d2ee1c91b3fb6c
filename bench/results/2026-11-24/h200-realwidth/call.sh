# Issue 11, one nvidia-h200: the planner at real widths. Llama-3.1-70B truncated to 4 layers and Llama-3.1-405B
# truncated to 1 layer (embedding and head whole), 128 x 4096 = 524,288 tokens per step (16 micro-batches of 8),
# the planner's placement (--auto, no memory keys). Measured GPU peak, host peak and step time against the plan.
B="--seq 4096 --seqs 128 --micro 8 --steps 1 --warmup 1 --compile --auto"
TAIL=4 run_logged llama70b_4l 260 python3 bench/bench_megatrain.py --model $M/llama-3.1-70b --layers 4 $B \
  --label llama-3.1-70b-4layers-524k-auto --json "$OUT/llama70b_4l.json"
TAIL=4 run_logged llama405b_1l 300 python3 bench/bench_megatrain.py --model $M/llama-3.1-405b --layers 1 $B \
  --label llama-3.1-405b-1layer-524k-auto --json "$OUT/llama405b_1l.json"
