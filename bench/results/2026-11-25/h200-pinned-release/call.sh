# Issue 16 on one nvidia-h200 (written 2026-11-25 session 25; ~3 minutes): whether torch's caching host allocator's
# 4 GiB of page-locked blocks (Inductor's autotuning copies in a cold compile cache) are now returned after the first
# step (runtime/pinned.release_torch_pinned_cache, fixed: the allocator counts freed blocks as active until it
# processes their events, so the first version never released them; results/2026-11-25/h200-fp32-host).
# Qwen2.5-7B truncated to 2 layers, 158 x 1024 in micro-batches of 79, fp32 streaming, compiled, one warm-up step
# and two measured: host_pinned_cache_gib and host_pinned_released_gib per step.
TAIL=4 run_logged q2l_79_fp32_compiled 150 python3 bench/bench_cli.py --model $M/qwen2.5-7b --layers 2 --seq 1024 \
  --seqs 158 --micro 79 --compile --steps 2 --warmup 1 --set memory.stream_dtype=fp32 --label q2l_79_fp32_compiled \
  --workdir /tmp/cli_q2 --json "$OUT/q2l_79_fp32_compiled.json"
python3 - <<'PY'
import json, os
r = json.load(open(os.environ["OUT"] + "/q2l_79_fp32_compiled.json"))["result"]
for s in r["steps"]:
    print("step", s["step"], "torch pinned cache GiB", s.get("host_pinned_cache_gib"), "rss", s.get("host_rss_gib"))
PY
grep -h "host_pinned_released_gib" /tmp/cli_q2/run/metrics.jsonl | head -3 | cut -c1-300
rm -rf /tmp/cli_q2
