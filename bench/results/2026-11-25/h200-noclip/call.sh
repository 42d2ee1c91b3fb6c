# Issue 16 item 2 on one nvidia-h200 (2026-11-25, revision 9862936, run right after h200-gptoss/ on the same machine): an optimizer that has the whole step. Llama-3.1-8B, one 32,768-token sequence
# per step (the issue's row: GPU idle 25% today, target <= 8%), `megatrain train` through bench/bench_cli.py, the same
# call twice, compiled, 1 warm-up + 3 measured steps, no memory keys (the plan keeps the default placement):
#   1. default clipping (train.max_grad_norm 1.0): the updates wait for the step's global norm, then overlap the
#      next step's first forward wave;
#   2. --set train.max_grad_norm=null: each unit's update starts as soon as its gradient is complete, during the
#      same step's backward (head, last layer, ..., embedding); the next forward waits only for units not updated.
# The plan (H200 profile bench/results/2026-11-21/h200_profile.json, `megatrain plan`, compiled):
#   clipping     6.79 s a step, GPU idle 1.78 s (26%): the GPU waits 1.75 s for CPU AdamW (2.85 s at 0.62 of the
#                probe's rate; the first forward wave it may hide in is 1.35 s), 4,829 tokens/s, 233 TFLOP/s (6N);
#                bound: GPU compute (the wait falls before the middle of the step)
#   no clipping  5.30 s a step, GPU idle 0.30 s (5.6%): the GPU waits 0.27 s (the embedding's gradient, complete
#                last, copied out and updated after the backward), 6,184 tokens/s, 298 TFLOP/s (6N); the updates
#                run within 3.65 s of backward; bound: GPU compute
# Read from each JSON: gpu_idle (1 - the compute stream's busy share; target <= 0.08 without clipping), step_s and
# tokens_per_s (each within ~10% of the plan), busy_d2h, gpu_peak_gib (plan: 38.2 GiB allocated with clipping, of
# which 27.2 GiB finished gradients waiting for the norm; 21.3 GiB without, at most 2 gradients, 2.8 GiB, waiting),
# host_peak_rss_gib; grad_norm per step in "steps" (logged in both runs).
# About 2.5 minutes per run (random init of 8B, compile, 4 steps). WITH_GPU_TEST=1 also runs the CUDA checks of the
# no-clip worker (tests/gpu/test_noclip_cuda.py: bit-exact replay of the handed gradients, ~2 minutes more).
L="--model $M/llama-3.1-8b --seq 32768 --seqs 1 --micro 1 --compile --steps 3 --warmup 1"
TAIL=10 run_logged llama8b_32k_clip 200 python3 bench/bench_cli.py $L --label llama-3.1-8b-1x32768-clip \
  --workdir /tmp/cli_clip --json "$OUT/llama8b_32k_clip.json"
cp /tmp/cli_clip/cli.log "$OUT/llama8b_32k_clip_cli.log" 2>/dev/null
rm -rf /tmp/cli_clip
TAIL=10 run_logged llama8b_32k_noclip 200 python3 bench/bench_cli.py $L --set train.max_grad_norm=null \
  --label llama-3.1-8b-1x32768-noclip --workdir /tmp/cli_noclip --json "$OUT/llama8b_32k_noclip.json"
cp /tmp/cli_noclip/cli.log "$OUT/llama8b_32k_noclip_cli.log" 2>/dev/null
rm -rf /tmp/cli_noclip
if [ "${WITH_GPU_TEST:-0}" = 1 ]; then
  MEGATRAIN_GPU_RESULTS="$OUT" TAIL=12 run_logged gpu_noclip 180 python3 -m pytest -q -m gpu \
    tests/gpu/test_noclip_cuda.py
fi
