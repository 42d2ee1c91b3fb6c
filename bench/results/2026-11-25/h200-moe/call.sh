# Issue 12 on one nvidia-h200 (2026-11-25): the GPU checks of the new families, then Qwen3-30B-A3B at its issue's
# size.
#   1. tests/gpu/test_window_cuda.py (sliding windows through FlexAttention; gemma2/gemma3 CUDA vs CPU, bf16
#      compiled training) and tests/gpu/test_moe_cuda.py (fp32 CUDA vs CPU with the router loss; grouped vs
#      looped experts in bf16 with no host sync; grouped expert fwd+bwd rates at three real expert shapes)
#   2. Qwen3-30B-A3B at real width truncated to 12 layers (7.6B parameters, 1.3B active), 256 x 4096 = 1,048,576
#      tokens per step, micro-batches of 16, `megatrain train`, no memory keys; planned 22.8 s (360 TFLOP/s by
#      6·N_active) with the default H200 rates, 97.7 GiB GPU, 111 GiB host
mkdir -p "$OUT/gpu"
TAIL=12 run_logged gpu_checks 200 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_window_cuda.py tests/gpu/test_moe_cuda.py
TAIL=10 run_logged qwen3moe_12l 330 python3 bench/bench_cli.py --model $M/qwen3-30b-a3b --layers 12 --seq 4096 \
  --seqs 256 --micro 16 --compile --steps 2 --warmup 1 --label qwen3-30b-a3b-12l-256x4096-cli --workdir /tmp/cli_q \
  --json "$OUT/qwen3moe_12l.json"
cp /tmp/cli_q/cli.log "$OUT/qwen3moe_12l_cli.log" 2>/dev/null
