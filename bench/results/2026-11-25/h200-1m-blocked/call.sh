# Issue 15 on one nvidia-h200 (written 2026-11-25 session 25; one device command, two if the run outlasts it).
# The attention blocked for its backward (memory.attn_block) now runs the kernels SDPA picks (cuDNN's on Hopper):
#   1. tests/gpu/test_blockwise_cuda.py: exactness against float64 (bf16, 8,192 tokens, blocks of 1,024) beside SDPA's,
#      and the backward's memory against the planner's meta device and its time against SDPA's at 128k and 256k.
#   2. A 2-layer Llama-3.1-8B, 16,384 tokens, tiles of 8,192: compiles the tile graphs into inductor's on-disk cache.
#   3. Llama-3.1-8B truncated to 3 layers at 1,048,576 tokens, one sequence (--extend-context: its llama3 RoPE
#      scaling kept, max_position_embeddings 1M), compiled, no clipping, memory.attn_block 65536 and memory.seq_tile
#      8192 (the full model's 1M plan runs both), the rest the planner's; one step, no warm-up: a layer at 1M on the
#      H200 against the plan (planned 206 s, GPU 95.8 GiB allocated, 106 needed). The full model's 1M step (3,238 s
#      planned) outlasts a session's device time. In its own process session (setsid) writing to /tmp/l1m: this
#      script, called again on the same warm machine, waits for it and copies its files.
L=/tmp/l1m
T0=$(date +%s)
if [ ! -f $L/pid ]; then
  mkdir -p $L
  MEGATRAIN_GPU_RESULTS=$OUT TAIL=16 run_logged gpu_blockwise 200 python3 -m pytest -q -m gpu -s \
    tests/gpu/test_blockwise_cuda.py
  TAIL=4 run_logged warm_tiles 150 python3 bench/bench_cli.py --model $M/llama-3.1-8b --layers 2 --seq 16384 --seqs 1 \
    --micro 1 --compile --steps 1 --warmup 0 --set memory.seq_tile=8192 --set memory.attn_block=4096 \
    --label warm-tiles --workdir /tmp/cli_warm --json "$OUT/warm_tiles.json"
  rm -rf /tmp/cli_warm
  setsid bash -c "python3 bench/bench_cli.py --model $M/llama-3.1-8b --layers 3 \
    --seq 1048576 --extend-context --seqs 1 --micro 1 --compile --steps 1 --warmup 0 \
    --set train.max_grad_norm=null --set memory.attn_block=65536 --set memory.seq_tile=8192 \
    --label llama-3.1-8b-3l-1x1048576-h200-cli --workdir $L/work --json $L/llama8b_3l_1m.json \
    > $L/llama8b_3l_1m.log 2>&1; echo \$? > $L/rc" < /dev/null > /dev/null 2>&1 &
  echo $! > $L/pid
  date +%s > $L/start
  echo "llama8b_3l_1m launched (setsid, pid $(cat $L/pid))" | tee -a "$OUT/status.txt"
fi
LIMIT=$(( T0 + ${WAIT_S:-570} ))
while [ ! -f $L/rc ] && [ "$(date +%s)" -lt $LIMIT ]; do
  sleep 10
done
echo "llama8b_3l_1m: $(( $(date +%s) - $(cat $L/start) )) s since launch; rc: $(cat $L/rc 2>/dev/null || echo running)"
tail -n 8 $L/llama8b_3l_1m.log
cp $L/llama8b_3l_1m.log "$OUT/" 2>/dev/null
cp $L/work/cli.log "$OUT/llama8b_3l_1m_cli.log" 2>/dev/null
cp $L/work/run/plan.json "$OUT/llama8b_3l_1m_plan.json" 2>/dev/null
if [ -f $L/rc ]; then
  cp $L/llama8b_3l_1m.json "$OUT/" 2>/dev/null
  echo "llama8b_3l_1m rc=$(cat $L/rc)" | tee -a "$OUT/status.txt"
fi
