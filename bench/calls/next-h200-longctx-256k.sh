# Issue 15 on one nvidia-h200 (written 2026-11-25, not yet run): the CUDA checks of sequence tiling, then Qwen2.5-7B
# at 262,144 tokens, one sequence per step, `megatrain train` through bench_cli.py, compiled, no memory keys, one
# warm-up step and one measured.
#   1. tests/gpu/test_tiling_cuda.py: a Llama-3.1-8B-shaped layer at 65,536 tokens, tiles of 8,192 — tiled equals
#      whole at bf16's rounding (eager and compiled); its recompute + backward peak against the planner's
#      (planner.activations.layer_memory: 4.52 GiB tiled, 16.37 GiB whole) within 10%; a 12-layer step with
#      memory.seq_tile=512 equals the untiled one within 1e-5 in fp32. JSON into $OUT/gpu.
#   2. Qwen2.5-7B 262,144 tokens (plan, default H200 profile, session 22: the layer over 8,192-token tiles, the top
#      17 layers keeping their attention: 130.4 s/step, GPU peak 101.6 GiB allocated, 137.7 GiB needed of 139.3,
#      host 106.0 GiB; a close fit: if the GPU has less free the run is refused before loading weights).
mkdir -p "$OUT/gpu"
TAIL=6 run_logged gpu_tiling 110 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_tiling_cuda.py -x
TAIL=8 run_logged qwen7b_256k 420 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 262144 --seqs 1 --micro 1 \
  --compile --steps 1 --warmup 1 --label qwen2.5-7b-1x262144-cli --workdir /tmp/cli_q256 \
  --json "$OUT/qwen7b_256k.json"
cp /tmp/cli_q256/cli.log "$OUT/qwen7b_256k_cli.log" 2>/dev/null
rm -rf /tmp/cli_q256
