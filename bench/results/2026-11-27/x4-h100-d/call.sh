# Written 2026-11-27 (session 28), for an nvidia-h200-x4 (or nvidia-h100-x4: name the kind that came), after
# next-x4-b.sh (run in session 29: results/2026-11-27/x4-h100-c), in ONE detached chain (~25 min: issue it, then again at once on the warm machine, until status.txt
# has "chain rc="; give it WAIT_S=<device time left - 60> on the last call so the results come back):
#   1. issue 14: Qwen2.5-32B on one GPU, 158 x 1024 per step, the planner's placement (2 warm-up, 2 measured steps;
#      its plan.json kept), under memory.host_budget_gb=480: at 500 the H100 plan (K = 2, 40 layers kept on top, 42
#      spilled, 46 units' gradients to host, fp32 streaming, tiles of 8192: 73.6 s) needs 499.9 GiB, on a host with
#      ~500 GiB free; at 480 (session 28, the H100 profile of results/2026-11-23/bounded-h100-2): K = 2, 21 spilled,
#      46 units' gradients to host, fp32 streaming, tiles of 8192: 78.9 s, 470.5 GiB, GPU 79.1 of 79.2 GiB needed;
#      on an H200 (the 2026-11-21 profile): every input kept, 17 spilled, 25 units' gradients to host: 67.5 s, 441.7
#      GiB. At 450 it does not fit an H100: the finished gradients waiting for the norm (4 B/param) fit neither.
#      x4-h100-b's Qwen2.5-7B spent ~150 s before its first step and 68 s in it (compiling); the 14B 165-195 s
#      and 123 s: the 32B's timeout is 1200 s (the start-up's phases are now in the log and the JSON: startup_s).
#   2. issue 11, on H200s only (an H100 has 80 GB: the row is an H200 held to an H100's memory):
#      Qwen2.5-14B under memory.gpu_budget_gb=80 with memory.host_budget_gb=249 (the x2 host's memory;
#      next-x2-h200.sh's comment): target <= 31 s, plan 29.34 s. Skip it if next-x2-h200.sh has measured it.
# Session 30: memory.gpu_budget_gb=76 for the 32B. With the whole H100 (79.1 GiB) the planner's placement needs 78.68
# GiB (allocator reserve included; the 14B's reserved memory reached 76.3 GiB of 79.2 in x4-h100-c), a 0.4 GiB
# margin that an out-of-memory would turn into a lost session; at 76 (H100 profile) it plans the same 78.9 s with
# 73.9 GiB needed and 477.3 GiB of host. 2 warm-up steps (the second step was 25% slow on the 14B and the 7B).
S=/tmp/xc
if ! detached_started chain; then
  mkdir -p $S
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
export CUDA_VISIBLE_DEVICES=0
run_in $S qwen32b 1200 python3 bench/bench_cli.py --model $M/qwen2.5-32b --seq 1024 --seqs 158 --micro 79 --compile \\
  --steps 2 --warmup 2 --host-budget-gb 480 --set memory.gpu_budget_gb=76 --label qwen2.5-32b-158x1024-x4 \\
  --workdir $S/w32 --json $S/qwen32b.json
cp $S/w32/cli.log $S/qwen32b_cli.log 2>/dev/null; cp $S/w32/run/plan.json $S/qwen32b_plan.json 2>/dev/null
rm -rf $S/w32
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
  run_in $S qwen14b_80g 600 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 --compile \\
    --seqs 158 --steps 2 --warmup 2 --set memory.gpu_budget_gb=80 --set memory.host_budget_gb=249 \\
    --label qwen2.5-14b-158x1024-budget80-cli --workdir $S/w14 --json $S/qwen14b_80g.json
  cp $S/w14/cli.log $S/qwen14b_80g_cli.log 2>/dev/null; rm -rf $S/w14
else
  echo "qwen14b_80g: not run (H100s: issue 11's row is an H200 held to 80 GiB)"
fi
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
