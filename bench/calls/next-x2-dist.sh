# Pending (written 2026-11-25, not yet run), issue 13: two H200s of an nvidia-h200-x2 (256 GiB host), Qwen2.5-7B,
# 158 x 1024 tokens per GPU per step (2 micro-batches of 79 rows), compiled, bf16; `megatrain train` on 1 GPU, then
# `torchrun --standalone --nproc-per-node=2 -m megatrain train` on 2 (bench_cli.py --nproc-per-node 2: the same
# per-rank config, twice the tokens per step), 1 warm-up and 2 measured steps each.
# The plan (`megatrain plan ... memory.host_budget_gb=251 [--nproc-per-node 2]`, default H200 profile):
#   1 GPU : 14.69 s/step, 11,011 tokens/s; host 106.0 GiB (14.94 B/param), GPU peak 54.3 GiB allocated
#   2 GPUs: 14.70 s/step, 22,016 tokens/s (2.00x); host 112.6 GiB for the node (15.88 B/param): ONE store
#           (master, m, v, bf16 copy: 99.3 GiB in shared memory) + per rank 0.5 GiB landing buffers and 6.2 GiB of
#           runtime and data; GPU peak 54.3 GiB per GPU; reduce-scatter 14.2 GiB per GPU per step (0.05 s at an
#           assumed 300 GB/s NVLink, 0.004 s exposed: the embedding's, last)
# Targets: tokens_per_s(2 GPUs) >= 1.9 x tokens_per_s(1 GPU); host_node_pss_gib (the node's processes' PSS: the
# shared store counted once) about one store + 2 runtimes (~112 GiB), not two stores (~212); host_node_used_gib the
# same from the machine's side. The JSONs also hold each rank's step records (loss, grad norm, busy shares).
Q="--model $M/qwen2.5-7b --seq 1024 --seqs 158 --micro 79 --steps 2 --warmup 1 --compile"
CUDA_VISIBLE_DEVICES=0 TAIL=8 run_logged qwen7b_1gpu 270 python3 bench/bench_cli.py $Q \
  --label qwen2.5-7b-158x1024-1gpu --json "$OUT/qwen7b_1gpu.json"
CUDA_VISIBLE_DEVICES=0,1 TAIL=8 run_logged qwen7b_2gpu 310 python3 bench/bench_cli.py $Q --nproc-per-node 2 \
  --label qwen2.5-7b-158x1024-per-gpu-2gpu --json "$OUT/qwen7b_2gpu.json"
python3 - "$OUT" <<'PY' | tee "$OUT/scaling.txt"
import json, sys
one, two = (json.load(open(f"{sys.argv[1]}/qwen7b_{n}gpu.json"))["result"] for n in (1, 2))
ratio = two["tokens_per_s"] / one["tokens_per_s"] if one.get("tokens_per_s") and two.get("tokens_per_s") else None
print(f"tokens/s: 1 GPU {one.get('tokens_per_s')}, 2 GPUs {two.get('tokens_per_s')}, ratio {ratio} (target >= 1.9)")
print(f"node host memory, 2 GPUs: PSS {two.get('host_node_pss_gib')} GiB, used {two.get('host_node_used_gib')} GiB; "
      f"1 GPU: PSS {one.get('host_node_pss_gib')} GiB (target: 2 GPUs about one store + 2 runtimes, ~112 GiB)")
PY
