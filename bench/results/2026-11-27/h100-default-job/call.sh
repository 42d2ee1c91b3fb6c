# Written 2026-11-27 (session 32), for an nvidia-h100-x1 (~4 min): the README's main job (`megatrain train`, the
# embedded default: a 0.8M-parameter Llama learns to reverse words, with evaluations) on a GPU from a clean tree,
# with engine.tune_first at its new default (auto: on, compiled on CUDA in one process) and with it off, each with a
# cold Inductor cache of its own. What it shows: the copy compiles the step's and the evaluations' shapes on a GPU,
# the run then trains and evaluates as the run without it does (loss, held-out exact match), the start summary.
for mode in auto off; do
  run_logged default_$mode 280 env TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$mode python3 -m megatrain train \
    megatrain/defaults/default.yaml engine.tune_first=$mode output.dir=/tmp/default-$mode
  cp /tmp/default-$mode/metrics.jsonl "$OUT/default_${mode}_metrics.jsonl" 2>/dev/null
done
for mode in auto off; do
  echo "== $mode: $(grep -m1 'start-up' $OUT/default_$mode.log)"
  grep -E "^done|exact_match" $OUT/default_$mode.log | tail -2
done
