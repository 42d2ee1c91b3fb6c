# Issue 12 on one nvidia-h200 (written 2026-11-25 session 25; ~5 minutes): where the gpt-oss-120b 2-layer step's
# GPU idle goes (h200-gptoss-gemma: 17.0 s a step, 27.7% idle, of which only 0.86 s the forward waiting for the
# optimizer; the host thread spent 16.2 s queueing the step). bench_megatrain.py, the runtime as the trainer builds
# it, the planner's placement (--auto), compiled, 256 x 4096 in micro-batches of 16, one warm-up and two measured
# steps, each step's 10 longest idle stretches of the compute stream with the slot uses before and after them
# (--gaps: runtime/timeline.idle_gaps over the engine's labelled spans).
TAIL=30 run_logged gptoss_gaps 420 python3 bench/bench_megatrain.py --model $M/gpt-oss-120b --layers 2 --seq 4096 \
  --seqs 256 --micro 16 --compile --auto --steps 2 --warmup 1 --gaps 10 --label gpt-oss-120b-2l-gaps \
  --json "$OUT/gptoss_gaps.json"
