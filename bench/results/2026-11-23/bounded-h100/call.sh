# Issue 11 (GPU memory bounded), one H100 80 GB (128 GiB host), no memory keys set unless the row says so:
#   1. GPU checks: every placement on CUDA equals the default (spill streams, accumulators parked in host memory,
#      in the gradients' own host buffers), and the default's numerics (tests/gpu)
#   2. Llama-3.1-8B, 64 x 4096 tokens per step, `megatrain train` (out of memory before this issue)
#   3. Llama-3.1-8B, 16 x 4096 tokens per step, memory.gpu_budget_gb=22 (did not fit any batch before)
# Each `megatrain train` run prints the plan's placement and why (cli.log), and the step, GPU peak and reserved.
mkdir -p "$OUT/gpu"
TAIL=12 run_logged gpu_tests 170 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu tests/gpu -x
L="--model $M/llama-3.1-8b --seq 4096 --micro 1 --compile"
TAIL=8 run_logged llama8b_64x4096 250 python3 bench/bench_cli.py $L --seqs 64 --steps 2 --warmup 1 \
  --label llama-3.1-8b-64x4096-cli --workdir /tmp/cli_64 --json "$OUT/llama8b_64x4096.json"
cp /tmp/cli_64/cli.log "$OUT/llama8b_64x4096_cli.log" 2>/dev/null
TAIL=8 run_logged llama8b_16x4096_22g 150 python3 bench/bench_cli.py $L --seqs 16 --steps 2 --warmup 1 \
  --set memory.gpu_budget_gb=22 --label llama-3.1-8b-16x4096-budget22-cli --workdir /tmp/cli_16 \
  --json "$OUT/llama8b_16x4096_22g.json"
cp /tmp/cli_16/cli.log "$OUT/llama8b_16x4096_22g_cli.log" 2>/dev/null
