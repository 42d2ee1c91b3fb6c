# Issue 11, one GPU of an nvidia-h200-x2, second call (the first, x2-peer/: megatrain Qwen2.5-7B 15.13 s per step;
# DeepSpeed out of GPU memory at micro-batches of 79 rows, in the backward of transformers' full-vocabulary logits,
# 45.8 GiB asked with 26 GiB free; the budget run stopped on a bench bug, fixed):
#   1. the depth sweep's deepest point under memory.gpu_budget_gb=16: 128 layers of width 2048, 131,072 tokens
#   2. DeepSpeed ZeRO-3 offload, Qwen2.5-7B 158 x 1024 in micro-batches of 2 rows (158 = 2 x 79: the only smaller
#      divisor), one step with no warm-up (the device time left allows no more), its time printed every 10
#      micro-batches so that a step cut short still gives its rate
export CUDA_VISIBLE_DEVICES=0
TAIL=2 run_logged depth_128_b16 150 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers 128 \
  --seq 2048 --seqs 64 --micro 16 --steps 2 --warmup 1 --compile --auto --gpu-budget 16 \
  --label depth-128-131k-budget16 --json "$OUT/depth_128_b16.json"
TAIL=12 run_logged deepspeed_qwen7b_m2 330 python3 bench/bench_deepspeed.py --model $M/qwen2.5-7b --seq 1024 \
  --seqs 158 --micro 2 --steps 1 --warmup 0 --progress 10 --label deepspeed-zero3-offload-qwen2.5-7b-m2-x2 \
  --json "$OUT/deepspeed_qwen7b_m2.json"
