# Pending (written 2026-11-24, not yet run): issue 11 rows on one nvidia-h100-x1, no memory keys unless named.
#   1. GPU checks of fp32 streaming (tests/gpu/test_stream_fp32_cuda.py: slots equal the bf16 copy bit for bit, the
#      tile cut into pieces; training follows bf16 streaming)
#   2. Llama-3.1-8B 64 x 4096 in micro-batches of 16 rows (the 390 TFLOP/s run used rows of 1): the planner picks
#      K = 2 with the top 24 layers kept and 3 wave groups, 28.7 s predicted with the H100 probe (441 TFLOP/s)
#   3. Llama-3.1-8B 16 x 4096, memory.gpu_budget_gb=22 on the H100's 125 GiB host: refused before fp32 streaming;
#      now planned with the fp32 master streamed (123.9 GiB of host, 9.1 s predicted with the H100 probe)
mkdir -p "$OUT/gpu"
TAIL=6 run_logged gpu_stream_fp32 150 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_stream_fp32_cuda.py -x
TAIL=8 run_logged llama8b_64x4096_m16 260 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 4096 --micro 16 \
  --compile --seqs 64 --steps 2 --warmup 1 --label llama-3.1-8b-64x4096-m16-cli --workdir /tmp/cli_64 \
  --json "$OUT/llama8b_64x4096_m16.json"
cp /tmp/cli_64/cli.log "$OUT/llama8b_64x4096_m16_cli.log" 2>/dev/null
