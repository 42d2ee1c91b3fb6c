# Issue 11, one nvidia-h200: the depth sweep with no memory keys. Width 2048 (bench/model-configs/llama-2048-shape),
# 16 / 32 / 64 / 128 layers, 64 x 2048 = 131,072 tokens per step (4 micro-batches of 16), compiled layers, the
# planner's placement from the free GPU and host memory (--auto), as `megatrain train` runs it. Then the GPU checks
# of the placements (tests/gpu/test_placement_cuda.py: every placement on CUDA, incl. keep_top_layers, equals the
# default).
for L in 16 32 64 128; do
  TAIL=2 run_logged depth_$L 150 python3 bench/bench_megatrain.py --model $M/llama-2048-shape --layers $L \
    --seq 2048 --seqs 64 --micro 16 --steps 2 --warmup 1 --compile --auto --label depth-$L-131k-auto \
    --json "$OUT/depth_$L.json"
done
mkdir -p "$OUT/gpu"
TAIL=4 run_logged gpu_placements 120 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_placement_cuda.py -x
