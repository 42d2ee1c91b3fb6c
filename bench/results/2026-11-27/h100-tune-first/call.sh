# Written 2026-11-27 (session 32), for an nvidia-h200 (one H200, 128 GiB host; name the kind that came), in ONE
# detached chain (~9 min: issue it, then again at once on the warm machine, until status.txt has "chain rc="; give the
# last call WAIT_S=<device time left - 60> so that the results come back).
# Issue 16's fp32-streaming row with engine.tune_first now on by default (auto), on the issue's card:
#   1. Qwen2.5-7B 158 x 1024, memory.stream_dtype=fp32, a cold Inductor cache: host peak <= 12.3 B/param (x2-h100-c,
#      on an H100 host at 2f45c3a: 12.32 with tune_first, 12.86 without), the plan's host figure now without the
#      autotuning block;
#   2. the same with bf16 streaming (the default), a cold cache: fp32 streaming's step within 3% of it;
#   3. run 1 again on its now warm cache: what tune_first costs at start when there is nothing left to tune (a resume).
S=/tmp/xh
if ! detached_started chain; then
  mkdir -p $S
  cat > /tmp/chain.sh <<EOF2
set -u
cd $PWD
Q7="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 2 --compile"
run_in $S q7_fp32 450 env TORCHINDUCTOR_CACHE_DIR=$S/ind-fp32 python3 bench/bench_cli.py \$Q7 \\
  --set memory.stream_dtype=fp32 --label qwen2.5-7b-fp32-cold --workdir $S/wf --json $S/q7_fp32.json
cp $S/wf/cli.log $S/q7_fp32_cli.log 2>/dev/null; rm -rf $S/wf
run_in $S q7_bf16 450 env TORCHINDUCTOR_CACHE_DIR=$S/ind-bf16 python3 bench/bench_cli.py \$Q7 \\
  --label qwen2.5-7b-bf16-cold --workdir $S/wb --json $S/q7_bf16.json
cp $S/wb/cli.log $S/q7_bf16_cli.log 2>/dev/null; rm -rf $S/wb
run_in $S q7_fp32_warm 450 env TORCHINDUCTOR_CACHE_DIR=$S/ind-fp32 python3 bench/bench_cli.py \$Q7 \\
  --set memory.stream_dtype=fp32 --label qwen2.5-7b-fp32-warm --workdir $S/ww --json $S/q7_fp32_warm.json
cp $S/ww/cli.log $S/q7_fp32_warm_cli.log 2>/dev/null; rm -rf $S/ww
EOF2
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
bundle_results partial $S
python3 bench/summarize.py $S | tee "$OUT/tables.txt"
