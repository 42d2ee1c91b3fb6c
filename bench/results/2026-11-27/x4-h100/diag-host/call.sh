cp /tmp/onegpu/qwen14b_ds.log $OUT/ 2>/dev/null; tail -n 8 /tmp/onegpu/qwen14b_ds.log
pkill -f chain.sh; pkill -f bench_deepspeed; sleep 3
{ nproc; lscpu | grep -E "Model name|Socket|NUMA|MHz|Thread"; numactl -H 2>/dev/null | head -4; grep -E "MemTotal|MemFree|Shmem:|AnonHuge" /proc/meminfo; cat /proc/pressure/memory /proc/pressure/cpu 2>/dev/null; uptime; } 2>&1 | tee $OUT/host.txt
timeout 150 python3 - <<'PY' 2>&1 | tee -a $OUT/host.txt
import time, torch
from megatrain.planner.probe import adamw_rate
print("torch threads", torch.get_num_threads())
for i in range(3):
    print(f"adamw_rate 2^27 bf16 #{i}: {adamw_rate(1 << 27, torch.bfloat16) / 1e9:.2f} Gparam/s", flush=True)
# first touch vs re-touch of fresh host memory, 48 GiB
n = 12 << 30
t0 = time.perf_counter(); x = torch.empty(n, dtype=torch.float32); x.fill_(1.0); t1 = time.perf_counter()
x.fill_(2.0); t2 = time.perf_counter()
print(f"48 GiB first touch {48 / (t1 - t0):.1f} GB/s, second pass {48 / (t2 - t1):.1f} GB/s", flush=True)
del x
print(f"adamw_rate after: {adamw_rate(1 << 27, torch.bfloat16) / 1e9:.2f} Gparam/s")
PY
