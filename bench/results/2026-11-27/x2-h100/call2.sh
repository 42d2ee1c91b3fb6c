# Written 2026-11-27 (session 30), on the warm nvidia-h200-x2 (came as 2 H100s) after next-x2-h200.sh: issue 16's SSD
# run again (Qwen2.5-14B 158 x 1024, memory.host_budget_gb=128, /var/tmp), 1 warm-up and 2 measured steps, for the
# spread between steps (the first call's measured steps were 117 and 169 s against a plan of 161 s).
SSD=/var/tmp/megatrain-ssd; mkdir -p $SSD /tmp/xr
TAIL=12 run_logged qwen14b_ssd2 540 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --seqs 158 --micro 79 \
  --compile --steps 2 --warmup 1 --host-budget-gb 128 --disk-path $SSD --label qwen2.5-14b-158x1024-host128-ssd-cli-2 \
  --workdir /tmp/xr/w --json $OUT/qwen14b_ssd2.json
cp /tmp/xr/w/cli.log $OUT/qwen14b_ssd2_cli.log; cp /tmp/xr/w/run/metrics.jsonl $OUT/qwen14b_ssd2_metrics.log
