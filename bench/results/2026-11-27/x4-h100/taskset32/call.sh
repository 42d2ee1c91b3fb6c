# Session 27, nvidia-h100-x4: the 2-GPU Qwen2.5-7B run of next-x4-all.sh again, its ranks confined to 32 of the 64
# vCPUs (taskset -c 0-31: each rank's optimizer then uses 16 threads, 32 in all, instead of 32 each, 64 in all).
export CUDA_VISIBLE_DEVICES=0,1
TAIL=8 run_logged qwen7b_2gpu_taskset32 215 taskset -c 0-31 python3 bench/bench_cli.py --model $M/qwen2.5-7b --seq 1024 \
  --seqs 158 --micro 79 --steps 2 --warmup 1 --compile --host-budget-gb 500 --nproc-per-node 2 \
  --label qwen2.5-7b-158x1024-per-gpu-2gpu-taskset32 --workdir /tmp/w7b --json "$OUT/qwen7b_2gpu_taskset32.json"
cp /tmp/w7b/cli.log "$OUT/qwen7b_2gpu_taskset32_cli.log" 2>/dev/null
