# Issue 15 on one nvidia-h100-x1 (written 2026-11-25, not yet run). Llama-3.1-8B at 524,288 tokens does not fit
# this machine by the plan (bench/results/2026-11-25/long_context_plan.txt, H200 rates): at 512k a layer boundary is
# 4 GiB and the tiled layer's attention work 36 GiB; the 8B's fp32 gradients (30 GiB) wait for the global norm and
# the host's 125 GiB already hold 90-105 GiB of state, so neither memory takes the gradients plus the checkpoints
# (best of a grid: 96 GiB of GPU needed, 73.5 allocated: eager, fp32 streaming, K=4, 14 inputs spilled, 16 gradients
# to host). It needs issue 16's optimizer that does not wait for
# the norm, or more host RAM. This call records that verdict from the device itself, and measures the longest run
# the plan fits here:
#   1. `megatrain plan --json` of Llama-3.1-8B at 524,288 tokens on this GPU (expected: does not fit, GPU memory).
#   2. Llama-3.1-8B 262,144 tokens, `megatrain train` through bench_cli.py, compiled, no memory keys: the planner
#      tiles the layer (memory.seq_tile=8192), rebuilds blocks of 3 below the top 6 layers (checkpoint_every=3,
#      keep_top_layers=6): 158.3 s/step predicted (H200 rates), GPU peak 57.1 GiB allocated, 77.7 GiB needed of
#      78 (a close fit: if this GPU has less free the run is refused before loading weights, and says so).
mkdir -p /tmp/plan512k
printf '{"text": "a b c"}\n' > /tmp/plan512k/data.jsonl
cat > /tmp/plan512k/run.yaml <<YAML
model: {path: $PWD/$M/llama-3.1-8b, init: random}
data: {path: /tmp/plan512k/data.jsonl, max_seq_len: 524288}
train: {micro_batch_size: 1, grad_accum_steps: 1, device: cuda}
checkpoint: {at_end: false}
output: {dir: /tmp/plan512k/run}
YAML
# exit status 1 is the refusal this expects: the logged rc is 0 exactly when the plan refuses
TAIL=12 run_logged llama8b_512k_plan 90 bash -c 'python3 -m megatrain.cli plan /tmp/plan512k/run.yaml --json; \
  test $? -eq 1'
TAIL=8 run_logged llama8b_256k 470 python3 bench/bench_cli.py --model $M/llama-3.1-8b --seq 262144 --seqs 1 \
  --micro 1 --compile --steps 1 --warmup 1 --label llama-3.1-8b-1x262144-h100-cli --workdir /tmp/cli_l256 \
  --json "$OUT/llama8b_256k_h100.json"
cp /tmp/cli_l256/cli.log "$OUT/llama8b_256k_h100_cli.log" 2>/dev/null
rm -rf /tmp/cli_l256
