# Issue 12 on one nvidia-h200 (2026-11-25, session 21, fourth call), at 70eb031: FlexAttention's compiled wrapper made
# outside tracing only; MoE dispatch/combine by gathers through the inverse permutation (no index_add).
#   1. tests/gpu/test_gpt_oss_cuda.py and tests/gpu/test_moe_cuda.py: fp32 CUDA equals CPU, sinks via FlexAttention
#      LSE, no T x T tensor at 32k (failed twice before: FlexAttention ran uncompiled), grouped experts equal the loop
#      in bf16 and never sync the host, with the new combine.
#   2. tests/gpu/test_tiling_cuda.py -k "bf16 or fp32": eager tiles in bf16; eager and compiled tiles in fp32 within 1e-5.
#   3. bench/moe_forward_diag.py for gpt-oss-120b and Qwen3-30B-A3B layers at 16 x 4096 (Qwen3 before: 27.9 ms
#      compiled forward, 9.0 ms of it index_add).
#   4. OLMoE-1B-7B at full depth (16 layers, 6.92B, 1.28B active), 256 x 4096 tokens per step, micro-batches of 32,
#      `megatrain train`, compiled, no memory keys, 1 warm-up + 1 measured step.
mkdir -p "$OUT/gpu"
TAIL=4 run_logged gpu_gptoss 120 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_gpt_oss_cuda.py tests/gpu/test_moe_cuda.py
TAIL=4 run_logged gpu_tiling 100 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_tiling_cuda.py -k "bf16 or fp32"
TAIL=16 run_logged diag_gptoss 100 python3 bench/moe_forward_diag.py $M/gpt-oss-120b:16x4096 \
  --json "$OUT/diag_gptoss.json"
TAIL=16 run_logged diag_qwen3moe 80 python3 bench/moe_forward_diag.py $M/qwen3-30b-a3b:16x4096
TAIL=8 run_logged olmoe_16l 180 python3 bench/bench_cli.py --model $M/olmoe-1b-7b --seq 4096 \
  --seqs 256 --micro 32 --compile --steps 1 --warmup 1 --label olmoe-1b-7b-256x4096-cli --workdir /tmp/cli_o \
  --json "$OUT/olmoe_16l.json"
