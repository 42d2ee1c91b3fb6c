# Pending (written 2026-11-24, not yet run): one GPU of an nvidia-h200-x2 (251 GiB host); an nvidia-h200-x4's GPU
# serves with memory.host_budget_gb=249 added (--set), its host being larger. Issue 11's last open row:
#   Qwen2.5-14B 158 x 1024, memory.gpu_budget_gb=80: measured 33.3 s (2026-11-23, K = 2 with the bf16 copy). The plan
#   (re-made 2026-11-27, default profile, 249 GiB free): every layer input kept (K = 1), 25 of them spilled, 16 units'
#   gradients to host, tiles of 8,192, the fp32 master streamed (the placements keeping the bf16 copy fit only to
#   248.9 of 249 GiB): 29.34 s, 489 TFLOP/s 6N, host 224.4 GiB, GPU 51.1 GiB allocated (79.9 needed of 80);
#   target <= 31 s.
# (Its second run, Llama-3.1-8B 16 x 4096 under 22 GiB with the H100's host, ran on the H100 itself on 2026-11-24:
# results/2026-11-24/h100-budget22, 8.94 s.)
export CUDA_VISIBLE_DEVICES=0
TAIL=8 run_logged qwen14b_80g 360 python3 bench/bench_cli.py --model $M/qwen2.5-14b --seq 1024 --micro 79 --compile \
  --seqs 158 --steps 2 --warmup 1 --set memory.gpu_budget_gb=80 --label qwen2.5-14b-158x1024-budget80-cli \
  --workdir /tmp/cli_14 --json "$OUT/qwen14b_80g.json"
cp /tmp/cli_14/cli.log "$OUT/qwen14b_80g_cli.log" 2>/dev/null
