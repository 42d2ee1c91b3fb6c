# Issue 11, one H200 of the x2 kind (256 GiB host; the second GPU idle), no memory keys but the budgets:
#   1. Llama-3.1-8B, 16 x 4096, memory.gpu_budget_gb=22, bf16 (on the H100's 125 GiB host the plan refuses it:
#      14 B/param plus the gradients that must leave a 22 GiB GPU exceed the host)
#   2. Qwen2.5-14B, 158 x 1024 (2 micro-batches of 79), memory.gpu_budget_gb=80 (an H100's memory)
# Planned with the default (H200) profile, as the committed H200 results.
export CUDA_VISIBLE_DEVICES=0
TAIL=8 run_logged llama8b_16x4096_22g 200 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 4096 --micro 1 \
  --compile --seqs 16 --steps 2 --warmup 1 --set memory.gpu_budget_gb=22 --label llama-3.1-8b-16x4096-budget22-cli \
  --workdir /tmp/cli_16 --json "$OUT/llama8b_16x4096_22g.json"
cp /tmp/cli_16/cli.log "$OUT/llama8b_16x4096_22g_cli.log" 2>/dev/null
TAIL=8 run_logged qwen14b_80g 260 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 --compile \
  --seqs 158 --steps 1 --warmup 1 --set memory.gpu_budget_gb=80 --label qwen2.5-14b-158x1024-budget80-cli \
  --workdir /tmp/cli_14 --json "$OUT/qwen14b_80g.json"
cp /tmp/cli_14/cli.log "$OUT/qwen14b_80g_cli.log" 2>/dev/null
