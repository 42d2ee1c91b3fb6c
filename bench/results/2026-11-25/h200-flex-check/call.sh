# Planner checks on one nvidia-h200 (written 2026-11-25 session 23), after the planner learned FlexAttention's cost
# (profile.FLEX_MEASURED, from h200-diag/attention_kernels.json) and `megatrain train` started measuring the CPU
# AdamW when no probed profile exists (plan.run_profile). Both through `megatrain train` (bench_cli.py), compiled,
# no memory keys; each cli.log has the plan's prediction.
#   1. Llama-3.1-8B, 32 x 4096 tokens per step in micro-batches of 8, data.packing: true: every layer runs
#      FlexAttention over the documents' block mask (the unpacked run, flash, is the 64 x 4096 row of issue 11).
#   2. Qwen2.5-7B, one 65,536-token row, clipping on, 1 warm-up + 3 measured steps: the GPU waits for the CPU AdamW
#      (its first measured step: 14.9 s against the 11.5 s planned with the default profile's 4.55 Gparam/s; this
#      machine's host measured 2.96 in h200-diag).
TAIL=8 run_logged llama8b_packed 300 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 4096 --seqs 32 \
  --micro 8 --compile --steps 2 --warmup 1 --set data.packing=true --label llama-3.1-8b-32x4096-packed-cli \
  --workdir /tmp/cli_lp --json "$OUT/llama8b_packed.json"
cp /tmp/cli_lp/cli.log "$OUT/llama8b_packed_cli.log" 2>/dev/null
rm -rf /tmp/cli_lp
TAIL=8 run_logged qwen7b_64k_steady 260 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 65536 --seqs 1 \
  --micro 1 --compile --steps 3 --warmup 1 --label qwen2.5-7b-1x65536-steady --workdir /tmp/cli_q64s \
  --json "$OUT/qwen7b_64k_steady.json"
cp /tmp/cli_q64s/cli.log "$OUT/qwen7b_64k_steady_cli.log" 2>/dev/null
