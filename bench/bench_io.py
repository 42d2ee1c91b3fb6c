"""Load, save, resume and export at the disk's speed, and periodic saves through `megatrain train`: each beside the
disk's own rates, measured in the same call.

    python3 bench/bench_io.py --model bench/model-configs/qwen2.5-7b --layers 10 --dir /tmp/bench-io --json OUT.json

In order, on one host store of the model (random weights, bf16 streaming copy as a bf16 run's):
  sha256        the checkpoint's integrity check on its I/O threads (16 MiB chunks), GB/s
  disk          runtime/disk_probe.measure_disk at --dir: O_DIRECT, 8 x 16 MiB requests in flight (the SSD tier's
                way, what `megatrain train` measures at its start)
  save          CheckpointSaver: fp32 master, Adam m and v, 12 B/param (start to the renamed folder, fsynced)
  files_read    that checkpoint's files read back with O_DIRECT on the I/O threads, nothing checked or kept: the
                disk's read rate on these very files (what resume is at most; beside the probe's 8 GiB)
  (files_write, after the exports: the checkpoint's size of random bytes written the same way, nothing hashed:
                the disk's write rate over that size, what a save is at most)
  resume        checkpoint.resume.load_store of that checkpoint into the store (its pages evicted first)
  export_ckpt   `megatrain export CHECKPOINT` to bf16 (the checkpoint evicted first): reads the masters (4 B/param)
                and writes the bf16 (2 B/param); its GB/s are those written (as before), `moved_gb_per_s` the bytes
                read and written, `fraction_of_read_then_write` the time its reads then its writes would take at
                the disk's rates over its time
  export_store  the end of a run's export: bf16 from the store (writes 2 B/param)
  load_cold     pretrained bf16 safetensors (that export) into the store, its pages evicted (POSIX_FADV_DONTNEED)
  load_cached   the same files again, now in the page cache
Each result gives GB/s and the fraction of the disk's rate it is measured against (write for save and export from
the store, read for resume and the cold load, min(read, write) for the export of a checkpoint). --layers keeps the
first N layers of the config (the disk must hold one checkpoint: 12 B/param, and the export beside it).

Then (unless --no-train) periodic saves through the real command line: bench/bench_cli.py runs `megatrain train`
twice in --dir, the same --train-steps steps of --train-seqs x --train-seq tokens (random init, no compile), once
without checkpoints and once with checkpoint.every=--every (one save, after step --every, overlapping the steps
after it). `periodic` reports each step's wall time in both runs and their difference, the wall-time cost of the
save (the steps after it, summed, minus the same steps without it), the save's bytes and its rate (its manifest
written after its run state: the writer's seconds), and the issue's bound: max(0, bytes / the probe's write rate -
the step it overlaps (the run without saves' step time of step --every + 1)) + 5% of bytes / write rate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
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


def files_read(folder: Path, threads: int | None) -> tuple[int, float]:
    """Every file of `folder` read with O_DIRECT in CHUNK requests on the checkpoint's I/O pool: (bytes, seconds)."""
    from megatrain.checkpoint.fastio import CHUNK, Pool, wait_all
    from megatrain.runtime.pinned import PAGE

    def read(pool, fd: int, a: int, n: int) -> None:
        m = -(-n // PAGE) * PAGE
        if os.preadv(fd, [memoryview(pool.bounce()[:m].numpy())], a) < n:
            raise OSError(f"short read at {a}")
    fds, total = [], 0
    t0 = time.perf_counter()
    try:
        with Pool(threads) as pool:
            futures = []
            for p in sorted(Path(folder).glob("*.safetensors")):
                fds.append(os.open(p, os.O_RDONLY | os.O_DIRECT))
                size = p.stat().st_size
                total += size
                futures += [pool.submit(read, pool, fds[-1], a, min(CHUNK, size - a)) for a in range(0, size, CHUNK)]
            wait_all(pool, futures)
    finally:
        for fd in fds:
            os.close(fd)
    return total, time.perf_counter() - t0


def files_write(folder: Path, nbytes: int, threads: int | None) -> tuple[int, float]:
    """`nbytes` of random bytes written with O_DIRECT in CHUNK requests on the checkpoint's I/O pool, fsynced, into
    one file of `folder` (removed after): the disk's write rate over a checkpoint's size. (bytes, seconds)."""
    import threading

    from megatrain.checkpoint.fastio import CHUNK, Pool, wait_all

    filled = threading.local()

    def write(pool, fd: int, a: int) -> None:
        buf = pool.bounce()
        if not getattr(filled, "done", False):  # random, not zeros: a compressing disk would store zeros for nothing
            buf.random_(0, 256)
            filled.done = True
        os.pwritev(fd, [memoryview(buf.numpy())], a)
    n = max(1, nbytes // CHUNK)
    path = Path(folder) / "raw-write.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    t0 = time.perf_counter()
    try:
        with Pool(threads) as pool:
            wait_all(pool, [pool.submit(write, pool, fd, k * CHUNK) for k in range(n)])
        os.fsync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return n * CHUNK, seconds


def periodic(a, root: Path, write_bps: float, log) -> dict:
    """Two `megatrain train` runs through bench_cli.py, without and with checkpoint.every (see the docstring)."""
    runs = {}
    for name, extra in (("base", []), ("every", [f"checkpoint.every={a.every}"])):
        work, js = root / f"train-{name}", root / f"train-{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_cli.py"), "--model", a.model,
               "--seq", str(a.train_seq), "--seqs", str(a.train_seqs), "--micro", str(a.train_micro),
               "--warmup", "1", "--steps", str(a.train_steps - 1), "--device", a.train_device,
               "--workdir", str(work), "--json", str(js), "--label", f"io-{name}"]
        cmd += (["--layers", str(a.layers)] if a.layers else []) + [x for o in extra + a.set for x in ("--set", o)]
        log("running: " + " ".join(cmd))
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL if a.quiet_train else None).returncode
        res = json.loads(js.read_text())["result"] if js.is_file() else {}
        if rc or not res.get("steps"):
            raise SystemExit(f"bench_io: the {name} run failed (exit {rc}): {res.get('error', 'no result')}")
        runs[name] = {"steps": {r["step"]: r for r in res["steps"]}, "cli_total_s": res["cli_total_s"]}
        if name == "every":
            ckpt = work / "run" / "checkpoints" / f"step-{a.every}"
            t_start = (ckpt / "run_state.json").stat().st_mtime_ns
            runs[name]["save"] = {"bytes": size(ckpt), "seconds": ((ckpt / "manifest.json").stat().st_mtime_ns
                                                                   - t_start) / 1e9}
        shutil.rmtree(work, ignore_errors=True)
    base, every = runs["base"]["steps"], runs["every"]["steps"]
    steps = [{"step": k, "wall_s": base[k]["wall_s"], "wall_s_every": every[k]["wall_s"],
              "difference_s": every[k]["wall_s"] - base[k]["wall_s"], "step_time_s": base[k]["step_time_s"],
              "step_time_s_every": every[k]["step_time_s"]} for k in sorted(base) if k in every]
    save = runs["every"]["save"]
    disk_s = save["bytes"] / write_bps
    overlap = base[a.every + 1]["step_time_s"]
    cost = sum(r["difference_s"] for r in steps if r["step"] > a.every)
    out = {"every": a.every, "train_steps": a.train_steps, "steps": steps, "save_bytes": save["bytes"],
           "save_seconds": save["seconds"], "save_gb_per_s": save["bytes"] / save["seconds"] / 1e9,
           "save_fraction_of_write": save["bytes"] / save["seconds"] / write_bps, "save_at_write_rate_s": disk_s,
           "overlapped_step_s": overlap, "cost_s": cost, "bound_s": max(0.0, disk_s - overlap) + 0.05 * disk_s,
           "all_steps_difference_s": sum(r["difference_s"] for r in steps),
           "cli_total_difference_s": runs["every"]["cli_total_s"] - runs["base"]["cli_total_s"]}
    out["within_bound"] = out["cost_s"] <= out["bound_s"]
    for r in steps:
        log(f"  step {r['step']:3d}: wall {r['wall_s']:7.2f}s, with saves {r['wall_s_every']:7.2f}s "
            f"({r['difference_s']:+.2f}s)")
    log(f"periodic save after step {a.every}: {save['bytes'] / 1e9:.2f} GB in {save['seconds']:.1f}s "
        f"({out['save_gb_per_s']:.2f} GB/s, {out['save_fraction_of_write']:.0%} of the disk's write); wall-time cost "
        f"{cost:.1f}s (all steps {out['all_steps_difference_s']:+.1f}s, whole command "
        f"{out['cli_total_difference_s']:+.1f}s); bound max(0, {disk_s:.1f} - {overlap:.1f}) + 5% = "
        f"{out['bound_s']:.1f}s: {'within' if out['within_bound'] else 'ABOVE'}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--dir", default="/tmp/bench-io", help="folder on the disk measured")
    ap.add_argument("--probe-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=None, help="I/O threads (default: the code's)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-train", action="store_true", help="skip the periodic saves through megatrain train")
    ap.add_argument("--every", type=int, default=3, help="checkpoint.every of the run with saves")
    ap.add_argument("--train-steps", type=int, default=5, help="steps of each run (at least --every + 2)")
    ap.add_argument("--train-seq", type=int, default=1024)
    ap.add_argument("--train-seqs", type=int, default=158)
    ap.add_argument("--train-micro", type=int, default=79)
    ap.add_argument("--train-device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides of the runs")
    ap.add_argument("--quiet-train", action="store_true", help="hide the runs' output")
    a = ap.parse_args()
    if not a.no_train and a.train_steps < a.every + 2:
        ap.error("--train-steps must be at least --every + 2 (the save overlaps the steps after it)")
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
    record("files_read", *files_read(ckpt, a.threads), rd, "read")

    evict(ckpt)
    r = load_store(open_checkpoint(ckpt), store, threads=a.threads)
    record("resume", r["bytes"], r["seconds"], rd, "read")
    out["results"]["resume"]["fraction_of_files_read"] = \
        out["results"]["resume"]["gb_per_s"] / out["results"]["files_read"]["gb_per_s"]

    evict(ckpt)
    res = export_checkpoint(ckpt, root / "export-ckpt", dtype="bf16", threads=a.threads)
    record("export_ckpt", res["bytes"], res["seconds"], min(rd, wr), "min(read, write)")
    moved = 4 * store.num_params + res["bytes"]  # the masters read, the bf16 written
    x = out["results"]["export_ckpt"]
    x.update(read_bytes=4 * store.num_params, moved_gb_per_s=moved / res["seconds"] / 1e9,
             moved_fraction_of_disk=moved / res["seconds"] / min(rd, wr),
             fraction_of_read_then_write=(4 * store.num_params / rd + res["bytes"] / wr) / res["seconds"])
    log(f"{'':13s} read and written {moved / 1e9:.2f} GB: {x['moved_gb_per_s']:.2f} GB/s, "
        f"{x['moved_fraction_of_disk']:.0%} of min(read, write); its reads then its writes at the disk's rates would "
        f"take {x['fraction_of_read_then_write']:.0%} of its time")
    shutil.rmtree(root / "export-ckpt")

    res = export_store(store, ckpt, root / "export", dtype="bf16", threads=a.threads)
    record("export_store", res["bytes"], res["seconds"], wr, "write")
    ckpt_bytes = size(ckpt)
    shutil.rmtree(ckroot)  # room for nothing else: the disk holds the export only from here
    record("files_write", *files_write(root, ckpt_bytes, a.threads), wr, "write")
    out["results"]["save"]["fraction_of_files_write"] = \
        out["results"]["save"]["gb_per_s"] / out["results"]["files_write"]["gb_per_s"]

    model = root / "export"
    evict(model)
    r = store.load_safetensors(model, threads=a.threads, progress=False)
    record("load_cold", r["bytes"], r["seconds"], rd, "read")
    r = store.load_safetensors(model, threads=a.threads, progress=False)
    record("load_cached", r["bytes"], r["seconds"], rd, "read")
    shutil.rmtree(root, ignore_errors=True)
    del store, saver, r  # the runs below need the host memory
    gc.collect()
    out["command"] = "python3 bench/bench_io.py " + " ".join(sys.argv[1:])
    if os.environ.get("BENCH_REV"):  # a copy without .git: the revision it was copied from
        out["git"] = os.environ["BENCH_REV"]
    write_json(a.json, out)  # the I/O results kept whatever happens to the runs below
    if a.no_train:
        return 0
    root.mkdir(parents=True)
    try:
        out["periodic"] = periodic(a, root, wr, log)
    except (SystemExit, OSError, KeyError, ValueError) as e:
        out["periodic"] = {"error": str(e)}
        log(f"bench_io: periodic saves: {e}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    write_json(a.json, out)
    return 1 if "error" in out["periodic"] else 0


if __name__ == "__main__":
    sys.exit(main())
