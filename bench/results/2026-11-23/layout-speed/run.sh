# Issue 10 (layout), second call: is the GPU path as fast as before the move, and is the CLI within 2% of the
# benchmark? All on one H200, Qwen2.5-7B, 158 x 1024 tokens per step (2 micro-batches of 79, compiled layers),
# 2 warm-up steps (compilation; the optimizer's first pass) and 2 measured steps each:
#   1. the code before the move (457726e, carried as oldrev/), bench_megatrain.py
#   2. this revision's bench_megatrain.py
#   3. this revision's `megatrain train` (bench_cli.py)
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 2 --compile"
run_logged qwen7b_before 180 bash -c "cd oldrev && MEGATRAIN_REV=457726e python3 bench/bench_megatrain.py $Q \
  --label qwen2.5-7b-before-457726e --json $OUT/qwen7b_before.json"
run_logged qwen7b_bench 180 python3 bench/bench_megatrain.py $Q --label qwen2.5-7b-bench --json "$OUT/qwen7b_bench.json"
run_logged qwen7b_cli 220 python3 bench/bench_cli.py $Q --label qwen2.5-7b-cli --workdir /tmp/bench_cli_qwen7b \
  --json "$OUT/qwen7b_cli.json"
