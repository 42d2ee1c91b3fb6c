# Issue 12 on one nvidia-h200 (2026-11-25): Mixtral-8x7B at real width truncated to 4 layers (6.07B parameters,
# 1.84B active) and OLMoE-1B-7B at full depth (16 layers, 6.92B, 1.28B active), 256 x 4096 = 1,048,576 tokens per
# step, `megatrain train`, no memory keys; the window/gemma GPU check again for its JSON (lost in the first call).
mkdir -p "$OUT/gpu"
TAIL=4 run_logged gpu_window 120 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_window_cuda.py -k long_row
TAIL=10 run_logged mixtral_4l 250 python3 bench/bench_cli.py --model $M/mixtral-8x7b --layers 4 --seq 4096 \
  --seqs 256 --micro 8 --compile --steps 2 --warmup 1 --label mixtral-8x7b-4l-256x4096-cli --workdir /tmp/cli_m \
  --json "$OUT/mixtral_4l.json"
cp /tmp/cli_m/cli.log "$OUT/mixtral_4l_cli.log" 2>/dev/null
rm -rf /tmp/cli_m
TAIL=10 run_logged olmoe_16l 200 python3 bench/bench_cli.py --model $M/olmoe-1b-7b --seq 4096 \
  --seqs 256 --micro 32 --compile --steps 2 --warmup 1 --label olmoe-1b-7b-256x4096-cli --workdir /tmp/cli_o \
  --json "$OUT/olmoe_16l.json"
cp /tmp/cli_o/cli.log "$OUT/olmoe_16l_cli.log" 2>/dev/null
