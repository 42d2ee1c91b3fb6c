# Issues 15 and 16 on one nvidia-h200 (written 2026-11-25 session 25; ~7 minutes).
#   1. bench/blocked_attention.py again, the cuDNN pairs given no bias as autograd passes it (an undefined tensor;
#      the first call passed an empty one and the op refused it), at 131,072 and 262,144 tokens.
#   2. Where the 4.04 GiB of shared page-locked memory ("/dev/zero (deleted)", the CUDA driver's cudaHostAlloc) in
#      the fp32-streaming Qwen2.5-7B run comes from (results/2026-11-25/h200-blocked-rss: 91.2 GiB RSS = 86.6
#      anonymous + 4.04 of that + 0.3 files): Qwen2.5-7B truncated to 2 layers (its 2.03 GiB fp32 embedding kept),
#      one warm-up and one measured step each, the step records now carrying torch's caching host allocator's
#      bytes (host_pinned_cache_gib):
#        a. 158 x 1024 in micro-batches of 79, fp32 streaming, compiled (the full run's shape)
#        b. the same, eager
#        c. 16 x 1024 in micro-batches of 8, fp32 streaming, compiled
#        d. 158 x 1024 in micro-batches of 79, bf16 streaming (the default), compiled
TAIL=14 run_logged blocked_attention 200 python3 bench/blocked_attention.py --json "$OUT/blocked_attention.json"
q2() {  # name, then bench_cli arguments
  local name=$1
  shift
  TAIL=3 run_logged "$name" 100 python3 bench/bench_cli.py --model $M/qwen2.5-7b --layers 2 --seq 1024 --steps 1 \
    --warmup 1 --label "$name" --workdir /tmp/cli_q2 --json "$OUT/$name.json" "$@"
  rm -rf /tmp/cli_q2
}
q2 q2l_79_fp32_compiled --seqs 158 --micro 79 --compile --set memory.stream_dtype=fp32
q2 q2l_79_fp32_eager --seqs 158 --micro 79 --set memory.stream_dtype=fp32
q2 q2l_8_fp32_compiled --seqs 16 --micro 8 --compile --set memory.stream_dtype=fp32
q2 q2l_79_bf16_compiled --seqs 158 --micro 79 --compile
python3 - <<'PY'
import glob, json, os
for f in sorted(glob.glob(os.environ["OUT"] + "/q2l_*.json")):
    r = json.load(open(f))["result"]
    pinned = max((s.get("host_pinned_cache_gib") or 0) for s in r["steps"])
    print(f"{r['label']:24s} rss {r['host_rss_parts_gib']}  torch pinned cache {pinned:.2f}  "
          f"top {[(m['mapping'][-24:], m['rss_gib']) for m in r['host_rss_top'][:3]]}")
PY
