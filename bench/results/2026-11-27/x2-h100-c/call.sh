# Written 2026-11-27 (session 31), for an nvidia-h200-x2 (2 H200s, ~251 GiB host; it came as 2 H100s in sessions 30
# and 31: results/2026-11-27/x2-h100, x2-h100-b; name the kind that came), in ONE detached chain (~20 min on H100s,
# ~26 on H200s: issue it, then again at once on the warm machine, until status.txt has "chain rc="; give the last
# call WAIT_S=<device time left - 60> so that the results come back). Most needed first:
#   1. issue 11, on an H200 only (the row is an H200 held to an H100's memory): Qwen2.5-14B 158 x 1024 under
#      memory.gpu_budget_gb=80 with memory.host_budget_gb=249. Plan (default profile, session 29): 29.34 s, host
#      224.4 GiB, GPU 51.1 GiB allocated. Target <= 31 s. 2 warm-up steps, 2 measured.
#   2. the CPU AdamW's threads on this 32-vCPU host: Qwen2.5-7B 158 x 1024 on one GPU. In session 30, with all 32
#      threads, the GPU was 65-77% busy (19.5 s a step, planned 14.8); session 31's start-up (x2-h100-b) chose 16 of
#      16 / 24 (2.56 / 2.36 Gparam/s) and planned 15.83 s, but the device time ran out before its first step.
#      Target: GPU busy >= 0.9, the step within 10% of the plan.
#   3. issue 16's fp32-streaming host row on a cold compile cache (12.88 B/param on an H200 in session 25, 12.30
#      warm; the target is <= 12.3): Qwen2.5-7B 158 x 1024, memory.stream_dtype=fp32, with engine.tune_first=true
#      and without, each with an Inductor cache folder of its own (cold); then bench/autotune_copies.py at the 7B's
#      width (2 layers, modes cold and two-engines): where the autotuner's copies go.
#      Target: host peak <= 12.3 B/param with tune_first, and no slower steps.
# Issue 16's SSD run is done (x2-h100-b: 181.4 s against a plan of 171.5 made at start, -5.4%).
# The 7B runs come after the 14B, each in a fresh Inductor cache where it matters (TORCHINDUCTOR_CACHE_DIR).
S=/tmp/xh
if ! detached_started chain; then
  mkdir -p $S
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
export CUDA_VISIBLE_DEVICES=0
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
  run_in $S qwen14b_80g 600 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --seqs 158 --micro 79 \\
    --compile --steps 2 --warmup 2 --set memory.gpu_budget_gb=80 --set memory.host_budget_gb=249 \\
    --label qwen2.5-14b-158x1024-budget80-cli --workdir $S/w14 --json $S/qwen14b_80g.json
  cp $S/w14/cli.log $S/qwen14b_80g_cli.log 2>/dev/null; rm -rf $S/w14
else
  echo "qwen14b_80g: not run (not an H200: issue 11's row is an H200 held to 80 GiB)"
fi
Q7="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 2 --compile --set memory.stream_dtype=fp32"
run_in $S qwen7b_fp32_tuned 450 env TORCHINDUCTOR_CACHE_DIR=$S/ind-tuned python3 bench/bench_cli.py \$Q7 \\
  --set engine.tune_first=true --label qwen2.5-7b-fp32-tune-first --workdir $S/wt --json $S/qwen7b_fp32_tuned.json
cp $S/wt/cli.log $S/qwen7b_fp32_tuned_cli.log 2>/dev/null; rm -rf $S/wt
run_in $S qwen7b_fp32_cold 450 env TORCHINDUCTOR_CACHE_DIR=$S/ind-cold python3 bench/bench_cli.py \$Q7 \\
  --label qwen2.5-7b-fp32-cold --workdir $S/wc --json $S/qwen7b_fp32_cold.json
cp $S/wc/cli.log $S/qwen7b_fp32_cold_cli.log 2>/dev/null; rm -rf $S/wc
run_in $S autotune_copies 420 python3 bench/autotune_copies.py --model $M/qwen2.5-7b --layers 2 --seq 1024 \\
  --micro 79 --modes cold two-engines --json $S/autotune_copies.json
run_in $S qwen7b_1gpu 450 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 \\
  --steps 2 --warmup 2 --compile --label qwen2.5-7b-158x1024-1gpu-threads --workdir $S/w7 --json $S/qwen7b_1gpu.json
cp $S/w7/cli.log $S/qwen7b_1gpu_cli.log 2>/dev/null; rm -rf $S/w7
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
