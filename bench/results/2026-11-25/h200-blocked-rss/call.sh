# Issues 15 and 16 on one nvidia-h200 (written 2026-11-25 session 25; ~9 minutes, one device command).
#   1. bench/blocked_attention.py: which kernels the attention blocked for its backward (memory.attn_block) should
#      call. The engine's blocked path calls the flash op, whose backward ran 1.66x SDPA's on the H100
#      (results/2026-11-25/h100-llama512k); this times SDPA's choice, the flash / cuDNN forwards alone, and the
#      blocked backward with flash pairs (the engine's), cuDNN pairs, and the cuDNN forward's log-sum-exp fed to
#      flash pairs (each one's gradients against the engine's), at 131,072 and 262,144 tokens, blocks of 65,536.
#   2. Qwen2.5-7B 158 x 1024, memory.stream_dtype: fp32, compiled (the run of results/2026-11-25/h200-stream-fp32,
#      12.9 B/param against issue 16's 12.3): what its 6 GiB above the 12 B/param of the store are, from
#      bench_cli.py's sampler (smaps_rollup at the peak: anonymous / file-backed / shmem; the largest mappings;
#      torch.compile's worker processes apart) and the plan's host components beside it.
TAIL=14 run_logged blocked_attention 240 python3 bench/blocked_attention.py --json "$OUT/blocked_attention.json"
TAIL=6 run_logged qwen7b_fp32_rss 320 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 \
  --micro 79 --compile --steps 1 --warmup 1 --set memory.stream_dtype=fp32 \
  --label qwen2.5-7b-158x1024-stream-fp32-rss --workdir /tmp/cli_s --json "$OUT/qwen7b_fp32_rss.json"
rm -rf /tmp/cli_s
