# Written 2026-11-27 (session 27), for an nvidia-h200-x4 (or nvidia-h100-x4: name the kind that came), after
# next-x4-a.sh, in ONE detached chain (~20 min: issue it, then again at once on the warm machine, until status.txt
# has "chain rc="):
#   1. issue 14: Qwen2.5-32B on one GPU, 158 x 1024 per step, the planner's placement (1 warm-up, 2 measured steps;
#      its plan.json kept). Plans with memory.host_budget_gb=500: on an H200 fp32 streaming, spill 17, 25 units'
#      gradients to host, tiles of 8192: 65.5 s, 441.7 GiB; on an H100 (80 GB) K = 2, 40 layers kept on top, 42
#      spilled, 46 units' gradients to host, fp32 streaming, tiles of 8192: 73.6 s, 499.9 GiB (at the limit: it
#      may not fit where less than 500 GiB is free). On 2026-11-27 (x4-h100) it never ran: a timed-out 14B run
#      still held 62 GiB of its GPU, saving a checkpoint on SIGTERM (bench_cli now SIGKILLs the run).
#   2. issue 13: tests/gpu/test_distributed_cuda.py on GPUs 0,1 (next-x2-dist-tests.sh's comment says what).
#   3. issue 11: Qwen2.5-14B under memory.gpu_budget_gb=80 with memory.host_budget_gb=249 (the x2 host's memory;
#      next-x2.sh's comment): on an H200, target <= 31 s, plan 29.34 s.
S=/tmp/xb
if ! detached_started chain; then
  mkdir -p $S
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
export CUDA_VISIBLE_DEVICES=0
run_in $S qwen32b 720 python3 bench/bench_cli.py --model $M/qwen2.5-32b --seq 1024 --seqs 158 --micro 79 --compile \\
  --steps 2 --warmup 1 --host-budget-gb 500 --label qwen2.5-32b-158x1024-x4 --workdir $S/w32 --json $S/qwen32b.json
cp $S/w32/cli.log $S/qwen32b_cli.log 2>/dev/null; cp $S/w32/run/plan.json $S/qwen32b_plan.json 2>/dev/null
rm -rf $S/w32
CUDA_VISIBLE_DEVICES=0,1 MEGATRAIN_GPU_RESULTS=$S run_in $S gpu_distributed 480 python3 -m pytest -q -m gpu \\
  -p no:cacheprovider tests/gpu/test_distributed_cuda.py
run_in $S qwen14b_80g 400 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 --compile \\
  --seqs 158 --steps 2 --warmup 1 --set memory.gpu_budget_gb=80 --set memory.host_budget_gb=249 \\
  --label qwen2.5-14b-158x1024-budget80-cli --workdir $S/w14 --json $S/qwen14b_80g.json
cp $S/w14/cli.log $S/qwen14b_80g_cli.log 2>/dev/null; rm -rf $S/w14
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
