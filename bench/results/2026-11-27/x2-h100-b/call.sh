# Written 2026-11-27 (session 30), for an nvidia-h200-x2 (2 H200s, ~251 GiB host; it came as 2 H100s in session 30:
# results/2026-11-27/x2-h100; name the kind that came), in ONE detached chain (~15 min on H100s, ~20 on H200s: issue
# it, then again at once on the warm machine, until status.txt has "chain rc="; give the last call
# WAIT_S=<device time left - 60> so that the results come back). Most needed first:
#   1. issue 11, on an H200 only (the row is an H200 held to an H100's memory): Qwen2.5-14B 158 x 1024 under
#      memory.gpu_budget_gb=80 with memory.host_budget_gb=249. Plan (default profile, session 29): 29.34 s, host
#      224.4 GiB, GPU 51.1 GiB allocated. Target <= 31 s. 2 warm-up steps, 2 measured.
#   2. issue 16: the SSD tier, Qwen2.5-14B in memory.host_budget_gb=128, memory.disk_path=/var/tmp. In session 30 the
#      steady steps took 168.9 s (plan 161.1, made with 2 GiB measured at start) and 154.7 s (plan 210.5: that
#      2-GiB measurement caught the disk at 1.38 / 1.17 GB/s). Now: the disk measured over 8 GiB at start; pieces
#      never written are zero-filled, not read. With clipping the first step's updates run in the second step, the
#      first optimizer pass (no reads now): 2 warm-up steps, then 3 measured (~160 s each). Target: the measured
#      steps within 15% of the plan made at start (python bench/ssd_replan.py on the JSON).
#   3. the CPU AdamW's threads on this 32-vCPU host: Qwen2.5-7B 158 x 1024 on one GPU. In session 30, with all 32
#      threads, the GPU was 65-77% busy (19.5 s a step, planned 14.8); on at most three quarters of the cores now
#      (probe.adamw_thread_counts). Target: GPU busy >= 0.9, the step within 10% of the plan.
# Session 31: after the 32B on x4 (~12 min of device time) ~17 min were left: the SSD run has 2 measured steps, not
# 3 (~700 s with start-up), and the 7B runs only if time remains.
S=/tmp/xh SSD=/var/tmp/megatrain-ssd
if ! detached_started chain; then
  mkdir -p $S $SSD
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
export CUDA_VISIBLE_DEVICES=0
Q14="--model $M/qwen2.5-14b --seq 1024 --seqs 158 --micro 79 --compile"
if nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
  run_in $S qwen14b_80g 600 python3 bench/bench_cli.py \$Q14 --steps 2 --warmup 2 --set memory.gpu_budget_gb=80 \\
    --set memory.host_budget_gb=249 --label qwen2.5-14b-158x1024-budget80-cli --workdir $S/w14 \\
    --json $S/qwen14b_80g.json
  cp $S/w14/cli.log $S/qwen14b_80g_cli.log 2>/dev/null; rm -rf $S/w14
else
  echo "qwen14b_80g: not run (not an H200: issue 11's row is an H200 held to 80 GiB)"
fi
df -h /var/tmp > $S/disk.log
run_in $S qwen14b_ssd 1000 python3 bench/bench_cli.py \$Q14 --steps 2 --warmup 2 --host-budget-gb 128 \\
  --disk-path $SSD --label qwen2.5-14b-158x1024-host128-ssd-cli --workdir $S/wssd --json $S/qwen14b_ssd.json
cp $S/wssd/cli.log $S/qwen14b_ssd_cli.log 2>/dev/null
cp $S/wssd/run/metrics.jsonl $S/qwen14b_ssd_metrics.log 2>/dev/null  # (JSON lines)
rm -rf $S/wssd $SSD
run_in $S qwen7b_1gpu 450 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 \\
  --steps 2 --warmup 2 --compile --label qwen2.5-7b-158x1024-1gpu-threads --workdir $S/w7 --json $S/qwen7b_1gpu.json
cp $S/w7/cli.log $S/qwen7b_1gpu_cli.log 2>/dev/null; rm -rf $S/w7
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
if [ -f $S/qwen14b_ssd.json ]; then python3 bench/ssd_replan.py $S/qwen14b_ssd.json | tee -a "$OUT/tables.txt"; fi
