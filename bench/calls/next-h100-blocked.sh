# Issue 15 follow-up on one nvidia-h100-x1 (written 2026-11-25 session 24, not yet run; ~4 minutes). The attention
# blocked for its backward (memory.attn_block) calls the flash op, whose backward ran 1.66x SDPA's default on the
# H100 (bench/results/2026-11-25/h100-llama512k): the Llama-3.1-8B 512k step took 1,270 s where SDPA's rates give
# ~830 s. This measures which kernel to call instead, and re-runs the CUDA check with its corrected expectations:
#   1. tests/gpu/test_blockwise_cuda.py (exactness against float64; memory against the planner at 128k and 256k).
#   2. bench/blocked_attention.py: SDPA's backend choice, the forward of SDPA / the flash op / the cuDNN op alone, and
#      the blocked backward with the flash op (the engine's), with the cuDNN op per block pair, and with the cuDNN
#      forward's log-sum-exp fed to the flash pairs (each one's gradients against the engine's), at 131,072 and
#      262,144 tokens, blocks of 65,536.
MEGATRAIN_GPU_RESULTS=$OUT TAIL=12 run_logged gpu_blockwise 300 python3 -m pytest -q -m gpu -s tests/gpu/test_blockwise_cuda.py
TAIL=12 run_logged blocked_attention 300 python3 bench/blocked_attention.py --json "$OUT/blocked_attention.json"
