# Issue 15 on one nvidia-h200 (2026-11-25, session 22): the attention kept from the forward for the backward
# (memory.reuse_attention; the planner chooses it at rows of 32k tokens and more, with the layer over 8,192-token
# tiles when that leaves room for more layers' stashes).
#   1. tests/gpu/test_reuse_cuda.py: a Llama-3.1-8B-shaped layer at 32,768 tokens: the stash holds what the planner
#      says (output + log-sum-exp, not q, k, v: the saved-tensor hook met the CUDA kernel's tensors), the backward
#      that spends it equals the recomputing one at bf16's rounding and is not slower. JSON into $OUT/gpu.
#   2. Llama-3.1-8B at 131,072 tokens, one sequence per step, `megatrain train` through bench_cli.py, compiled, no
#      memory keys (plan, default profile: seq_tile=8192, reuse_attention=32, 41.1 s/step, GPU 80.5 GiB allocated;
#      measured before: 50.8 s without reuse; issue 15 target <= 45 s).
#   3. Qwen2.5-7B at 131,072 and 65,536 tokens, the same way (plan: 33.6 s, 64.2 GiB; 64k: see the log).
mkdir -p "$OUT/gpu"
TAIL=6 run_logged gpu_reuse 90 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu -s \
  tests/gpu/test_reuse_cuda.py -x
TAIL=8 run_logged llama8b_128k 230 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 131072 --seqs 1 \
  --micro 1 --compile --steps 1 --warmup 1 --label llama-3.1-8b-1x131072-reuse-cli --workdir /tmp/cli_l128 \
  --json "$OUT/llama8b_128k.json"
cp /tmp/cli_l128/cli.log "$OUT/llama8b_128k_cli.log" 2>/dev/null
rm -rf /tmp/cli_l128
TAIL=8 run_logged qwen7b_128k 150 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 131072 --seqs 1 \
  --micro 1 --compile --steps 1 --warmup 1 --label qwen2.5-7b-1x131072-cli --workdir /tmp/cli_q128 \
  --json "$OUT/qwen7b_128k.json"
cp /tmp/cli_q128/cli.log "$OUT/qwen7b_128k_cli.log" 2>/dev/null
rm -rf /tmp/cli_q128
TAIL=8 run_logged qwen7b_64k 100 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 65536 --seqs 1 \
  --micro 1 --compile --steps 1 --warmup 1 --label qwen2.5-7b-1x65536-cli --workdir /tmp/cli_q64 \
  --json "$OUT/qwen7b_64k.json"
rm -rf /tmp/cli_q64
