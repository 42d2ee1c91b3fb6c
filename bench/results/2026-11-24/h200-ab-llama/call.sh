# Issue 11, one nvidia-h200: the no-slower check for Llama-3.1-8B 64 x 4096 (micro-batches of 16) on one GPU: the
# code before issue 11 (08c1e71, carried as oldrev/) and this revision, one warm-up and one measured step each (the
# session's device time left allows no more).
L="--model $M/llama-3.1-8b --seq 4096 --seqs 64 --micro 16 --steps 1 --warmup 1 --compile"
TAIL=3 run_logged llama8b_before 165 bash -c "cd oldrev && MEGATRAIN_REV=08c1e71 python3 bench/bench_megatrain.py $L \
  --label llama-3.1-8b-before-08c1e71 --json $OUT/llama8b_before.json"
TAIL=3 run_logged llama8b_after 165 python3 bench/bench_megatrain.py $L --auto --label llama-3.1-8b-after-auto \
  --json "$OUT/llama8b_after.json"
