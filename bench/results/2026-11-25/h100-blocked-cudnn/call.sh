# Issue 15 on one nvidia-h100-x1 (written 2026-11-25 session 25; ~3 minutes): the blocked attention's switch to the
# kernels SDPA picks (cuDNN's on Hopper), measured on the H200 (h200-rss-diag, h200-1m-blocked), checked on the
# 80 GB H100 where the 512k row needs it: the CUDA check (exactness against float64, memory against the planner,
# time against SDPA at 128k and 256k) and bench/blocked_attention.py (every kernel variant) at 131,072 and 262,144.
MEGATRAIN_GPU_RESULTS=$OUT TAIL=12 run_logged gpu_blockwise 150 python3 -m pytest -q -m gpu -s \
  tests/gpu/test_blockwise_cuda.py
TAIL=6 run_logged blocked_attention 200 python3 bench/blocked_attention.py --json "$OUT/blocked_attention.json"
