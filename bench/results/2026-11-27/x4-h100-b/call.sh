# Written 2026-11-27 (session 27) after results/2026-11-27/x4-h100, for an nvidia-h200-x4 (or nvidia-h100-x4: name
# the kind that came): issue 13's GPU row and issue 14's scaling and the paper's 14B comparison, in ONE detached
# chain (~23 min: issue it, then again at once on the warm machine, until status.txt has "chain rc="). What
# x4-h100 taught, now in the code or here:
#   - the CPU AdamW runs with the fewest threads within 5% of the fastest of all/3/4/half the cores, measured at
#     start (64 threads on that host's 64 vCPUs: 0.1-3.2 Gparam/s, a 1-GPU step 69% slower than with 32);
#   - the shared store's pages are faulted in when it is made, not during the first updates;
#   - 2 warm-up steps, not 1: the first measured step of every x4-h100 run was still 20-70% slower than the next;
#   - bench_cli SIGKILLs a timed-out run's whole tree, and each run waits until no process holds a GPU;
#   - every step's 3 longest GPU idle stretches are in the JSON's steps (idle_gaps): where a rank waits.
# Runs, one after the other (session 28 moved next-x4-b.sh's GPU tests first and its 32B last, best effort):
#   0. issue 13: tests/gpu/test_distributed_cuda.py on GPUs 0,1 (next-x2-dist-tests.sh's comment says what).
#   1. Qwen2.5-7B, 158 x 1024 per GPU per step, `megatrain train` on 1 GPU, torchrun on 2 and on 4 (2 warm-up, 2
#      measured steps each). x4-h100's steady steps: 14.85 s on 1 GPU (plan 14.76), 16.5 s per rank on 2 and 4
#      (1.80x, 3.61x; the plan 14.73-14.97). Targets: 2 GPUs >= 1.9x (issue 13), 4 GPUs >= 3.7x (issue 14).
#   2. Qwen2.5-14B megatrain on GPU 0 (plan on an H200: 29.33 s, 198.8 GiB; on an H100: 31.4 s, 253.5 GiB).
#   3. DeepSpeed ZeRO-3 offload of parameters and optimizer, Qwen2.5-14B, micro-batches of 2, one step (the 7B
#      took 111.8 s a step after 90 s of set-up, 2026-11-24 x2-peer2). Target: megatrain >= 3x.
#   4. issue 14: Qwen2.5-32B on one GPU (next-x4-b.sh's comment has its plans), if device time is left.
# DeepSpeed needs its wheel and hjson in .whl/ (bench/README.md, "The DeepSpeed peer").
S1=/tmp/scaling S2=/tmp/onegpu
if ! detached_started chain; then
  mkdir -p $S1 $S2
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
echo "MemTotal at the start: \$(awk '/MemTotal/ {print int(\$2 / 1048576)}' /proc/meminfo) GiB"
CUDA_VISIBLE_DEVICES=0,1 MEGATRAIN_GPU_RESULTS=$S2 run_in $S2 gpu_distributed 300 python3 -m pytest -q -m gpu \\
  -p no:cacheprovider tests/gpu/test_distributed_cuda.py
A="--seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 2 --compile --host-budget-gb 500"
for n in 1 2 4; do
  CUDA_VISIBLE_DEVICES=\$(seq -s, 0 \$((n - 1))) run_in $S1 qwen7b_\${n}gpu 450 python3 bench/bench_cli.py \\
    --model $M/qwen2.5-7b \$A --nproc-per-node \$n --label qwen2.5-7b-158x1024-per-gpu-\${n}gpu \\
    --workdir $S1/work\$n --json $S1/qwen7b_\${n}gpu.json
  cp $S1/work\$n/cli.log $S1/qwen7b_\${n}gpu_cli.log 2>/dev/null; rm -rf $S1/work\$n
done
export CUDA_VISIBLE_DEVICES=0
Q14="--model $M/qwen2.5-14b --seq 1024 --seqs 158"
run_in $S2 qwen14b_mt 360 python3 bench/bench_cli.py \$Q14 --micro 79 --compile --steps 2 --warmup 1 \\
  --host-budget-gb 500 --label qwen2.5-14b-158x1024-x4 --workdir $S2/w14 --json $S2/qwen14b_mt.json
cp $S2/w14/cli.log $S2/qwen14b_mt_cli.log 2>/dev/null; rm -rf $S2/w14
total_gib=\$(awk '/MemTotal/ {print int(\$2 / 1048576)}' /proc/meminfo)
DS_EXTRA=""; [ "\$total_gib" -lt 400 ] && DS_EXTRA="--try-anyway"
echo "MemTotal before DeepSpeed: \$total_gib GiB; extra flags: '\$DS_EXTRA'"
run_in $S2 qwen14b_ds 720 python3 bench/bench_deepspeed.py \$Q14 --micro 2 --steps 1 --warmup 0 --progress 10 \\
  \$DS_EXTRA --label deepspeed-zero3-offload-qwen2.5-14b-m2-x4 --json $S2/qwen14b_ds.json
run_in $S2 qwen32b 720 python3 bench/bench_cli.py --model $M/qwen2.5-32b --seq 1024 --seqs 158 --micro 79 --compile \\
  --steps 2 --warmup 1 --host-budget-gb 500 --label qwen2.5-32b-158x1024-x4 --workdir $S2/w32 --json $S2/qwen32b.json
cp $S2/w32/cli.log $S2/qwen32b_cli.log 2>/dev/null; cp $S2/w32/run/plan.json $S2/qwen32b_plan.json 2>/dev/null
rm -rf $S2/w32
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
mkdir -p /tmp/partial && cp $S1/*.log $S1/*.json $S2/*.log $S2/*.json /tmp/partial/ 2>/dev/null
bundle_results partial /tmp/partial
python3 bench/x4_tables.py "$S1" "$S2" | tee "$OUT/tables.txt"
