# Session 27, nvidia-h100-x4 (it came for nvidia-h200-x4): the 1-GPU Qwen2.5-7B run of next-x4-all.sh again, with the
# intra-op threads capped at 32 of the 64 vCPUs (OMP_NUM_THREADS=32): CPU AdamW on this VM ran at 0.1-0.9 Gparam/s
# with 56-64 threads and 3.7-4.2 with 32 (diag-x4-threads.sh).
export CUDA_VISIBLE_DEVICES=0 OMP_NUM_THREADS=32
TAIL=8 run_logged qwen7b_1gpu_omp32 250 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 --seqs 158 \
  --micro 79 --steps 2 --warmup 1 --compile --host-budget-gb 500 --label qwen2.5-7b-158x1024-1gpu-omp32 \
  --workdir /tmp/w7 --json "$OUT/qwen7b_1gpu_omp32.json"
cp /tmp/w7/cli.log "$OUT/qwen7b_1gpu_omp32_cli.log" 2>/dev/null
