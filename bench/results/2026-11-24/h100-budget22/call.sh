# Issue 11 row "Llama-3.1-8B, 16 x 4096 per step, memory.gpu_budget_gb: 22, H100", on the nvidia-h100-x1's own host
# (~125 GiB): the planner streams the fp32 master (no bf16 copy on the host, 12 B/param) and predicts 123.9 GiB of
# host and 9.1 s with the H100 probe. memory.gpu_budget_gb is the only memory key set.
TAIL=10 run_logged llama8b_22g 330 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 4096 --micro 1 \
  --compile --seqs 16 --steps 2 --warmup 1 --set memory.gpu_budget_gb=22 \
  --label llama-3.1-8b-16x4096-budget22-h100-cli --workdir /tmp/cli_16 --json "$OUT/llama8b_22g.json"
cp /tmp/cli_16/cli.log "$OUT/llama8b_22g_cli.log" 2>/dev/null
free -g > "$OUT/free_after.txt"
