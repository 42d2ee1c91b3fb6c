# Issue 12 on one nvidia-h200 (2026-11-25, session 21, fifth call):
#   1. `megatrain probe` with one gpt-oss-120b layer at 16 x 4096, compiled: the first probe today (forward 117
#      TFLOP/s) ran FlexAttention uncompiled (fixed at 70eb031; the diagnosis then timed the forward at 38.6 ms);
#      this profile validates the full gpt-oss-120b plan against the 2-layer run.
#   2. tests/gpu/test_gpt_oss_cuda.py, tests/gpu/test_moe_cuda.py (ran out of 120 s in the fourth call), and the
#      fp32 tiling check at 8,192 tokens.
#   3. OLMoE-1B-7B at full depth (16 layers, 6.92B, 1.28B active), 256 x 4096 per step, micro-batches of 32,
#      `megatrain train`, compiled, no memory keys; 1 warm-up + 1 measured step (plan 25.2 s/step; the first step
#      took 57 s with compiling in the fourth call).
mkdir -p "$OUT/gpu"
TAIL=4 run_logged probe_gptoss 100 python3 -m megatrain.cli probe --out "$OUT/h200_gptoss_profile.json" \
  --layer $M/gpt-oss-120b:16x4096 --compile on
TAIL=6 run_logged gpu_checks 200 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_gpt_oss_cuda.py tests/gpu/test_moe_cuda.py tests/gpu/test_tiling_cuda.py -k "not memory and not step"
TAIL=8 run_logged olmoe_16l 240 python3 bench/bench_cli.py --model $M/olmoe-1b-7b --seq 4096 \
  --seqs 256 --micro 32 --compile --steps 1 --warmup 1 --label olmoe-1b-7b-256x4096-cli --workdir /tmp/cli_o \
  --json "$OUT/olmoe_16l.json"
