pkill -f ninja; pkill -f nvcc; pkill -f deepspeed
ps -eo pcpu,nlwp,comm --sort=-pcpu | head -8 | tee $OUT/threads.txt
timeout 150 python3 - <<'PY' 2>&1 | tee -a $OUT/threads.txt
import torch
from megatrain.planner.probe import adamw_rate
for t in (8, 16, 32, 48, 56, 63, 64, 32, 64):
    torch.set_num_threads(t)
    r = [adamw_rate(1 << 27, torch.bfloat16) / 1e9 for _ in range(2)]
    print(f"threads {t:>2}: " + ", ".join(f"{x:.2f}" for x in r) + " Gparam/s", flush=True)
PY
