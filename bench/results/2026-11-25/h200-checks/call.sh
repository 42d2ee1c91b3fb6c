# Issues 12, 15, 16 on one nvidia-h200 (2026-11-25, session 21, second call): CUDA checks, and a diagnosis.
#   1. tests/gpu/test_tiling_cuda.py: a Llama-3.1-8B-shaped layer at 65,536 tokens, tiles of 8,192, equals the whole
#      layer at bf16's rounding (eager and compiled); its recompute + backward peak is the planner's within 10%
#      (4.52 GiB tiled, 16.37 whole); a 12-layer step with memory.seq_tile=512 equals the untiled one within 1e-5 fp32.
#   2. tests/gpu/test_noclip_cuda.py: without clipping, updates during backward are exactly CpuAdamW on the handed
#      gradients, and training equals clipping at a norm no step reaches, with fewer gradients held on the GPU.
#   3. bench/moe_forward_diag.py: the gpt-oss-120b layer's compiled no-grad forward was probed at 117 TFLOP/s against
#      376 for its recompute + backward (first call today); time it compiled/eager x grad/no-grad and list its top
#      kernels; the same for a Qwen3-30B-A3B layer (16 x 4096, its run's micro-batch) for comparison.
mkdir -p "$OUT/gpu"
TAIL=6 run_logged gpu_tiling 130 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_tiling_cuda.py
TAIL=6 run_logged gpu_noclip 130 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_noclip_cuda.py
TAIL=20 run_logged diag_gptoss 130 python3 bench/moe_forward_diag.py $M/gpt-oss-120b:16x4096 \
  --json "$OUT/diag_gptoss.json"
TAIL=20 run_logged diag_qwen3moe 100 python3 bench/moe_forward_diag.py $M/qwen3-30b-a3b:16x4096 \
  --json "$OUT/diag_qwen3moe.json"
