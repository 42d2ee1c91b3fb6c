# Issue 11, one nvidia-h200: the no-slower check on one GPU. The first regression call (h200-regression/) measured
# Qwen2.5-7B 15.12 s and Llama-3.1-8B 27.77 s on a different H200 from the committed 14.81 s / 27.06 s, GPU busy 98%
# in both: the code before issue 11 (08c1e71, carried as oldrev/) and this revision, Qwen2.5-7B 158 x 1024, in the
# same call, then Llama-3.1-405B truncated to 1 layer at 524,288 tokens per step (its first try stopped on cuBLAS
# dot's int32 length: a 3.2e9-element layer gradient; the norm is now summed in chunks).
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 3 --warmup 2 --compile"
TAIL=3 run_logged qwen7b_before 160 bash -c "cd oldrev && MEGATRAIN_REV=08c1e71 python3 bench/bench_megatrain.py $Q \
  --label qwen2.5-7b-before-08c1e71 --json $OUT/qwen7b_before.json"
TAIL=3 run_logged qwen7b_after 160 python3 bench/bench_megatrain.py $Q --auto --label qwen2.5-7b-after-auto \
  --json "$OUT/qwen7b_after.json"
B="--seq 4096 --seqs 128 --micro 8 --steps 1 --warmup 1 --compile --auto"
TAIL=4 run_logged llama405b_1l 265 python3 bench/bench_megatrain.py --model $M/llama-3.1-405b --layers 1 $B \
  --label llama-3.1-405b-1layer-524k-auto --json "$OUT/llama405b_1l.json"
