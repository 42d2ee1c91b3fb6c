# Issue 12 on one nvidia-h200 (written 2026-11-25 session 26): the MoE runs' in-GPU peers, "the same truncated model
# trained in-GPU by transformers where it fits" (bench/bench_reference.py: fp32 master weights on the GPU, bf16
# autocast, gradient checkpointing, fused CUDA AdamW, clipping, the router's load-balancing loss in the loss;
# random token ids; 256 x 4096 = 1,048,576 tokens per step as megatrain's runs; one warm-up and one measured step).
# fp32 weights + gradients + Adam states alone (16 B/param): Mixtral-8x7B 4 layers 90.4 GiB, OLMoE-1B-7B full depth
# 103.1, gpt-oss-120b 2 layers 113.0, Qwen3-30B-A3B 12 layers 120.7, of the H200's 139.8 GiB.
#   1. Mixtral-8x7B, 4 layers, transformers' eager experts (a loop over the experts that received tokens, each
#      F.linear under autocast: bf16), micro-batches of 8 x 4096.
#   2. OLMoE-1B-7B, full depth, eager experts, micro-batches of 4 x 4096 (its 50k vocabulary's fp32 logits).
#   3. The host's CpuAdamW rate on one tile of 268M and of 3.19B parameters (a gpt-oss-120b layer's size; the
#      2-layer run updated its layers at 1.46-1.64 Gparam/s inside the step): is the rate a property of the unit?
#   4. Mixtral-8x7B, 4 layers, transformers' grouped_mm experts (torch's grouped GEMM; transformers casts the input
#      to the weights' dtype, fp32 here, since grouped_mm is not autocast-enabled), as long as time is left.
# Second command (CALL2=1): gpt-oss-120b 2 layers (transformers runs it with eager attention: no SDPA with sinks)
# and Qwen3-30B-A3B 12 layers, eager experts, micro-batches of 2 x 4096: do they fit, and at what speed.
# Logs go to /tmp/logs and come back as one tarball (a device command returns at most 8 files).
mkdir -p /tmp/logs
T0=$(date +%s)
peer() {  # NAME SECONDS ARGS...: bench_reference.py under timeout, its JSON in $OUT, its log in /tmp/logs
  local name=$1 seconds=$2
  shift 2
  echo "== $name: bench_reference.py $*"
  timeout "$seconds" python3 bench/bench_reference.py "$@" --json "$OUT/$name.json" > /tmp/logs/$name.log 2>&1
  local rc=$?
  tail -n 4 /tmp/logs/$name.log
  echo "$name rc=$rc ($(( $(date +%s) - T0 )) s into the command)" | tee -a "$OUT/status.txt"
}
if [ -z "${CALL2:-}" ]; then
  peer mixtral_4l_eager 200 --model $M/mixtral-8x7b --layers 4 --seq 4096 --seqs 256 --micro 8 --steps 1 \
    --warmup 1 --experts-impl eager
  peer olmoe_16l_eager 200 --model $M/olmoe-1b-7b --seq 4096 --seqs 256 --micro 4 --steps 1 --warmup 1 \
    --experts-impl eager
  echo "== adamw_rate"
  timeout 90 python3 - > /tmp/logs/adamw_rate.log 2>&1 <<'PY'
import json, os, time
import torch
from megatrain.planner.probe import adamw_rate
out = {"threads": torch.get_num_threads(), "cpus": os.cpu_count()}
for numel in (268_435_456, 3_188_000_000):
    t = time.perf_counter()
    out[str(numel)] = adamw_rate(numel, torch.bfloat16, reps=2)
    print(f"{numel:,} params: {out[str(numel)] / 1e9:.2f} Gparam/s ({time.perf_counter() - t:.0f} s with set-up)",
          flush=True)
json.dump(out, open(os.environ["OUT"] + "/adamw_rate.json", "w"), indent=1)
PY
  echo "adamw_rate rc=$?" | tee -a "$OUT/status.txt"
  cat /tmp/logs/adamw_rate.log | tail -3
  LEFT=$(( T0 + 560 - $(date +%s) ))
  if [ $LEFT -gt 60 ]; then
    peer mixtral_4l_grouped_mm $LEFT --model $M/mixtral-8x7b --layers 4 --seq 4096 --seqs 256 --micro 8 --steps 1 \
      --warmup 1 --experts-impl grouped_mm
  fi
else
  peer gptoss_2l_eager 270 --model $M/gpt-oss-120b --layers 2 --seq 4096 --seqs 256 --micro 2 --steps 1 --warmup 1 \
    --experts-impl eager
  peer qwen3_12l_eager $(( T0 + 560 - $(date +%s) )) --model $M/qwen3-30b-a3b --layers 12 --seq 4096 --seqs 256 \
    --micro 2 --steps 1 --warmup 1 --experts-impl eager
fi
tar czf "$OUT/logs${CALL2:+2}.tar.gz" -C /tmp logs
