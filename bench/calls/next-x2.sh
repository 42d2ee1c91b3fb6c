# Pending (written 2026-11-24, not yet run): one GPU of an nvidia-h200-x2 (251 GiB host).
#   1. Qwen2.5-14B 158 x 1024, memory.gpu_budget_gb=80: with fp32 streaming the planner keeps every layer input
#      (K = 1, spill 30, 23 gradients to host; 243.5 GiB host) and predicts 29.3 s against 32.8 s for K = 2 with the
#      bf16 copy (measured 33.3 s); target <= 31 s
#   2. Llama-3.1-8B 16 x 4096 under 22 GiB with memory.host_budget_gb=124 (the H100's host), fp32 streaming chosen
export CUDA_VISIBLE_DEVICES=0
TAIL=8 run_logged qwen14b_80g 300 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 --compile \
  --seqs 158 --steps 1 --warmup 1 --set memory.gpu_budget_gb=80 --label qwen2.5-14b-158x1024-budget80-cli \
  --workdir /tmp/cli_14 --json "$OUT/qwen14b_80g.json"
cp /tmp/cli_14/cli.log "$OUT/qwen14b_80g_cli.log" 2>/dev/null
TAIL=8 run_logged llama8b_22g_host124 220 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 4096 --micro 1 \
  --compile --seqs 16 --steps 2 --warmup 1 --set memory.gpu_budget_gb=22 --set memory.host_budget_gb=124 \
  --label llama-3.1-8b-16x4096-budget22-host124-cli --workdir /tmp/cli_16 --json "$OUT/llama8b_22g_host124.json"
cp /tmp/cli_16/cli.log "$OUT/llama8b_22g_host124_cli.log" 2>/dev/null
