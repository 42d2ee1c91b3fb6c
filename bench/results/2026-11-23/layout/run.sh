# Issue 10 (layout): after the move, on one H200.
# 1. The GPU tests (tests/gpu: megatrain's CUDA path against transformers + torch AdamW in fp32 and bf16 over 20 steps;
#    packed rows on CUDA). JSON: $OUT/gpu_equivalence.json, $OUT/gpu_packing.json.
# 2. Qwen2.5-7B, 158 x 1024 tokens per step (2 micro-batches of 79, compiled layers), 1 warm-up + 2 measured steps,
#    measured two ways: bench_megatrain.py (the runtime driven directly) and bench_cli.py (`megatrain train` in a
#    subprocess on the same model, batch and optimizer). The CLI needs pydantic and datasets: the wheels in .whl/.
python3 -c "import pyarrow, sys; sys.exit(0 if int(pyarrow.__version__.split('.')[0]) >= 24 else 1)" 2>/dev/null || {
  [ -d .whl-pyarrow ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl-pyarrow/*.whl \
    && echo "pyarrow from .whl-pyarrow: $(python3 -c 'import pyarrow; print(pyarrow.__version__)')"; }
export MEGATRAIN_GPU_RESULTS=$OUT
run_logged gpu_tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 1 --compile"
run_logged qwen7b_cli 220 python3 bench/bench_cli.py $Q --label qwen2.5-7b-cli --workdir /tmp/bench_cli_qwen7b \
  --json "$OUT/qwen7b_cli.json"
cp /tmp/bench_cli_qwen7b/run/metrics.jsonl "$OUT/qwen7b_cli_metrics.jsonl" || true
run_logged qwen7b_bench 200 python3 bench/bench_megatrain.py $Q --label qwen2.5-7b-bench --json "$OUT/qwen7b_bench.json"
