# Written 2026-11-27 (session 29), for an nvidia-h100-x1 (~3 min): issue 16, the disk the SSD tier would use,
# measured three ways on the machine kind DESIGN.md's 1.2 / 1.6 GB/s come from: dd (O_DIRECT, 16 MiB requests, one
# in flight), `megatrain probe --disk` (the tier's way: 8 x 16 MiB O_DIRECT requests in flight, 8 GiB written then
# read back), and `megatrain plan` with memory.disk_path on this GPU machine, which measures 2 GiB at its start and
# plans Qwen2.5-14B 158 x 1024 in 128 GiB with the rates (the GPU-only path of planner/plan.run_profile).
SSD=/var/tmp/megatrain-ssd
mkdir -p $SSD
df -h /var/tmp | tee "$OUT/disk.txt"
TAIL=3 run_logged dd_write 60 dd if=/dev/zero of=$SSD/probe bs=16M count=256 oflag=direct conv=fsync
TAIL=3 run_logged dd_read 60 dd if=$SSD/probe of=/dev/null bs=16M iflag=direct
rm -f $SSD/probe
tail -n 1 "$OUT/dd_write.log" "$OUT/dd_read.log" >> "$OUT/disk.txt" && rm -f "$OUT"/dd_*.log  # (8 files come back)
TAIL=4 run_logged probe_disk 90 python3 -m megatrain probe --out "$OUT/profile.json" --disk $SSD --disk-gib 8 \
  --adam-params 16777216 --bandwidth-gib 0.25 --matmul 2048
TAIL=30 run_logged plan_ssd 90 python3 -m megatrain plan model.path=$PWD/$M/qwen2.5-14b train.device=cuda \
  train.micro_batch_size=79 train.grad_accum_steps=2 data.max_seq_len=1024 engine.compile=on \
  memory.host_budget_gb=128 memory.disk_path=$SSD checkpoint.every=0 checkpoint.at_end=false export.at_end=false
grep -n "SSD tier\|per step\|step time" "$OUT/plan_ssd.log"
rm -rf $SSD
