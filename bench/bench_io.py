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
  save_busy     the save again while a thread runs AdamW over the store's tiles with the optimizer's threads (torch's
                default, as in a run; --busy-threads also with others), no GPU: the writer's rate beside the
                optimizer's, and the optimizer's rate beside the writer's (`adamw_gparams_per_s`, alone:
                `adamw_alone_gparams_per_s`). A save's `io_threads_s` splits its I/O threads' seconds (summed) into
                gathering the bytes from the store, hashing, the disk's writes and fsync: which one grows when the
                optimizer runs beside it tells why a save is slower while training.
  save_gil      the save again beside a thread of pure Python (one core, holding the GIL as a run's main thread
                does between its waits), the process at Python's switch interval (5 ms), then at 0.5 ms
                (`save_gil_fast`): the I/O threads take the GIL back several times a chunk. The saver shortens the
                interval itself while it runs (runtime/gil.py), so the two should now match; a drop in `save_gil`
                says some of the save's work runs outside it.
Each result gives GB/s and the fraction of the disk's rate it is measured against (write for save and export from
the store, read for resume and the cold load, min(read, write) for the export of a checkpoint). --layers keeps the
first N layers of the config (the disk must hold one checkpoint: 12 B/param, and the export beside it).

(--only-load instead: a cold load into a store without Adam's moments, for a model this host cannot hold whole.)
(--probe-gib-b G: the disk probed again over G GiB, `disk_b`, and each rate also as a fraction of that one.)
Then (unless --no-train; --only-train: after the disk's probe, only these) periodic saves through the real command
line: bench/bench_cli.py runs `megatrain train` twice in --dir, the same --train-steps steps of --train-seqs x
--train-seq tokens (random init, no compile), once without checkpoints and once with checkpoint.every=--every (one
save, after step --every, overlapping the steps after it). `periodic` reports each step's wall time in both runs and
their difference, the wall-time cost of the save (the steps after it, summed, minus the same steps without it), the
save's bytes and its rate (its manifest written after its run state: the writer's seconds), and the issue's bound:
max(0, bytes / the probe's write rate - the step it overlaps (the run without saves' step time of step --every + 1))
+ 5% of bytes / write rate. `saver` is the save's own record (checkpoint/saver.py, through MEGATRAIN_SAVE_STATS):
the writer's seconds and its I/O threads' seconds per phase, the optimizer's waits on the writer (count, seconds,
seconds per step), the units and bytes staged, the staging pool's peak and limit (the plan's: half its host
headroom), the optimizer's seconds copying into it. `host_available_gib`: the host RAM free before the runs (this
process's store released first: the runs' plans bound the staging pool by it).
"""

from __future__ import annotations

import argparse
import functools
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
from pretrained_files import evict  # noqa: E402
from transformers import GenerationConfig  # noqa: E402,F401  (imported before the timings: the export uses it)
from megatrain.checkpoint import CheckpointSaver  # noqa: E402
from megatrain.checkpoint.export import export_checkpoint, export_store  # noqa: E402
from megatrain.checkpoint.resume import load_store, open_checkpoint  # noqa: E402
from megatrain.models import get_adapter  # noqa: E402
from megatrain.runtime.disk_probe import describe, measure_disk  # noqa: E402
from megatrain.runtime.store import HostStore  # noqa: E402


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


def adamw_loop(store, threads: int | None, stop, out: dict) -> None:
    """AdamW over the store's tiles (a zero gradient, one tile after another) until `stop` is set: the optimizer's
    load beside a save. out: params updated and seconds."""
    from megatrain.runtime.adamw import CpuAdamW

    if threads:
        torch.set_num_threads(threads)
    opt, grads, n, t0 = CpuAdamW((0.9, 0.95), 1e-8, 0.0), {}, 0, time.perf_counter()
    while not stop.is_set():
        for t in store.tiles:
            g = grads.setdefault(t.numel, torch.zeros(t.numel))
            opt.update(t, g, lr=0.0)
            n += t.numel
            if stop.is_set():
                break
    out.update(params=n, seconds=time.perf_counter() - t0)


def save_busy(store, root: Path, a, threads: int | None) -> dict:
    """A save while a thread runs AdamW with `threads` intra-op threads (None: torch's default); then AdamW alone for
    as long (at most 20 s). Returns the save's rate and phases and both AdamW rates."""
    import threading

    from megatrain.checkpoint.fastio import io_threads

    def adamw(seconds=None, until=None):
        stop, res = threading.Event(), {}
        worker = threading.Thread(target=adamw_loop, args=(store, threads, stop, res))
        worker.start()
        until() if until else time.sleep(seconds)
        stop.set()
        worker.join()
        return res["params"] / res["seconds"] / 1e9

    saver, took = CheckpointSaver(root / "busy", store, threads=a.threads), {}

    def save():
        t0 = time.perf_counter()
        saver.save(1, {"step": 1, "loader": {}, "rng": {}, "config": {}})
        took["path"], took["seconds"] = saver.wait(), time.perf_counter() - t0
    busy = adamw(until=save)
    nbytes = size(took["path"])
    shutil.rmtree(root / "busy")
    alone = adamw(seconds=min(took["seconds"], 20.0))
    return {"bytes": nbytes, "seconds": took["seconds"], "gb_per_s": nbytes / took["seconds"] / 1e9,
            "adamw_threads": threads or torch.get_num_threads(), "io_threads": io_threads(a.threads),
            "io_threads_s": saver.stats["io_threads_s"], "adamw_gparams_per_s": busy,
            "adamw_alone_gparams_per_s": alone}


def save_gil(store, root: Path, a, switch_s: float | None) -> dict:
    """A save beside a pure-Python thread (the GIL held but for Python's switches), with the switch interval
    `switch_s` (None: Python's)."""
    import threading

    stop, old = threading.Event(), sys.getswitchinterval()

    def hog():
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i
    saver, worker = CheckpointSaver(root / "gil", store, threads=a.threads), threading.Thread(target=hog)
    if switch_s:
        sys.setswitchinterval(switch_s)
    worker.start()
    try:
        t0 = time.perf_counter()
        saver.save(1, {"step": 1, "loader": {}, "rng": {}, "config": {}})
        path = saver.wait()
        seconds = time.perf_counter() - t0
    finally:
        stop.set()
        worker.join()
        sys.setswitchinterval(old)
    nbytes = size(path)
    shutil.rmtree(root / "gil")
    return {"bytes": nbytes, "seconds": seconds, "switch_interval_s": switch_s or old,
            "io_threads_s": saver.stats["io_threads_s"]}


def phases(st: dict) -> str:
    return ", ".join(f"{k[:-2]} {v:.1f}" for k, v in st.items())


def periodic(a, root: Path, write_bps: float, log) -> dict:
    """Two `megatrain train` runs through bench_cli.py, without and with checkpoint.every (see the docstring)."""
    from megatrain.planner.sysmem import host_memory

    runs, stats_file = {}, root / "save-stats.jsonl"
    avail = host_memory().available
    log(f"host RAM available before the runs: {avail / 2**30:.1f} GiB")
    for name, extra in (("base", []), ("every", [f"checkpoint.every={a.every}"])):
        if name == "every":
            os.environ["MEGATRAIN_SAVE_STATS"] = str(stats_file)  # the save's own record (checkpoint/saver.py)
        work, js = root / f"train-{name}", root / f"train-{name}.json"
        cmd = [sys.executable, str(Path(__file__).resolve().parent / "bench_cli.py"), "--model", a.model,
               "--seq", str(a.train_seq), "--seqs", str(a.train_seqs), "--micro", str(a.train_micro),
               "--warmup", "1", "--steps", str(a.train_steps - 1), "--device", a.train_device,
               "--workdir", str(work), "--json", str(js), "--label", f"io-{name}"]
        cmd += (["--layers", str(a.layers)] if a.layers else []) + [x for o in extra + a.set for x in ("--set", o)]
        log("running: " + " ".join(cmd))
        rc = subprocess.run(cmd, stdout=subprocess.DEVNULL if a.quiet_train else None).returncode
        os.environ.pop("MEGATRAIN_SAVE_STATS", None)
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
           "cli_total_difference_s": runs["every"]["cli_total_s"] - runs["base"]["cli_total_s"],
           "host_available_gib": avail / 2**30}
    out["within_bound"] = out["cost_s"] <= out["bound_s"]
    saves = [json.loads(x) for x in stats_file.read_text().splitlines()] if stats_file.is_file() else []
    out["saver"] = next((x for x in saves if x["step"] == a.every), None)
    for r in steps:
        log(f"  step {r['step']:3d}: wall {r['wall_s']:7.2f}s, with saves {r['wall_s_every']:7.2f}s "
            f"({r['difference_s']:+.2f}s)")
    log(f"periodic save after step {a.every}: {save['bytes'] / 1e9:.2f} GB in {save['seconds']:.1f}s "
        f"({out['save_gb_per_s']:.2f} GB/s, {out['save_fraction_of_write']:.0%} of the disk's write); wall-time cost "
        f"{cost:.1f}s (all steps {out['all_steps_difference_s']:+.1f}s, whole command "
        f"{out['cli_total_difference_s']:+.1f}s); bound max(0, {disk_s:.1f} - {overlap:.1f}) + 5% = "
        f"{out['bound_s']:.1f}s: {'within' if out['within_bound'] else 'ABOVE'}")
    st = out["saver"]
    if st:
        log(f"  the writer: {st['seconds']:.1f}s, its I/O threads' seconds {phases(st['io_threads_s'])}; the "
            f"optimizer waited {st['waits']} times, {st['wait_s']:.1f}s (by step: "
            f"{', '.join(f'{k}: {v:.1f}s' for k, v in st['wait_s_by_step'].items()) or 'none'}); staged "
            f"{st['staged_units']} units, {st['staged_bytes'] / 1e9:.2f} GB (peak {st['staged_peak_bytes'] / 1e9:.2f} "
            f"of {st['staging_limit_bytes'] / 1e9:.2f} GB allowed), copying {st['stage_copy_s']:.1f}s")
    return out


def record_rate(out: dict, log, name: str, nbytes: int, seconds: float, against: float, what: str) -> None:
    """One operation's bytes, seconds and GB/s into out['results'][name], beside the disk's rate `against`."""
    r = {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
         "fraction_of_disk": nbytes / seconds / against, "against": what}
    out["results"][name] = r
    longer = (out.get("disk_b") or {}).get(f"{what}_bps")  # the rate over the longer probe (--probe-gib-b)
    if longer:
        r["fraction_of_disk_b"] = nbytes / seconds / longer
    log(f"{name:13s} {nbytes / 1e9:7.2f} GB in {seconds:6.1f}s: {r['gb_per_s']:.2f} GB/s, "
        f"{r['fraction_of_disk']:.0%} of the disk's {what} ({against / 1e9:.2f} GB/s)" +
        (f", {r['fraction_of_disk_b']:.0%} of it over the longer probe ({longer / 1e9:.2f} GB/s)" if longer else ""))


def huge_pages_empty(numel: int, dtype: torch.dtype, zero: bool, what: str = "") -> torch.Tensor:
    """A flat tensor on 2 MiB boundaries advised to transparent huge pages (MADV_HUGEPAGE): the store's first touch
    then faults 2 MiB pages, not 4 KiB ones (the store's own allocator, pinned.aligned_empty, uses 4 KiB pages)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    es, huge = torch.empty((), dtype=dtype).element_size(), 2 << 20
    raw = torch.empty(numel + huge // es, dtype=dtype)
    buf = raw[(-raw.data_ptr() % huge) // es:][:numel]
    libc.madvise(buf.data_ptr(), numel * es // huge * huge, 14)  # MADV_HUGEPAGE; refused where THP is off
    return buf.zero_() if zero else buf


def load_only(a, cfg, root: Path, rd: float, out: dict, log) -> None:
    """--only-load: the model's pretrained bf16 safetensors (pretrained_files.write_weights) read cold into a store
    of the fp32 master and the bf16 streaming copy, 6 B/param, without Adam's moments: the loader of `megatrain
    train` (HostStore.load_safetensors) on a model whose whole store (14 B/param) this host cannot hold.
    Before it the files read with O_DIRECT (`files_read`: the disk over these files); beside it the cold load into a
    store on transparent huge pages (`load_cold_huge`: whether its first touch's faults hold the reads back; the
    two in the order A B B A, the second of each `_again`), or with --threads-b on that many I/O threads (after a
    first load, `load_first_touch`, that touches the host's memory once), then `load_cached` when host RAM holds
    the files' pages beside the store."""
    from pretrained_files import write_weights

    from megatrain.planner.sysmem import host_memory, meminfo

    model = root / "model"
    model.mkdir()
    cfg.to_json_file(model / "config.json")
    t0 = time.perf_counter()
    nbytes = write_weights(model)
    log(f"pretrained bf16 safetensors: {nbytes / 1e9:.2f} GB, {len(list(model.glob('*.safetensors')))} shards, "
        f"written in {time.perf_counter() - t0:.1f}s")
    evict(model)
    record_rate(out, log, "files_read", *files_read(model, a.threads), rd, "read")
    out.update(file_bytes=nbytes, store="fp32 master and bf16 streaming copy, no Adam m, v",
               thp=Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip())
    # A: the cold load as the code runs it; B: on huge pages, or on --threads-b I/O threads after a load that
    # touches the memory first
    pair = (("load_cold", None, a.threads), (f"load_cold_threads{a.threads_b}", None, a.threads_b) if a.threads_b
            else ("load_cold_huge", huge_pages_empty, a.threads))
    ways = (("load_first_touch", None, a.threads),) * bool(a.threads_b) + pair + pair[::-1]
    runs = len(ways)
    for k, (name, alloc, threads) in enumerate(ways):  # A B B A: neither gains from going first or last
        name += "_again" if k >= runs - 2 else ""
        t0 = time.perf_counter()
        store = HostStore(get_adapter(cfg), torch.bfloat16, adam_states=False, allocate=alloc)
        made = time.perf_counter() - t0
        evict(model)
        r = store.load_safetensors(model, threads=threads, progress=False)
        record_rate(out, log, name, r["bytes"], r["seconds"], rd, "read")
        huge = meminfo().get("AnonHugePages", 0) / 2**30
        out["results"][name].update(store_made_s=made, anon_huge_gib=huge)
        log(f"{'':13s} the store made in {made:.1f}s; AnonHugePages {huge:.1f} GiB")
        out["params"] = store.num_params
        if k < runs - 1:
            del store, r
            gc.collect()
    free = host_memory().available
    out["host_available_after_gib"] = free / 2**30
    if free > 1.1 * nbytes:
        store.load_safetensors(model, threads=a.threads, progress=False)  # the pages in the cache, then timed
        r = store.load_safetensors(model, threads=a.threads, progress=False)
        record_rate(out, log, "load_cached", r["bytes"], r["seconds"], rd, "read")
    else:
        log(f"load_cached skipped: {free / 2**30:.1f} GiB free beside the store, the files are {nbytes / 2**30:.1f}")
    shutil.rmtree(model)


def io_ops(a, cfg, root: Path, rd: float, wr: float, out: dict, log) -> None:
    """Every operation but the runs (the module's docstring), into out['results']; the store is freed after."""
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
    out.update(params=store.num_params, sha256_bps=out_hash)

    record = functools.partial(record_rate, out, log)

    ckroot = root / "checkpoints"
    saver = CheckpointSaver(ckroot, store, threads=a.threads)
    t0 = time.perf_counter()
    saver.save(1, {"step": 1, "loader": {}, "rng": {}, "config": {}}, lambda d: cfg.to_json_file(d / "config.json"))
    ckpt = saver.wait()
    record("save", size(ckpt), time.perf_counter() - t0, wr, "write")
    out["results"]["save"]["io_threads_s"] = saver.stats["io_threads_s"]
    log(f"{'':13s} its I/O threads' seconds: {phases(saver.stats['io_threads_s'])}")

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

    runs = []
    for k in range(a.export_repeats):  # the median of --export-repeats exports (a shared disk is noisy)
        if k:
            shutil.rmtree(root / "export")
        runs.append(export_store(store, ckpt, root / "export", dtype="bf16", threads=a.threads))
    res = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    record("export_store", res["bytes"], res["seconds"], wr, "write")
    out["results"]["export_store"]["runs_s"] = [r["seconds"] for r in runs]
    if len(runs) > 1:
        log(f"{'':13s} {len(runs)} exports (s): " + " ".join(f"{r['seconds']:.2f}" for r in runs))
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
    shutil.rmtree(model)
    for threads in [] if a.skip_busy else [None] + a.busy_threads:  # the room of one checkpoint again
        name = "save_busy" + (f"_{threads}" if threads else "")
        b = save_busy(store, root, a, threads)
        record(name, b["bytes"], b["seconds"], wr, "write")
        out["results"][name].update(b, fraction_of_save=b["gb_per_s"] / out["results"]["save"]["gb_per_s"])
        log(f"{'':13s} beside AdamW on {b['adamw_threads']} threads ({b['adamw_gparams_per_s']:.2f} Gparam/s, alone "
            f"{b['adamw_alone_gparams_per_s']:.2f}), {b['io_threads']} I/O threads: {phases(b['io_threads_s'])}")
    for name, switch in () if a.skip_busy else (("save_gil", None), ("save_gil_fast", 0.0005)):
        g = save_gil(store, root, a, switch)
        record(name, g["bytes"], g["seconds"], wr, "write")
        out["results"][name].update(g, fraction_of_save=out["results"][name]["gb_per_s"]
                                    / out["results"]["save"]["gb_per_s"])
        log(f"{'':13s} beside a Python thread, switch interval {g['switch_interval_s'] * 1e3:.1f} ms: "
            f"{phases(g['io_threads_s'])}")
    shutil.rmtree(root, ignore_errors=True)
    del store, saver, r  # the runs need the host memory
    gc.collect()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    ap.add_argument("--dir", default="/tmp/bench-io", help="folder on the disk measured")
    ap.add_argument("--probe-gib", type=float, default=8.0)
    ap.add_argument("--threads", type=int, default=None, help="I/O threads (default: the code's)")
    ap.add_argument("--threads-b", type=int, default=None,
                    help="--only-load: B of A B B A is the cold load on this many I/O threads (default: on huge pages)")
    ap.add_argument("--probe-gib-b", type=float, default=None,
                    help="a second probe of the disk over this many GiB (`disk_b`: the rate over a longer span)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--export-repeats", type=int, default=1, help="export_store this many times, the median kept")
    ap.add_argument("--skip-busy", action="store_true", help="skip save_busy and save_gil (a small CPU check)")
    ap.add_argument("--no-train", action="store_true", help="skip the periodic saves through megatrain train")
    ap.add_argument("--only-train", action="store_true", help="the disk's probe and the periodic saves only")
    ap.add_argument("--only-load", action="store_true",
                    help="the disk's probe and a cold load of pretrained files into a store without Adam's moments "
                         "only (load_only: a model whose whole store this host cannot hold)")
    ap.add_argument("--every", type=int, default=3, help="checkpoint.every of the run with saves")
    ap.add_argument("--train-steps", type=int, default=5, help="steps of each run (at least --every + 2)")
    ap.add_argument("--train-seq", type=int, default=1024)
    ap.add_argument("--train-seqs", type=int, default=158)
    ap.add_argument("--train-micro", type=int, default=79)
    ap.add_argument("--train-device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more overrides of the runs")
    ap.add_argument("--quiet-train", action="store_true", help="hide the runs' output")
    ap.add_argument("--busy-threads", type=int, action="append", default=[],
                    help="save_busy also with this many AdamW threads (repeatable)")
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
    out = {"model": a.model, "layers": cfg.num_hidden_layers, "disk": disk, "threads": a.threads,
           "cpus": len(os.sched_getaffinity(0)), "results": {}}
    if a.probe_gib_b:
        out["disk_b"] = measure_disk(root, int(a.probe_gib_b * 2**30), key="--dir")
        log(describe(out["disk_b"]))
    if a.only_load:
        load_only(a, cfg, root, rd, out, log)
        a.no_train = True
    elif not a.only_train:
        io_ops(a, cfg, root, rd, wr, out, log)
    out["command"] = "python3 bench/bench_io.py " + " ".join(sys.argv[1:])
    if os.environ.get("BENCH_REV"):  # a copy without .git: the revision it was copied from
        out["git"] = os.environ["BENCH_REV"]
    write_json(a.json, out)  # the I/O results kept whatever happens to the runs below
    if a.no_train:
        return 0
    root.mkdir(parents=True, exist_ok=True)
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
