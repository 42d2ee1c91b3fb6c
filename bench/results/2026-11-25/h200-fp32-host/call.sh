# Issue 16 on one nvidia-h200 (written 2026-11-25 session 25; ~6 minutes). Qwen2.5-7B 158 x 1024,
# memory.stream_dtype: fp32, compiled, twice in a row on the same machine: the first run compiles and autotunes
# (Inductor's autotuning kept 4.04 GiB of page-locked host copies in torch's caching host allocator,
# results/2026-11-25/h200-rss-diag, now returned after the step: runtime/pinned.release_torch_pinned_cache), the
# second finds its kernels and their tuning in Inductor's on-disk cache (a second run of the same shapes, a resume).
# Host peak RSS and its parts (anonymous / file / shmem) each time.
for n in 1 2; do
  TAIL=4 run_logged qwen7b_fp32_run$n 300 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 \
    --micro 79 --compile --steps 1 --warmup 1 --set memory.stream_dtype=fp32 \
    --label qwen2.5-7b-158x1024-stream-fp32-run$n --workdir /tmp/cli_s --json "$OUT/qwen7b_fp32_run$n.json"
  rm -rf /tmp/cli_s
done
