# Plan-accuracy diagnosis on one nvidia-h200 (written 2026-11-25 session 23), for issues 12 and 15:
#   1. bench/attention_kernels.py: SDPA flash against FlexAttention (plain, Gemma 2's soft-capping, gpt-oss's sinks
#      and its 128-token window) at the real families' shapes. Gemma-2-9B's full run planned 38.0 s and measured
#      49.6 s, busy 98.5% (bench/results/2026-11-25/h200-gptoss-gemma): the planner times every attention kernel at
#      flash's rate, and Gemma 2 runs FlexAttention.
#   2. `megatrain probe` with the Gemma-2-9B layer at 8 x 4096 compiled: the rate the planner would use for it.
#   3. Qwen2.5-7B, one 32,768-token row, clipping on, 1 warm-up + 3 measured steps: planned 5.8 s, the first
#      measured step 9.5 s with the GPU idle 54% (waiting for the CPU AdamW the plan gave 1.6 s): steady or not.
mkdir -p "$OUT"
TAIL=20 run_logged attention_kernels 200 python3 bench/attention_kernels.py --json "$OUT/attention_kernels.json"
TAIL=10 run_logged probe_gemma 240 python3 -m megatrain.planner.probe --out "$OUT/h200_probe_gemma.json" \
  --layer $M/gemma-2-9b:8x4096 --compile on
TAIL=8 run_logged qwen7b_32k_steady 240 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 32768 --seqs 1 \
  --micro 1 --compile --steps 3 --warmup 1 --label qwen2.5-7b-1x32768-steady --workdir /tmp/cli_q32s \
  --json "$OUT/qwen7b_32k_steady.json"
cp /tmp/cli_q32s/cli.log "$OUT/qwen7b_32k_steady_cli.log" 2>/dev/null
