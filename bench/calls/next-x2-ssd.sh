# Pending (written 2026-11-25, one detached run since 2026-11-27; not yet run), issue 16 part 3, the SSD tier: one
# H200 of an nvidia-h200-x2 (251 GiB host) or of an nvidia-h200-x4 (512 GiB), but memory.host_budget_gb=128 as the
# issue's row asks; Qwen2.5-14B, 158 x 1024 per step (2 micro-batches
# of 79 rows), compiled, bf16, clipping 1.0, memory.disk_path on the machine's own disk (/var/tmp: not a tmpfs).
# The plan (bench/plan_ssd.py, H200 profile of 2026-11-21, DESIGN.md's disk: O_DIRECT 16 MiB requests read 1.2 GB/s,
# write 1.6 GB/s; bench/results/2026-11-25/ssd_plan.txt):
#   all in RAM needs ~199 GiB: does not fit 128; the planner puts Adam v on the SSD (55.0 GiB of files) and streams
#   the fp32 master (no bf16 copy): host 116.5 GiB (8.5 B/param); per step 55.0 GiB read + 55.0 GiB written =
#   86.2 s of disk; predicted 107.3 s/step, bound by the SSD (hiding it would need 12.6 GB/s read+write)
# Targets: it trains; step_time_s within 15% of 107.3 s (the warm-up step reads v's holes, not the disk: not
# measured); disk_read_gbps and disk_write_gbps (metrics: GB moved / seconds with I/O in flight) near 1.2 and 1.6;
# disk_read_gb = disk_write_gb = 59.1 (55.0 GiB) per step; host_rss_gib <= 128.
# First, the disk itself: 4 GiB written then read back with O_DIRECT, 16 MiB requests (dd), for the plan's rates
# (re-plan here with them: bench/plan_ssd.py). Then the run: ~2 min to load and compile, a warm-up step and two of
# ~107 s, longer than one 10-minute device command, so it runs detached: issue this call, then the same call again at
# once while the machine is warm (30 s), until status.txt has "qwen14b_ssd rc=".
export CUDA_VISIBLE_DEVICES=0
SSD=/var/tmp/megatrain-ssd
W=/tmp/cli_ssd
if ! detached_started qwen14b_ssd; then
  mkdir -p $SSD
  df -h /var/tmp | tee "$OUT/disk.txt"
  TAIL=4 run_logged disk_write 120 dd if=/dev/zero of=$SSD/probe bs=16M count=256 oflag=direct conv=fsync
  TAIL=4 run_logged disk_read 120 dd if=$SSD/probe of=/dev/null bs=16M iflag=direct
  rm -f $SSD/probe
  tail -n 1 "$OUT/disk_write.log" "$OUT/disk_read.log" >> "$OUT/disk.txt"
  rm -f "$OUT/disk_write.log" "$OUT/disk_read.log"  # (their lines are in disk.txt: a command brings back 8 files)
fi
TAIL=10 run_detached qwen14b_ssd python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 \
  --seqs 158 --compile --steps 2 --warmup 1 --host-budget-gb 128 --disk-path $SSD \
  --label qwen2.5-14b-158x1024-host128-ssd-cli --workdir $W --json /tmp/qwen14b_ssd.json
if detached_done qwen14b_ssd; then
  cp /tmp/qwen14b_ssd.json "$OUT/" 2>/dev/null
  mkdir -p /tmp/ssd_logs && cp $W/cli.log /tmp/ssd_logs/qwen14b_ssd_cli.log 2>/dev/null
  cp $W/run/metrics.jsonl /tmp/ssd_logs/qwen14b_ssd_metrics.json 2>/dev/null  # (JSON lines)
  bundle_results qwen14b_ssd_logs /tmp/ssd_logs
  rm -rf $SSD
fi
