# Issue 12 on one nvidia-h200 (written 2026-11-25 session 26), second call: the in-GPU transformers peers that the
# first call (results/2026-11-25/h200-moe-peers) could not time within a command: each now runs until its time
# limit and records the tokens/s of the micro-batches it finished after the first (bench_reference.py: partial
# results on SIGTERM; the optimizer step, ~0.1 s on the GPU, not included), or that it does not fit.
# fp32 weights + gradients + Adam states alone: gpt-oss-120b 2 layers 113.0 GiB, Qwen3-30B-A3B 12 layers 120.7,
# OLMoE-1B-7B 103.1, of the H200's 139.8 GiB. transformers' eager experts (a loop over the experts that received
# tokens, F.linear under autocast: bf16); gpt-oss with eager attention (transformers has no SDPA path with sinks).
mkdir -p /tmp/logs
T0=$(date +%s)
peer() {  # NAME SECONDS ARGS...: bench_reference.py under timeout, its JSON in $OUT, its log in /tmp/logs
  local name=$1 seconds=$2
  shift 2
  echo "== $name: bench_reference.py $*"
  timeout "$seconds" python3 bench/bench_reference.py "$@" --json "$OUT/$name.json" > /tmp/logs/$name.log 2>&1
  local rc=$?
  grep -v Warning /tmp/logs/$name.log | tail -n 3
  echo "$name rc=$rc ($(( $(date +%s) - T0 )) s into the command)" | tee -a "$OUT/status.txt"
}
peer olmoe_16l_eager 170 --model $M/olmoe-1b-7b --seq 4096 --seqs 256 --micro 4 --steps 1 --warmup 1 \
  --experts-impl eager
peer gptoss_2l_eager 190 --model $M/gpt-oss-120b --layers 2 --seq 4096 --seqs 256 --micro 2 --steps 1 --warmup 1 \
  --experts-impl eager
peer qwen3_12l_eager $(( T0 + 555 - $(date +%s) )) --model $M/qwen3-30b-a3b --layers 12 --seq 4096 --seqs 256 \
  --micro 2 --steps 1 --warmup 1 --experts-impl eager
tar czf "$OUT/logs.tar.gz" -C /tmp logs
