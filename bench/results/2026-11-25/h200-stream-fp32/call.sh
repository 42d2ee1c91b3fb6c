# Issue 16 item 1 on one nvidia-h200 (2026-11-25, revision 9862936, the same machine right after h200-noclip/):
# Qwen2.5-7B 158 x 1024 with memory.stream_dtype=fp32 (no bf16 copy on the host: the fp32 master streams and is cast
# on the GPU), `megatrain train` via bench_cli.py, compiled, 1 warm-up + 2 measured steps. Run as one device command
# (the device time left did not allow the runner's full set-up), with the wheels of .whl installed first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
python3 bench/bench_cli.py --model bench/model-configs/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --compile \
  --steps 2 --warmup 1 --set memory.stream_dtype=fp32 --label qwen2.5-7b-158x1024-stream-fp32-cli --workdir /tmp/cli_s \
  --json $OUT/qwen7b_stream_fp32.json
