# Pending (written 2026-11-25, not yet run), issue 13: the distributed GPU tests on an nvidia-h200-x2 (two GPUs).
# tests/gpu/test_distributed_cuda.py:
#   - the shard pipeline's CUDA path (landing buffers, the copy stream) for a rank with empty shards: every Adam step
#     advances, the shard's update equals the CPU update within 1e-6, nothing outside the shard changes;
#   - torchrun --nproc-per-node=2 (NCCL reduce-scatter, the comm stream, the shared pinned store), fp32: losses and
#     parameters equal one GPU with the same global batch within 1e-6 relative (expected: ~1e-7, as gloo on CPU);
#   - kill -9 of rank 1: rank 0, waiting in NCCL (which never fails on a dead peer), is ended by the watchdog within
#     60 s, naming rank 1 (expected: 1-3 s).
# MEGATRAIN_GPU_RESULTS writes $OUT/distributed_cuda.json with the measured differences and the exit time.
TAIL=15 run_logged gpu_distributed 480 env MEGATRAIN_GPU_RESULTS="$OUT" python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_distributed_cuda.py
