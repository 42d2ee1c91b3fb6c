# Issue 15 on one nvidia-h200 (written 2026-11-25 session 22, not yet run): Qwen2.5-7B with one sequence of 32k, 64k
# and 128k tokens per step, `megatrain train` through bench_cli.py, compiled, no memory keys (the planner chooses and
# prints its placement in each cli.log), one warm-up step and one measured. The plan (default H200 profile, the one
# the device runs use; bench/plot_long_context.py, bench/results/2026-11-25/long_context.json): the layer over tiles
# of 8,192 tokens and the top 28 layers keeping their attention (memory.reuse_attention=28):
#   32k  5.8 s/step, GPU peak 34.0 GiB allocated      64k  11.5 s, 35.7 GiB      128k  33.6 s, 64.2 GiB
# (Llama-3.1-8B at 128k, the same way: planned 41.1 s / 80.5 GiB, measured 42.1 s / 80.3 GiB: h200-reuse.)
# Limits: ~70 s start-up (host store of ~105 GiB, data) + ~60 s compiling + 2 steps at up to 1.3x the plan.
for T in 32768 65536 131072; do
  K=$((T / 1024))
  TAIL=8 run_logged qwen7b_${K}k $((150 + 3 * T / 1024)) python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq $T \
    --seqs 1 --micro 1 --compile --steps 1 --warmup 1 --label qwen2.5-7b-1x$T-cli --workdir /tmp/cli_q$K \
    --json "$OUT/qwen7b_${K}k.json"
  cp /tmp/cli_q$K/cli.log "$OUT/qwen7b_${K}k_cli.log" 2>/dev/null
  rm -rf /tmp/cli_q$K
done
