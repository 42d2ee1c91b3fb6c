# Issue 11, one GPU of an nvidia-h200-x2 (256 GiB host; the second GPU idle):
#   1. megatrain, Qwen2.5-7B 158 x 1024 (2 micro-batches of 79), compiled, the planner's placement (no keys)
#   2. DeepSpeed ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory, the same model, batch and
#      micro-batches (it did not fit the 128 GiB host of one H200: 18 B/param + buffers)
#   3. the depth sweep's deepest point under memory.gpu_budget_gb=16 (--gpu-budget 16: the planner's budget and a
#      hard cap on the caching allocator): 128 layers of width 2048, 131,072 tokens per step
export CUDA_VISIBLE_DEVICES=0
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79"
TAIL=3 run_logged megatrain_qwen7b 120 python3 bench/bench_megatrain.py $Q --steps 2 --warmup 1 --compile --auto \
  --label megatrain-qwen2.5-7b-x2 --json "$OUT/megatrain_qwen7b.json"
TAIL=4 run_logged deepspeed_qwen7b 280 python3 bench/bench_deepspeed.py $Q --steps 1 --warmup 1 \
  --label deepspeed-zero3-offload-qwen2.5-7b-x2 --json "$OUT/deepspeed_qwen7b.json"
TAIL=2 run_logged depth_128_b16 150 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers 128 \
  --seq 2048 --seqs 64 --micro 16 --steps 2 --warmup 1 --compile --auto --gpu-budget 16 \
  --label depth-128-131k-budget16 --json "$OUT/depth_128_b16.json"
