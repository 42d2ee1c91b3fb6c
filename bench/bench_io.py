"""Load, save, resume and export at the disk's speed: each beside the disk's own rates, measured in the same process.

    python3 bench/bench_io.py --model bench/model-configs/qwen2.5-7b --layers 10 --dir /tmp/bench-io --json OUT.json

In order, on one host store of the model (random weights, bf16 streaming copy as a bf16 run's):
  sha256        the checkpoint's integrity check on its I/O threads (16 MiB chunks), GB/s
  disk          runtime/disk_probe.measure_disk at --dir: O_DIRECT, 8 x 16 MiB requests in flight (the SSD tier's
                way, what `megatrain train` measures at its start)
  save          CheckpointSaver: fp32 master, Adam m and v, 12 B/param (start to the renamed folder, fsynced)
  resume        checkpoint.resume.load_store of that checkpoint into the store (its pages evicted first)
  export_ckpt   `megatrain export CHECKPOINT` to bf16 (the checkpoint evicted first); reads the masters, 4 B/param
  export_store  the end of a run's export: bf16 from the store (writes 2 B/param)
  load_cold     pretrained bf16 safetensors (that export) into the store, its pages evicted (POSIX_FADV_DONTNEED)
  load_cached   the same files again, now in the page cache
Each result gives GB/s and the fraction of the disk's rate it is measured against (write for save and export from
the store, read for resume and the cold load, min(read, write) for the export of a checkpoint). --layers keeps the
first N layers of the config (the disk must hold one checkpoint: 12 B/param, and the export beside it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import hf_config, write_json  # noqa: E402
from transformers import GenerationConfig  # noqa: E402,F401  (imported before the timings: the export uses it)
from megatrain.checkpoint import CheckpointSaver  # noqa: E402
from megatrain.checkpoint.export import export_checkpoint, export_store  # noqa: E402
from megatrain.checkpoint.resume import load_store, open_checkpoint  # noqa: E402
from megatrain.models import get_adapter  # noqa: E402
from megatrain.runtime.disk_probe import describe, measure_disk  # noqa: E402
from megatrain.runtime.store import HostStore  # noqa: E402


def evict(folder: Path) -> None:
    """Drop a folder's clean pages from the page cache (no root needed): the next read comes from the disk."""
    for p in Path(folder).rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def size(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def hash_rate(threads: int | None, nbytes: int = 4 << 30) -> float:
    """sha256 of 16 MiB chunks on the checkpoint's I/O threads (calibration.IO_HASH_BPS)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    from megatrain.checkpoint.fastio import CHUNK, io_threads

    buf = memoryview(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8).numpy())
    n = nbytes // CHUNK
    with ThreadPoolExecutor(io_threads(threads)) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda _: hashlib.sha256(buf).digest(), range(n)))
        return n * CHUNK / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--dir", default="/tmp/bench-io", help="folder on the disk measured")
    ap.add_argument("--probe-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=None, help="I/O threads (default: the code's)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = hf_config(a.model, num_hidden_layers=a.layers)
    root = Path(a.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    disk = measure_disk(root, int(a.probe_gib * 2**30), key="--dir")
    log(describe(disk))
    rd, wr = disk["read_bps"], disk["write_bps"]
    out_hash = hash_rate(a.threads)
    log(f"sha256 on the I/O threads: {out_hash / 1e9:.2f} GB/s")
    adapter = get_adapter(cfg)
    store = HostStore(adapter, torch.bfloat16)
    t0 = time.perf_counter()
    store.init_random(0, 0.02)
    for t in store.tiles:  # Adam states of a trained run (not zeros: a compressing disk would gain)
        t.exp_avg.copy_(t.master)
        t.exp_avg_sq.copy_(t.master).abs_()
    log(f"{store.num_params / 1e9:.2f}B params, store filled in {time.perf_counter() - t0:.1f}s")
    out = {"model": a.model, "layers": cfg.num_hidden_layers, "params": store.num_params, "disk": disk,
           "threads": a.threads, "sha256_bps": out_hash, "cpus": len(os.sched_getaffinity(0)), "results": {}}

    def record(name: str, nbytes: int, seconds: float, against: float, what: str) -> None:
        r = {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
             "fraction_of_disk": nbytes / seconds / against, "against": what}
        out["results"][name] = r
        log(f"{name:13s} {nbytes / 1e9:7.2f} GB in {seconds:6.1f}s: {r['gb_per_s']:.2f} GB/s, "
            f"{r['fraction_of_disk']:.0%} of the disk's {what} ({against / 1e9:.2f} GB/s)")

    ckroot = root / "checkpoints"
    saver = CheckpointSaver(ckroot, store, threads=a.threads)
    t0 = time.perf_counter()
    saver.save(1, {"step": 1, "loader": {}, "rng": {}, "config": {}}, lambda d: cfg.to_json_file(d / "config.json"))
    ckpt = saver.wait()
    record("save", size(ckpt), time.perf_counter() - t0, wr, "write")

    evict(ckpt)
    r = load_store(open_checkpoint(ckpt), store, threads=a.threads)
    record("resume", r["bytes"], r["seconds"], rd, "read")

    evict(ckpt)
    res = export_checkpoint(ckpt, root / "export-ckpt", dtype="bf16", threads=a.threads)
    record("export_ckpt", res["bytes"], res["seconds"], min(rd, wr), "min(read, write)")
    out["results"]["export_ckpt"]["read_bytes"] = 4 * store.num_params
    shutil.rmtree(root / "export-ckpt")

    res = export_store(store, ckpt, root / "export", dtype="bf16", threads=a.threads)
    record("export_store", res["bytes"], res["seconds"], wr, "write")
    shutil.rmtree(ckroot)  # room for nothing else: the disk holds the export only from here

    model = root / "export"
    evict(model)
    r = store.load_safetensors(model, threads=a.threads, progress=False)
    record("load_cold", r["bytes"], r["seconds"], rd, "read")
    r = store.load_safetensors(model, threads=a.threads, progress=False)
    record("load_cached", r["bytes"], r["seconds"], rd, "read")
    shutil.rmtree(root, ignore_errors=True)
    out["command"] = "python3 bench/bench_io.py " + " ".join(sys.argv[1:])
    if os.environ.get("BENCH_REV"):  # a copy without .git: the revision it was copied from
        out["git"] = os.environ["BENCH_REV"]
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
