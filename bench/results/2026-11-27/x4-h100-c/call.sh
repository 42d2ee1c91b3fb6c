# Written 2026-11-27 (session 28), for an nvidia-h200-x4 (or nvidia-h100-x4: name the kind that came), in ONE
# detached chain (~25 min: issue it, then again at once on the warm machine, until status.txt has "chain rc=";
# give it WAIT_S=<device time left - 60> on the last call so the results come back). What x4-h100-b left:
#   1. issue 13: tests/gpu/test_distributed_cuda.py on GPUs 0,1 (next-x2-dist-tests.sh's comment says what). In
#      x4-h100-b its torchrun tests failed before training: tests/dist_helpers.py replaced PYTHONPATH, so the
#      workers lost the carried wheels (pydantic). Fixed; the one-process CUDA test passed there.
#   2. issue 14: Qwen2.5-14B megatrain on GPU 0, 2 warm-up and 2 measured steps (plan on an H100: 29.42 s). In
#      x4-h100-b it hit its 360 s timeout in its third step: 165-195 s before the first step, 122.7 s in it
#      (compiling), 42.1 s in the second. Timeout now 600 s.
#   3. issue 14: DeepSpeed ZeRO-3 offload of parameters and optimizer, Qwen2.5-14B, micro-batches of 2, one step, in
#      the same call as 2. x4-h100-b: 151 s to set up, 215.3 s a step (751 tokens/s), host peak 338.6 GiB (24.6
#      B/param). Target: megatrain >= 3x.
#   4. issue 16: the SSD tier on GPU 0, Qwen2.5-14B in memory.host_budget_gb=128 with memory.disk_path on this
#      machine's disk (/var/tmp: not a tmpfs), after the disk measured with dd (O_DIRECT, 16 MiB requests; 4 GiB).
#      Plan with DESIGN.md's 1.2 / 1.6 GB/s: Adam v on the SSD (55.0 GiB), host 116.5 GiB, 107.3 s/step, bound by
#      the SSD; re-plan with this disk's rates (bench/plan_ssd.py). Targets: it trains; step time within 15% of
#      the plan; disk GB/s measured (metrics: disk_read_gbps, disk_write_gbps); host RSS <= 128 GiB. One measured
#      step after one warm-up (whose reads of v find holes, not the disk): ~2 min less, for the chain's last run.
# DeepSpeed needs its wheel and hjson in .whl/ (bench/README.md, "The DeepSpeed peer").
S=/tmp/xb SSD=/var/tmp/megatrain-ssd
if ! detached_started chain; then
  mkdir -p $S $SSD
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
CUDA_VISIBLE_DEVICES=0,1 MEGATRAIN_GPU_RESULTS=$S run_in $S gpu_distributed 300 python3 -m pytest -q -m gpu \\
  -p no:cacheprovider tests/gpu/test_distributed_cuda.py
export CUDA_VISIBLE_DEVICES=0
Q14="--model $M/qwen2.5-14b --seq 1024 --seqs 158"
run_in $S qwen14b_mt 600 python3 bench/bench_cli.py \$Q14 --micro 79 --compile --steps 2 --warmup 2 \\
  --host-budget-gb 500 --label qwen2.5-14b-158x1024-x4 --workdir $S/w14 --json $S/qwen14b_mt.json
cp $S/w14/cli.log $S/qwen14b_mt_cli.log 2>/dev/null; rm -rf $S/w14
total_gib=\$(awk '/MemTotal/ {print int(\$2 / 1048576)}' /proc/meminfo)
DS_EXTRA=""; [ "\$total_gib" -lt 400 ] && DS_EXTRA="--try-anyway"
echo "MemTotal before DeepSpeed: \$total_gib GiB; extra flags: '\$DS_EXTRA'"
run_in $S qwen14b_ds 720 python3 bench/bench_deepspeed.py \$Q14 --micro 2 --steps 1 --warmup 0 --progress 10 \\
  \$DS_EXTRA --label deepspeed-zero3-offload-qwen2.5-14b-m2-x4 --json $S/qwen14b_ds.json
df -h /var/tmp > $S/disk.log
run_in $S disk_write 120 dd if=/dev/zero of=$SSD/probe bs=16M count=256 oflag=direct conv=fsync
run_in $S disk_read 120 dd if=$SSD/probe of=/dev/null bs=16M iflag=direct
rm -f $SSD/probe
run_in $S qwen14b_ssd 900 python3 bench/bench_cli.py \$Q14 --micro 79 --compile --steps 1 --warmup 1 \\
  --host-budget-gb 128 --disk-path $SSD --label qwen2.5-14b-158x1024-host128-ssd-cli --workdir $S/wssd \\
  --json $S/qwen14b_ssd.json
cp $S/wssd/cli.log $S/qwen14b_ssd_cli.log 2>/dev/null
cp $S/wssd/run/metrics.jsonl $S/qwen14b_ssd_metrics.log 2>/dev/null  # (JSON lines)
rm -rf $S/wssd $SSD
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/x4_tables.py /tmp/none $S | tail -n 5 | tee "$OUT/tables.txt"
python3 bench/summarize.py $S | tee -a "$OUT/tables.txt"
