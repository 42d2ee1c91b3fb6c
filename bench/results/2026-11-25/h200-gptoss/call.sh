# Issue 12 on one nvidia-h200: gpt_oss.
#   1. tests/gpu/test_gpt_oss_cuda.py: a small gpt_oss (sinks, window 48, yarn, 8 experts top 2, router loss) in
#      fp32 on CUDA equals CPU within 1e-5 (loss and every gradient; a padded row, and a packed row); the sink path
#      (FlexAttention's o and log-sum-exp, o * sigmoid(lse - sink)) equals the explicit formula within 1e-5 in fp32,
#      values and the gradients of q, k, v and the sinks (full, window, window + documents), and at 32,768 tokens
#      with gpt-oss-120b's heads in bf16 builds no T x T tensor (peak < 4 GiB above its inputs); grouped experts
#      (biases, clamped SwiGLU) equal the loop in bf16 at the gpt-oss-120b expert shape (< 2e-2), never sync the
#      host, and their fwd+bwd rate is recorded.
#   2. gpt-oss-120b at real width truncated to 2 layers (sliding + full; 7.58B parameters, 1.41B active of which
#      1.16B are the 201k-row embedding and LM head), 256 x 4096 = 1,048,576 tokens per step, micro-batches of 16,
#      `megatrain train` via bench_cli.py with --compile, 1 warm-up + 2 measured steps, no memory keys. Planned on
#      CPU at main's merge of gptoss (the H200 profile, MoE layers at 0.81 of the default rate, host budget 124.4
#      GiB as the last H200 call found free): the default placement fits, 16.39 s/step, 542 TFLOP/s by 6*N_active
#      (2,911 by 6*N), GPU 91.1 GiB needed, host 104.3 GiB (14.77 B/param).
mkdir -p "$OUT/gpu"
TAIL=12 run_logged gpu_gptoss 220 env MEGATRAIN_GPU_RESULTS="$OUT/gpu" python3 -m pytest -q -m gpu \
  tests/gpu/test_gpt_oss_cuda.py
TAIL=10 run_logged gptoss120b_2l 330 python3 bench/bench_cli.py --model $M/gpt-oss-120b --layers 2 --seq 4096 \
  --seqs 256 --micro 16 --compile --steps 2 --warmup 1 --label gpt-oss-120b-2l-256x4096-cli --workdir /tmp/cli_g \
  --json "$OUT/gptoss120b_2l.json"
cp /tmp/cli_g/cli.log "$OUT/gptoss120b_2l_cli.log" 2>/dev/null
rm -rf /tmp/cli_g
