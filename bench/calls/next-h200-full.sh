# Issue 12 on one nvidia-h200 (2026-11-25): full depth. OLMoE-1B-7B (16 layers, 6.92B, 1.28B active) at
# 256 x 4096 tokens per step (its first run passed step 3 but hit the 200 s limit before writing its JSON), and
# Gemma-2-9B (42 layers, 9.24B, 256k vocabulary, soft-capped attention through FlexAttention) at 64 x 4096
# (262,144 tokens) per step, micro-batches of 8. `megatrain train`, no memory keys.
TAIL=8 run_logged olmoe_16l 280 python3 bench/bench_cli.py --model $M/olmoe-1b-7b --seq 4096 \
  --seqs 256 --micro 32 --compile --steps 2 --warmup 1 --label olmoe-1b-7b-256x4096-cli --workdir /tmp/cli_o \
  --json "$OUT/olmoe_16l.json"
rm -rf /tmp/cli_o
TAIL=8 run_logged gemma2_9b 290 python3 bench/bench_cli.py --model $M/gemma-2-9b --seq 4096 \
  --seqs 64 --micro 8 --compile --steps 2 --warmup 1 --label gemma-2-9b-64x4096-cli --workdir /tmp/cli_g \
  --json "$OUT/gemma2_9b.json"
