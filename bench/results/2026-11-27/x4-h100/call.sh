# Written 2026-11-27 (session 27): issue 14's runs, and issue 13's GPU row, on ONE nvidia-h200-x4 (4 H200s, 64 cores,
# 512 GiB host) in ONE detached chain, so that the session's 30 minutes of device time hold them all. It joins
# next-x4-scaling.sh and next-x4-14b-32b.sh (their comments hold the plans and targets), in the order of what only
# this kind can run:
#   1. scaling: Qwen2.5-7B, 158 x 1024 per GPU per step, `megatrain train` on 1 GPU, then torchrun on 2 and 4 GPUs
#      (1 warm-up + 2 measured steps each, memory.host_budget_gb=500). Plan: 14.69-14.70 s, 11,011 tokens/s per GPU;
#      node host 105.6 / 111.8 / 124.3 GiB. Targets: 2 GPUs >= 1.9x (issue 13), 4 GPUs >= 3.7x (issue 14).
#   2. Qwen2.5-14B megatrain on GPU 0 (plan 29.33 s, 198.8 GiB host).
#   3. Qwen2.5-32B megatrain on GPU 0 (plan 65.5 s, 441.7 GiB host, 138.5 of 139.8 GiB GPU): 1 warm-up + 1 measured
#      step (a second measured step would cost 65 s of the session's 30 minutes).
#   4. DeepSpeed ZeRO-3 offload, Qwen2.5-14B, micro-batches of 2, one step (expect ~220 s + ~3 min start).
#   5. if time is left: tests/gpu/test_distributed_cuda.py on GPUs 0,1 (issue 13).
# Every call brings back what has finished so far (partial.tar.gz: the logs and JSONs of both folders), so that a
# session whose device time ends mid-chain keeps the finished runs. Issue this call, then again at once on the warm
# machine, until status.txt has "chain rc=".
S1=/tmp/scaling S2=/tmp/onegpu S3=/tmp/disttests
if ! detached_started chain; then
  mkdir -p $S1 $S2 $S3
  cat > /tmp/chain.sh <<EOF
set -u
cd $PWD
echo "MemTotal at the start: \$(awk '/MemTotal/ {print int(\$2 / 1048576)}' /proc/meminfo) GiB"
run() {  # DIR NAME SECONDS CMD...: one run, its output to DIR/NAME.log, its exit status printed
  local dir=\$1 name=\$2 seconds=\$3; shift 3
  echo "== \$name, \$(date -u +%T): \$*"
  timeout \$seconds "\$@" > \$dir/\$name.log 2>&1
  echo "\$name: rc=\$?, \$(date -u +%T); /dev/shm holds \$(du -sh /dev/shm 2>/dev/null | cut -f1)"
  tail -n 3 \$dir/\$name.log
}
A="--seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 1 --compile --host-budget-gb 500"
for n in 1 2 4; do
  CUDA_VISIBLE_DEVICES=\$(seq -s, 0 \$((n - 1))) run $S1 qwen7b_\${n}gpu 420 python3 bench/bench_cli.py \\
    --model $M/qwen2.5-7b \$A --nproc-per-node \$n --label qwen2.5-7b-158x1024-per-gpu-\${n}gpu \\
    --workdir $S1/work\$n --json $S1/qwen7b_\${n}gpu.json
  cp $S1/work\$n/cli.log $S1/qwen7b_\${n}gpu_cli.log 2>/dev/null; rm -rf $S1/work\$n
done
export CUDA_VISIBLE_DEVICES=0
Q14="--model $M/qwen2.5-14b --seq 1024 --seqs 158"
run $S2 qwen14b_mt 330 python3 bench/bench_cli.py \$Q14 --micro 79 --compile --steps 2 --warmup 1 --host-budget-gb 500 \\
  --label qwen2.5-14b-158x1024-x4 --workdir $S2/w14 --json $S2/qwen14b_mt.json
cp $S2/w14/cli.log $S2/qwen14b_mt_cli.log 2>/dev/null; rm -rf $S2/w14
run $S2 qwen32b 600 python3 bench/bench_cli.py --model $M/qwen2.5-32b --seq 1024 --seqs 158 --micro 79 --compile \\
  --steps 1 --warmup 1 --host-budget-gb 500 --label qwen2.5-32b-158x1024-x4 --workdir $S2/w32 --json $S2/qwen32b.json
cp $S2/w32/cli.log $S2/qwen32b_cli.log 2>/dev/null; cp $S2/w32/run/plan.json $S2/qwen32b_plan.json 2>/dev/null
rm -rf $S2/w32
total_gib=\$(awk '/MemTotal/ {print int(\$2 / 1048576)}' /proc/meminfo)
DS_EXTRA=""; [ "\$total_gib" -lt 400 ] && DS_EXTRA="--try-anyway"
echo "MemTotal before DeepSpeed: \$total_gib GiB; extra flags: '\$DS_EXTRA'"
run $S2 qwen14b_ds 720 python3 bench/bench_deepspeed.py \$Q14 --micro 2 --steps 1 --warmup 0 --progress 10 \$DS_EXTRA \\
  --label deepspeed-zero3-offload-qwen2.5-14b-m2-x4 --json $S2/qwen14b_ds.json
CUDA_VISIBLE_DEVICES=0,1 MEGATRAIN_GPU_RESULTS=$S3 run $S3 gpu_distributed 480 python3 -m pytest -q -m gpu \\
  -p no:cacheprovider tests/gpu/test_distributed_cuda.py
EOF
fi
TAIL=14 run_detached chain bash /tmp/chain.sh
mkdir -p /tmp/partial && cp $S1/*.log $S1/*.json $S2/*.log $S2/*.json $S3/*.log $S3/*.json /tmp/partial/ 2>/dev/null
bundle_results partial /tmp/partial
python3 - "$S1" "$S2" <<'PY' | tee "$OUT/tables.txt"
import json, sys
from pathlib import Path

def load(d, name):
    f = Path(d) / f"{name}.json"
    return json.loads(f.read_text())["result"] if f.exists() else {}

def cell(r, k, spec, width):
    return format(r[k], spec).rjust(width) if isinstance(r.get(k), (int, float)) else "-".rjust(width)

runs = {n: load(sys.argv[1], f"qwen7b_{n}gpu") for n in (1, 2, 4)}
base = runs[1].get("tokens_per_s")
print(f"{'GPUs':>4} {'step s':>8} {'tokens/s':>10} {'x 1 GPU':>8} {'TFLOP/s 6N':>11} {'GPU idle':>9} "
      f"{'GPU peak':>9} {'node PSS GiB':>13} {'node used GiB':>14}")
for n, r in runs.items():
    tps = r.get("tokens_per_s")
    ratio = f"{tps / base:.2f}" if tps and base else "-"
    print(f"{n:>4} {cell(r, 'step_s', '.2f', 8)} {cell(r, 'tokens_per_s', ',.0f', 10)} {ratio:>8} "
          f"{cell(r, 'tflops_6n', '.0f', 11)} {cell(r, 'gpu_idle', '.1%', 9)} {cell(r, 'gpu_peak_gib', '.1f', 9)} "
          f"{cell(r, 'host_node_pss_gib', '.1f', 13)} {cell(r, 'host_node_used_gib', '.1f', 14)}")
print("targets: 2 GPUs >= 1.9x (issue 13), 4 GPUs >= 3.7x (issue 14); node host memory about one store\n")
rows = {name: load(sys.argv[2], name) for name in ("qwen14b_mt", "qwen32b", "qwen14b_ds")}
keys = ("step_s", "tokens_per_s", "tflops_6n", "gpu_peak_gib", "host_peak_rss_gib", "host_bytes_per_param")
print(f"{'run':<12}" + "".join(f"{k:>21}" for k in keys) + "  status")
for name, r in rows.items():
    print(f"{name:<12}" + "".join(cell(r, k, '.2f', 21) for k in keys) + f"  {r.get('status', 'ran' if r else '-')}")
mt, ds = rows["qwen14b_mt"].get("tokens_per_s"), rows["qwen14b_ds"].get("tokens_per_s")
print(f"Qwen2.5-14B megatrain / DeepSpeed ZeRO-3 offload: {mt / ds:.2f}x (target >= 3x; the paper: 1.84x)"
      if mt and ds else "Qwen2.5-14B ratio: not yet")
PY
