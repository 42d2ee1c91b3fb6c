# Issue 12 on one nvidia-h200 (2026-11-25, session 21, sixth call), at the gather combine (70eb031 and later):
#   1. gpt-oss-120b at real width truncated to 2 layers, 256 x 4096 per step, micro-batches of 16, `megatrain
#      train`, compiled, no memory keys, 1 warm-up + 1 measured step. Measured 16.0 s with the index_add combine
#      (bench/results/2026-11-25/h200-gptoss); planned now with today's gpt-oss layer probe (h200-olmoe): 14.52 s.
#   2. Gemma-2-9B at full depth (42 layers, 9.24B, 256k vocabulary, soft-capped attention through FlexAttention),
#      64 x 4096 = 262,144 tokens per step, micro-batches of 8, compiled, no memory keys, 1 warm-up + 1 measured.
TAIL=8 run_logged gptoss120b_2l 280 python3 bench/bench_cli.py --model $M/gpt-oss-120b --layers 2 --seq 4096 \
  --seqs 256 --micro 16 --compile --steps 1 --warmup 1 --label gpt-oss-120b-2l-256x4096-cli --workdir /tmp/cli_g \
  --json "$OUT/gptoss120b_2l.json"
cp /tmp/cli_g/cli.log "$OUT/gptoss120b_2l_cli.log" 2>/dev/null
rm -rf /tmp/cli_g
TAIL=8 run_logged gemma2_9b 280 python3 bench/bench_cli.py --model $M/gemma-2-9b --seq 4096 \
  --seqs 64 --micro 8 --compile --steps 1 --warmup 1 --label gemma-2-9b-64x4096-cli --workdir /tmp/cli_e \
  --json "$OUT/gemma2_9b.json"
cp /tmp/cli_e/cli.log "$OUT/gemma2_9b_cli.log" 2>/dev/null
