# Issue 11, second call on the same H100 (128 GiB host):
#   1. `megatrain probe` with the Llama-3.1-8B layer at 1 x 4096 (compiled): this machine's profile
#   2. Llama-3.1-8B, 16 x 4096, memory.gpu_budget_gb=22: in bf16 the plan refuses it on this host (14 B/param +
#      the gradients that must leave the GPU exceed 124 GiB); its suggestion, train.precision=fp32, is run
#   3. Llama-3.1-8B, 64 x 4096 again, no memory keys, planned with this machine's profile
TAIL=10 run_logged probe 200 python3 -m megatrain probe --out "$OUT/h100_profile.json" \
  --layer "$M/llama-3.1-8b:1x4096" --compile on
P=(--set "plan.profile=$OUT/h100_profile.json")
[ -f "$OUT/h100_profile.json" ] || P=()
L="--model $M/llama-3.1-8b --seq 4096 --micro 1 --compile"
TAIL=8 run_logged llama8b_16x4096_22g_fp32 170 python3 bench/bench_cli.py $L --seqs 16 --steps 2 --warmup 1 \
  --precision fp32 --set memory.gpu_budget_gb=22 "${P[@]}" --label llama-3.1-8b-16x4096-budget22-fp32-cli \
  --workdir /tmp/cli_16f --json "$OUT/llama8b_16x4096_22g_fp32.json"
cp /tmp/cli_16f/cli.log "$OUT/llama8b_16x4096_22g_fp32_cli.log" 2>/dev/null
TAIL=8 run_logged llama8b_64x4096_probed 220 python3 bench/bench_cli.py $L --seqs 64 --steps 2 --warmup 1 "${P[@]}" \
  --label llama-3.1-8b-64x4096-cli-h100-profile --workdir /tmp/cli_64p --json "$OUT/llama8b_64x4096_probed.json"
cp /tmp/cli_64p/cli.log "$OUT/llama8b_64x4096_probed_cli.log" 2>/dev/null
