# Written 2026-11-27 (session 32), for an nvidia-h200-x2 (2 H200s, ~251 GiB host): issue 11's one unmeasured row,
# Qwen2.5-14B 158 x 1024 under memory.gpu_budget_gb=80 with memory.host_budget_gb=249, on one H200 (an H200 held to
# an H100's memory). Plan (default profile, session 29): 29.34 s, host 224.4 GiB, GPU 51.1 GiB allocated. Target
# <= 31 s. 2 warm-up steps, 2 measured. On H100s it stops at once: the row is not an H100 one (an H100's real 80 GB:
# x4-h100-c, 33.94 s). ~8 min on H200s (start-up ~5 min: the 14B's random init is 100 s of it); one detached chain:
# issue it, then again at once until status.txt has "chain rc="; the last call WAIT_S=<device time left - 60>.
S=/tmp/xh
if ! nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -q H200; then
  echo "qwen14b_80g: not run (not an H200: issue 11's row is an H200 held to 80 GiB)" | tee -a "$OUT/status.txt"
  exit 0
fi
if ! detached_started chain; then
  mkdir -p $S
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
export CUDA_VISIBLE_DEVICES=0
run_in $S qwen14b_80g 600 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --seqs 158 --micro 79 \\
  --compile --steps 2 --warmup 2 --set memory.gpu_budget_gb=80 --set memory.host_budget_gb=249 \\
  --label qwen2.5-14b-158x1024-budget80-cli --workdir $S/w14 --json $S/qwen14b_80g.json
cp $S/w14/cli.log $S/qwen14b_80g_cli.log 2>/dev/null; rm -rf $S/w14
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
