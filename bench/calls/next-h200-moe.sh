# Issue 12 on one nvidia-h200 (written 2026-11-25): the GPU checks of the new families, then the first MoE run.
#   1. tests/gpu/test_window_cuda.py (sliding windows through FlexAttention; gemma2/gemma3 CUDA vs CPU, bf16
#      compiled training) and tests/gpu/test_moe_cuda.py (fp32 CUDA vs CPU with the router loss; grouped vs
#      looped experts in bf16 with no host sync; grouped expert fwd+bwd rates at three real expert shapes)
#   2. Qwen3-30B-A3B at real width truncated to 8 layers (5.6B parameters, 1.08B active; the 128 GiB host holds
#      8 of 48), 256 x 4096 = 1,048,576 tokens per step, micro-batches of 16, `megatrain train`, no memory keys;
#      planned 14.97 s (453 TFLOP/s by 6·N_active) with the default rates
mkdir -p "$OUT/gpu"
TAIL=12 run_logged gpu_checks 230 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_window_cuda.py tests/gpu/test_moe_cuda.py
TAIL=10 run_logged qwen3moe_8l 330 python3 bench/bench_cli.py --model $M/qwen3-30b-a3b --layers 8 --seq 4096 \
  --seqs 256 --micro 16 --compile --steps 2 --warmup 1 --label qwen3-30b-a3b-8l-256x4096-cli --workdir /tmp/cli_q \
  --json "$OUT/qwen3moe_8l.json"
cp /tmp/cli_q/cli.log "$OUT/qwen3moe_8l_cli.log" 2>/dev/null
