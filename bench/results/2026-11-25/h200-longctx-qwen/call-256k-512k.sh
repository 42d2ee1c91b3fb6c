# Issue 15 on one nvidia-h200 (written 2026-11-25 session 23): Qwen2.5-7B at 262,144 and 524,288 tokens, one sequence
# per step, `megatrain train` through bench_cli.py, compiled, no memory keys. Run right after next-h200-longctx.sh on
# the same machine (warm): its 8,192-token tiles left inductor's on-disk cache (/tmp/torchinductor_root) holding
# these very graphs (the tiled layer compiles per tile, whatever the row's length), so compiling costs seconds here.
#   256k: one warm-up step and one measured (plan: 130.4 s/step, GPU 101.6 GiB allocated, host 106.0 GiB).
#   512k: one step, no warm-up (plan: 597.8 s/step, GPU 88.1 GiB allocated, host 122.0 GiB of 124.4): with the start
#         (~70 s) it outlasts one device command (600 s), so it runs in its own process session (setsid) writing to
#         /tmp/q512, and this script, called again on the same warm machine, waits for it and copies its files.
# First call: the 256k run, then the 512k launched and followed until the command's time is nearly spent.
# Later calls: follow the 512k until it ends (or the command's 570 s), then copy its JSON and logs to $OUT.
Q=/tmp/q512
T0=$(date +%s)  # this command's start: it ends by T0 + 570 s (the device command's limit is 600)
if [ ! -f $Q/pid ]; then
  TAIL=8 run_logged qwen7b_256k 420 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 262144 --extend-context --seqs 1 \
    --micro 1 --compile --steps 1 --warmup 1 --label qwen2.5-7b-1x262144-cli --workdir /tmp/cli_q256 \
    --json "$OUT/qwen7b_256k.json"
  cp /tmp/cli_q256/cli.log "$OUT/qwen7b_256k_cli.log" 2>/dev/null
  rm -rf /tmp/cli_q256
  mkdir -p $Q
  setsid bash -c "python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 524288 --extend-context --seqs 1 --micro 1 --compile \
    --steps 1 --warmup 0 --label qwen2.5-7b-1x524288-cli --workdir $Q/work --json $Q/qwen7b_512k.json \
    > $Q/qwen7b_512k.log 2>&1; echo \$? > $Q/rc" < /dev/null > /dev/null 2>&1 &
  echo $! > $Q/pid
  date +%s > $Q/start
  echo "qwen7b_512k launched (setsid, pid $(cat $Q/pid))" | tee -a "$OUT/status.txt"
fi
LIMIT=$(( T0 + 570 ))
while [ ! -f $Q/rc ] && [ "$(date +%s)" -lt $LIMIT ]; do
  sleep 15
done
echo "qwen7b_512k: $(( $(date +%s) - $(cat $Q/start) )) s since launch; rc: $(cat $Q/rc 2>/dev/null || echo running)"
tail -n 6 $Q/qwen7b_512k.log
free -g | head -2
nvidia-smi --query-gpu=memory.used --format=csv,noheader
cp $Q/qwen7b_512k.log "$OUT/" 2>/dev/null
cp $Q/work/cli.log "$OUT/qwen7b_512k_cli.log" 2>/dev/null
if [ -f $Q/rc ]; then
  cp $Q/qwen7b_512k.json "$OUT/" 2>/dev/null
  echo "qwen7b_512k rc=$(cat $Q/rc)" | tee -a "$OUT/status.txt"
fi
