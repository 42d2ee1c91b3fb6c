# Issues 12 and 15 on one nvidia-h200 (2026-11-25, session 21, first call):
#   1. tests/gpu/test_gpt_oss_cuda.py again (the last call's two failures fixed on CPU: transformers 5.17 has no
#      swiglu_alpha key, now read with its default 1.702; the clamp-share check indexed top_w as gate_up).
#   2. `megatrain probe` with one gpt-oss-120b decoder layer at 16 x 4096 (the truncated run's micro-batch),
#      compiled: the measured MoE layer rate the full gpt-oss-120b plan needs (issue 12: plan validated against
#      the truncated run within 10%; the default profile planned that run at 12.73 s, measured 16.0 s).
#   3. Llama-3.1-8B at 131,072 tokens, one sequence per step, `megatrain train` through bench_cli.py, compiled,
#      no memory keys (plan: 41.9 s/step, GPU 61.9 GiB allocated; issue 15 target <= 45 s; before: 52.6 s).
mkdir -p "$OUT/gpu"
TAIL=8 run_logged gpu_gptoss 150 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_gpt_oss_cuda.py
TAIL=8 run_logged probe_gptoss 150 python3 -m megatrain.cli probe --out "$OUT/h200_gptoss_profile.json" \
  --layer $M/gpt-oss-120b:16x4096 --compile on
TAIL=8 run_logged llama8b_128k 270 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 131072 --seqs 1 \
  --micro 1 --compile --steps 1 --warmup 1 --label llama-3.1-8b-1x131072-cli --workdir /tmp/cli_l128 \
  --json "$OUT/llama8b_128k.json"
cp /tmp/cli_l128/cli.log "$OUT/llama8b_128k_cli.log" 2>/dev/null
rm -rf /tmp/cli_l128
