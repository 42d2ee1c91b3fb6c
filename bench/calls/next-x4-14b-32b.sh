# Pending (written 2026-11-27, not yet run): issue 14's one-GPU rows on an nvidia-h200-x4 (512 GiB host), GPU 0.
#   1. The paper's headline comparison, in the same call: Qwen2.5-14B, 158 x 1024 per step, megatrain (`megatrain
#      train` through bench_cli.py: compiled, bf16, clipping 1.0, 1 warm-up + 2 measured steps) and DeepSpeed
#      ZeRO-3 with parameters and optimizer offloaded to pinned CPU memory (bench_deepspeed.py: micro-batches of 2
#      rows, as its Qwen2.5-7B run, whose micro-batches of 79 ran out of GPU memory in transformers' full-vocabulary
#      logits; one step, no warm-up: its rate was flat across the 7B step); both hosts' bytes per parameter.
#      The plan: default placement, 29.33 s/step, 5,516 tokens/s, 489 TFLOP/s 6N, host 198.8 GiB (14.46 B/param),
#      GPU 100.0 GiB allocated. DeepSpeed's 7B run took 111.8 s a step at 25.1 B/param (x2-peer2): expect ~220 s
#      and ~370 GiB here. Target: megatrain >= 3x DeepSpeed (the paper reports 1.84x).
#   2. Qwen2.5-32B on one GPU, 158 x 1024 per step, the placement the planner chooses (plan printed first, and its
#      plan.json kept beside the measurement). The plan with memory.host_budget_gb=500: layer tiles of 8,192, 17
#      inputs spilled, 25 units' gradients to host, the fp32 master streamed (the placements keeping the bf16 copy
#      fit only to 499.6 of 500 GiB), 65.5 s/step, 2,469 tokens/s, 485 TFLOP/s 6N, host 441.7 GiB (14.47 B/param),
#      GPU 89.0 GiB allocated (138.5 needed of 139.8). The paper's code claimed ~259 TFLOP/s for 32B on one H100.
# The three runs (~3.5 + ~7.5 + ~7.5 min) go one after the other in ONE detached run: issue this call, then the same
# call again at once while the machine is warm (30 s), until status.txt has "onegpu rc=". DeepSpeed needs its
# wheel and hjson in .whl/ (bench/README.md, "The DeepSpeed peer"; pydantic and the rest are there already).
# memory.host_budget_gb=500 on the megatrain runs (the H200 kinds' MemTotal can start small and grow as memory is
# used, KINDS.md; the limit is the whole 512 GiB); DeepSpeed's pre-check is skipped (--try-anyway) when MemTotal
# reads under 400 GiB, for the same reason, and its watchdog still stops it cleanly if memory runs out.
export CUDA_VISIBLE_DEVICES=0
S=/tmp/onegpu
if ! detached_started onegpu; then
  mkdir -p $S
  total_gib=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo)
  DS_EXTRA=""
  [ "$total_gib" -lt 400 ] && DS_EXTRA="--try-anyway"
  cat > $S/runs.sh <<EOF
set -u
echo "MemTotal at the start: $total_gib GiB; DeepSpeed extra flags: '$DS_EXTRA'"
run() {  # NAME SECONDS CMD...: one run, its output to $S/NAME.log, its exit status printed
  local name=\$1 seconds=\$2; shift 2
  echo "== \$name, \$(date -u +%T): \$*"
  timeout \$seconds "\$@" > $S/\$name.log 2>&1
  echo "\$name: rc=\$?"; tail -n 4 $S/\$name.log
}
Q14="--model $M/qwen2.5-14b --seq 1024 --seqs 158"
run qwen14b_mt 330 python3 bench/bench_cli.py \$Q14 --micro 79 --compile --steps 2 --warmup 1 --host-budget-gb 500 \\
  --label qwen2.5-14b-158x1024-x4 --workdir $S/w14 --json $S/qwen14b_mt.json
cp $S/w14/cli.log $S/qwen14b_mt_cli.log 2>/dev/null; rm -rf $S/w14
run qwen14b_ds 720 python3 bench/bench_deepspeed.py \$Q14 --micro 2 --steps 1 --warmup 0 --progress 10 $DS_EXTRA \\
  --label deepspeed-zero3-offload-qwen2.5-14b-m2-x4 --json $S/qwen14b_ds.json
run qwen32b 720 python3 bench/bench_cli.py --model $M/qwen2.5-32b --seq 1024 --seqs 158 --micro 79 --compile \\
  --steps 2 --warmup 1 --host-budget-gb 500 --label qwen2.5-32b-158x1024-x4 --workdir $S/w32 --json $S/qwen32b.json
cp $S/w32/cli.log $S/qwen32b_cli.log 2>/dev/null; cp $S/w32/run/plan.json $S/qwen32b_plan.json 2>/dev/null
rm -rf $S/w32
EOF
fi
TAIL=12 run_detached onegpu bash $S/runs.sh
if detached_done onegpu; then
  bundle_results onegpu_runs $S
  python3 - "$S" <<'PY' | tee "$OUT/onegpu.txt"
import json, sys
from pathlib import Path
rows = {}
for name in ("qwen14b_mt", "qwen14b_ds", "qwen32b"):
    f = Path(sys.argv[1]) / f"{name}.json"
    rows[name] = json.loads(f.read_text())["result"] if f.exists() else {}
keys = ("step_s", "tokens_per_s", "tflops_6n", "gpu_peak_gib", "host_peak_rss_gib", "host_bytes_per_param")
print(f"{'run':<12}" + "".join(f"{k:>22}" for k in keys) + "  status")
for name, r in rows.items():
    cells = "".join(f"{r[k]:>22.2f}" if isinstance(r.get(k), (int, float)) else f"{'-':>22}" for k in keys)
    print(f"{name:<12}{cells}  {r.get('status', 'ran' if r else 'no result')}")
mt, ds = rows["qwen14b_mt"].get("tokens_per_s"), rows["qwen14b_ds"].get("tokens_per_s")
print(f"Qwen2.5-14B megatrain / DeepSpeed ZeRO-3 offload: {mt / ds:.2f}x (target >= 3x; the paper: 1.84x)"
      if mt and ds else "Qwen2.5-14B ratio: a run has no tokens/s")
PY
fi
