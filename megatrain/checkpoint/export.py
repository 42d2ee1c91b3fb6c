"""A checkpoint -> a Hugging Face model directory that `AutoModelForCausalLM.from_pretrained` loads.

    OUT_DIR/model-0000k-of-0000n.safetensors   the fp32 masters cast to bf16 or kept fp32, sharded
    OUT_DIR/model.safetensors.index.json       tensor name -> shard
    OUT_DIR/config.json                        the model's config, dtype set to the export's
    OUT_DIR/generation_config.json             the model's, or one derived from config.json
    OUT_DIR/tokenizer files                    the run's tokenizer, data.chat_template included

Two sources: a checkpoint (`megatrain export`), and the host store at the end of a run (`export_store`: the
weights are in RAM already, config.json and the tokenizer come from the run's final checkpoint). The shard layout
is planned from config.json before any tensor is read, so every shard is opened with its header written and each
tensor has a known offset: a pool of threads (fastio.Pool) casts tensors fp32 -> bf16 and writes them at their
offsets, several shards at once; the files are the bytes one writer would write, fsynced at the end.

Memory: from a checkpoint, one unit's fp32 master at a time (read in parallel chunks, each checked against the
manifest; chunks holding only Adam states are not read), and the casts of the tensors being written: within one
layer of the host store. From the store, only the casts in flight (one tensor per thread). Tied embeddings export
no lm_head.weight (config.json's tie_word_embeddings makes transformers share it). The directory appears only when
complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import torch

from .folder_lock import LOCK_FILE, FolderLock, holder, removed_while_read
from .layout import locate, read_manifest, small_files, verify_file
from .fastio import CHUNK, ChunkReader, ChunkWriter, Pool, byte_view, direct_ok, wait_all
from .export_stream import write_from_checkpoint
from .resume import unit_segments
from .tensorfile import TensorFileReader, fsync_dir, header_bytes
from ..runtime.disk_files import transfer
from ..errors import SIBLING_SPARE, MegatrainError, check_dir_target, user_path
from ..models import get_adapter, load_hf_config

INDEX = "model.safetensors.index.json"
DTYPES = {"bf16": (torch.bfloat16, "bfloat16"), "fp32": (torch.float32, "float32")}


def plan_shards(tensors: list[tuple[str, tuple[int, ...]]], esize: int, max_bytes: int) -> list[list]:
    """Consecutive tensors per shard, each shard at most max_bytes (a larger tensor gets a shard of its own)."""
    shards, cur, size = [], [], 0
    for name, shape in tensors:
        n = esize
        for s in shape:
            n *= s
        if cur and size + n > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    if cur:
        shards.append(cur)
    return shards


class _Shards:
    """Every planned shard opened at once, its header written; each tensor, cast to the export's dtype by a task of
    the pool, is written at its planned offset: tensors of several shards are converted and written at once, in any
    order, and the files are the bytes a single writer would write. `finish` fsyncs them all."""

    def __init__(self, out: Path, shards: list[list], dtype: torch.dtype):
        self.dtype, n = dtype, len(shards)
        self.names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.where: dict[str, tuple[int, int, tuple]] = {}
        self.fds: list[int] = []
        esize = torch.empty((), dtype=dtype).element_size()
        for k, shard in enumerate(shards):
            head = header_bytes([(nm, dtype, shape) for nm, shape in shard], {"format": "pt"})
            self.fds.append(os.open(out / self.names[k], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
            transfer(self.fds[-1], memoryview(head), 0, True)
            off = len(head)
            for nm, shape in shard:
                self.where[nm] = (k, off, tuple(shape))
                off += esize * _numel(shape)
        self.weight_map = {nm: self.names[k] for nm, (k, _, _) in self.where.items()}
        self.written: set[str] = set()

    def put(self, pool: Pool, name: str, t: torch.Tensor) -> list[Future]:
        if name not in self.where:
            raise MegatrainError(f"export: tensor '{name}' is not among the planned ones")
        k, off, shape = self.where[name]
        if tuple(t.shape) != shape:
            raise MegatrainError(f"export: tensor '{name}' is {list(t.shape)}, config.json implies {list(shape)}")
        self.written.add(name)
        flat, e = t.reshape(-1), self.dtype.itemsize

        def convert_write(a: int, b: int):  # fp32 -> bf16 here, on the pool's threads, a piece at a time
            c = flat[a:b].to(self.dtype).contiguous()
            transfer(self.fds[k], memoryview(byte_view(c).numpy()), off + a * e, True)
        step = max(1, CHUNK // e)
        return [pool.submit(convert_write, a, min(a + step, flat.numel())) for a in range(0, flat.numel(), step)]

    def finish(self, pool: Pool) -> None:
        missing = sorted(set(self.where) - self.written)
        if missing:
            raise MegatrainError(f"export: tensor '{missing[0]}' of the model was not found in the source")
        wait_all(pool, [pool.submit(os.fsync, fd) for fd in self.fds])

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def check_export_target(out: Path, run_checkpoints: Path | None = None) -> Path:
    """The folder an export writes (a symbolic link: the folder it points to). It goes to a new or empty folder,
    or replaces an earlier export of the run whose checkpoints folder is `run_checkpoints` (export.at_end of a run
    started again): never over anything else, and never where a file is in the way (`out` a file, or under one)."""
    out = user_path(out, "export", SIBLING_SPARE)
    if out.is_symlink():  # replaced by a rename beside the folder it points to, the link kept
        out = out.resolve()
    check_dir_target(out, "export")
    if out.exists() and any(out.iterdir()) and not (run_checkpoints and is_export_of(out, run_checkpoints)):
        raise MegatrainError(f"export: {out} is not empty; choose another directory")
    return out


def is_export_of(folder: Path, run_checkpoints: Path) -> bool:
    """Whether `folder` is an export megatrain wrote that holds nothing else (its index lists the files it wrote),
    from a checkpoint in `run_checkpoints` or in that run's own folder (`export/` beside it: a run folder moved
    since): the one folder export.at_end may replace."""
    try:
        meta = json.loads((folder / INDEX).read_text()).get("metadata", {})
        source, files = Path(meta["megatrain_checkpoint"]), set(meta["megatrain_files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    ckpts = Path(run_checkpoints).resolve()
    if source.parent.resolve() != ckpts and folder.resolve() != ckpts.parent / "export":
        return False
    return all(not p.is_symlink() and p.name in files for p in folder.iterdir())


def _check_outside_checkpoints(ckpt: Path, out: Path) -> None:
    """The export is not the checkpoint, inside it, nor among its siblings in a run's checkpoints/ folder (a later
    save's clean-up would remove it, or it would replace the source while reading it)."""
    c, o = ckpt.resolve(), out.resolve()
    if o == c or c in o.parents or o in c.parents:
        raise MegatrainError(f"export: {out} overlaps the checkpoint {ckpt} it is exported from; choose a folder "
                             f"outside it")
    if c.parent.name == "checkpoints" and c.parent in o.parents:
        raise MegatrainError(f"export: {out} lies inside the run's checkpoints folder {c.parent}, where saves "
                             f"replace and remove folders; choose a folder outside it")


def export_checkpoint(source: str | Path, out_dir: str | Path, *, dtype: str = "bf16", max_shard_mb: float = 5000,
                      replace_export: bool = False, threads: int | None = None) -> dict:
    """Export the checkpoint `source` (a checkpoint, a run's checkpoints/ folder or its output.dir: the newest
    complete checkpoint) to `out_dir`. Returns {"path", "checkpoint", "shards", "bytes", "seconds"}.
    replace_export: out_dir may hold an earlier export from the same run (its checkpoints folder: the source's), which
    is replaced (export.at_end of a run started again; see check_export_target).
    threads: I/O and conversion threads (default fastio.THREADS, at most the cores)."""
    ckpt = locate(user_path(source, "export"), "export")
    try:
        return _export_checkpoint(ckpt, out_dir, dtype, max_shard_mb, replace_export, threads)
    except (MegatrainError, OSError):
        if ckpt.is_dir():
            raise
        raise removed_while_read(ckpt, "export", f"export {ckpt.parent.parent} again (its newest checkpoint)") \
            from None


def _export_checkpoint(ckpt: Path, out_dir, dtype: str, max_shard_mb, replace_export: bool, threads) -> dict:
    t0 = time.perf_counter()
    torch_dtype, dtype_name, ckpt, manifest, out, adapter, units, specs, shards = _prepare(
        ckpt, out_dir, dtype, max_shard_mb, replace_export)
    if len(units) != len(manifest["units"]):
        raise MegatrainError(f"{ckpt}: holds {len(manifest['units'])} units, its config.json implies {len(units)}")

    infos = [manifest["files"].get(u["file"]) or {} for u in manifest["units"]]
    if all("sha256_chunks" in i for i in infos):  # chunked checksums: reads, casts and writes pipelined
        return _export(None, out, shards, torch_dtype, dtype_name, ckpt, manifest, adapter, specs, t0, threads,
                       units, ckpt_units=True)

    def masters(pool: Pool):  # one sha256 per file: one unit's fp32 master at a time, read and verified
        # into one buffer, reused unit after unit (each unit's writes end before the next is read): a buffer
        # allocated and freed per unit would leave the allocator's freed memory behind, above one unit's
        buf = torch.empty(max(u.numel for u in units), dtype=torch.float32)
        for unit, u in zip(units, manifest["units"]):
            info = manifest["files"].get(u["file"])
            if info is None:
                raise MegatrainError(f"{ckpt / 'manifest.json'}: does not list {u['file']}")
            yield unit, _read_master(ckpt / u["file"], info, unit, pool, buf[:unit.numel])

    return _export(masters, out, shards, torch_dtype, dtype_name, ckpt, manifest, adapter, specs, t0, threads, True)


def _prepare(source, out_dir, dtype: str, max_shard_mb, replace_export: bool):
    """The checks made before anything is written, the checkpoint's manifest and model, and the shard plan."""
    if dtype not in DTYPES:
        raise MegatrainError(f"export: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    if isinstance(max_shard_mb, bool) or not (isinstance(max_shard_mb, (int, float)) and math.isfinite(max_shard_mb)
                                              and max_shard_mb > 0):
        raise MegatrainError(f"export: the largest shard must be a finite number of MB above 0, got {max_shard_mb!r}")
    torch_dtype, dtype_name = DTYPES[dtype]
    ckpt = locate(Path(source), "export")
    manifest = read_manifest(ckpt)
    out = check_export_target(out_dir, ckpt.parent if replace_export else None)
    _check_outside_checkpoints(ckpt, out)
    verify_file(ckpt, manifest, "config.json")
    adapter = get_adapter(load_hf_config(ckpt))
    units = adapter.units()
    esize = torch.empty((), dtype=torch_dtype).element_size()
    specs = {s.hf_name: s for u in units for s in u.specs}
    shards = plan_shards([(n, s.part_shape) for s in specs.values() for n in s.checkpoint_names], esize,
                         max(1, int(max_shard_mb * 1e6)))
    return torch_dtype, dtype_name, ckpt, manifest, out, adapter, units, specs, shards


def export_store(store, ckpt: str | Path, out_dir: str | Path, *, dtype: str = "bf16", max_shard_mb: float = 5000,
                 replace_export: bool = False, threads: int | None = None) -> dict:
    """Export the weights in the host store (the state of checkpoint `ckpt`, which supplies config.json, the
    generation config and the tokenizer): the end of a run, without reading the weights back from disk."""
    t0 = time.perf_counter()
    torch_dtype, dtype_name, ckpt, manifest, out, adapter, units, specs, shards = _prepare(
        ckpt, out_dir, dtype, max_shard_mb, replace_export)
    if [u.name for u in units] != [t.unit.name for t in store.tiles]:
        raise MegatrainError(f"export: the store's units differ from those of {ckpt}'s config.json")

    if "master" not in store.on_disk:
        return _export(None, out, shards, torch_dtype, dtype_name, ckpt, manifest, adapter, specs, t0, threads,
                       store.tiles)

    def masters(pool: Pool):
        for i, t in enumerate(store.tiles):
            with store.unit_state(i, ("master",)) as st:  # a master on the SSD tier: staged one unit at a time
                yield t.unit, st["master"].clone()

    return _export(masters, out, shards, torch_dtype, dtype_name, ckpt, manifest, adapter, specs, t0, threads, False)


def _read_master(path: Path, info: dict, unit, pool: Pool, m: torch.Tensor) -> torch.Tensor:
    """The unit's fp32 master from its checkpoint file into `m` (unit.numel elements)."""
    dest = {f"master/{sp.hf_name}": v for sp, v in zip(unit.specs, unit.views(m).values())}
    if "sha256_chunks" in info:  # only the chunks holding masters are read (each verified); Adam states are not
        kinds = {f"{k}/{sp.hf_name}": None for k in ("exp_avg", "exp_avg_sq") for sp in unit.specs}
        segs = unit_segments(path, info, {**dest, **kinds, "step": None}, unit.name)
        reader = ChunkReader(path, info, segs, skip_unused=True)
        try:
            wait_all(pool, reader.submit(pool))  # every chunk done or skipped: its file may be closed
        finally:
            reader.close()
        return m
    reader = TensorFileReader(path, info["bytes"])  # a checkpoint with one sha256 per file: one pass
    try:
        for name, _, _ in reader:
            if name.startswith("master/"):
                if name not in dest:
                    raise MegatrainError(f"{path}: holds '{name}', not part of this model")
                reader.read_into(dest.pop(name))
        reader.finish(info["sha256"])  # Adam states are skipped but still hashed
    finally:
        reader.close()
    if dest:
        raise MegatrainError(f"{path}: tensor '{next(iter(dest))}' is missing")
    return m


def _export(masters, out, shards, torch_dtype, dtype_name, ckpt, manifest, adapter, specs, t0, threads, per_unit,
            ckpt_units: bool = False):
    """The shards from `masters(pool)` ((unit, its flat fp32 master) in order); per_unit: wait for a unit's writes
    before the next unit is produced (its master is a buffer read from a checkpoint: memory stays one unit).
    masters None: from the store's tiles `per_unit` (all in RAM), cast chunk by chunk into O_DIRECT writes; with
    ckpt_units, from the checkpoint's files, `per_unit` its units (export_stream.py)."""
    esize = torch.empty((), dtype=torch_dtype).element_size()
    tmp, lock = _partial_folder(out)
    try:
        if masters is None and ckpt_units:
            stream = _Shards(tmp, shards, torch_dtype)
            try:
                write_from_checkpoint(ckpt, manifest, per_unit, stream, threads)
            finally:
                stream.close()
            weight_map = stream.weight_map
        elif masters is None:
            weight_map = _write_from_ram(tmp, per_unit, shards, torch_dtype, specs, threads)
        else:
            weight_map = _write_streamed(tmp, masters, shards, torch_dtype, specs, threads, per_unit)
        total = sum(esize * _numel(shape) for shard in shards for _, shape in shard)
        _write_configs(ckpt, manifest, tmp, adapter.hf_config, dtype_name)
        _copy_tokenizer(ckpt, manifest, tmp)
        (tmp / LOCK_FILE).unlink()  # the export holds model files only; the lock stays held on its descriptor
        files = sorted([p.name for p in tmp.iterdir()] + [INDEX])  # (what a later export.at_end may replace)
        index = {"metadata": {"total_size": total, "megatrain_checkpoint": str(ckpt.resolve()),
                              "step": manifest["step"], "megatrain_files": files}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
        for p in tmp.iterdir():
            if p.is_file() and not p.name.endswith(".safetensors"):  # shards were fsynced as written
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except OSError as e:  # the disk full, a quota, a folder made read-only meanwhile: nothing exported, the source kept
        shutil.rmtree(tmp, ignore_errors=True)
        raise MegatrainError(f"export: writing {out} failed ({e.strerror or e}); nothing was exported and "
                             f"{ckpt} is unchanged: make room in {out.parent} and export again "
                             f"(`megatrain export {ckpt} {out}`)") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
    return {"path": out, "checkpoint": ckpt, "shards": len(shards), "bytes": total,
            "seconds": time.perf_counter() - t0}


def _write_streamed(tmp: Path, masters, shards, torch_dtype, specs, threads, per_unit) -> dict:
    stream = _Shards(tmp, shards, torch_dtype)
    try:
        with Pool(threads) as pool:
            futures = []
            for unit, master in masters(pool):
                for sp, view in zip(unit.specs, unit.views(master).values()):
                    if sp.hf_name not in specs:
                        raise MegatrainError(f"export: {unit.name} holds '{sp.hf_name}', not part of this model")
                    futures += [f for n, part in sp.split(view) for f in stream.put(pool, n, part)]
                if per_unit:
                    wait_all(pool, futures)
                    futures = []
                master = view = None  # (a checkpoint's unit buffer is freed before the next one is read)
            wait_all(pool, futures)
            stream.finish(pool)
    finally:
        stream.close()
    return stream.weight_map


def _write_from_ram(tmp: Path, tiles, shards, torch_dtype, specs, threads) -> dict:
    """Every shard a ChunkWriter whose parts are the store's fp32 tensors, cast into each chunk's buffer: the
    casts and the O_DIRECT writes of all shards run on the pool at once, no copy of a tensor is made. Each shard is
    preallocated (fastio.preallocate) and the chunks are queued shard after shard in turn, so the requests in
    flight spread over every file instead of waiting on one file's lock."""
    src = {}
    for t in tiles:
        for sp, view in zip(t.unit.specs, t.unit.views(t.master).values()):
            if sp.hf_name not in specs:
                raise MegatrainError(f"export: {t.unit.name} holds '{sp.hf_name}', not part of this model")
            src.update((n, part.reshape(-1)) for n, part in sp.split(view))
    n = len(shards)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    direct, writers = direct_ok(tmp), []
    try:
        with Pool(threads) as pool:
            futures = []
            for name, shard in zip(names, shards):
                missing = next((nm for nm, _ in shard if nm not in src), None)
                if missing is not None:
                    raise MegatrainError(f"export: tensor '{missing}' of the model was not found in the store")
                head = header_bytes([(nm, torch_dtype, shape) for nm, shape in shard], {"format": "pt"})
                parts = [torch.frombuffer(bytearray(head), dtype=torch.uint8)]
                writers.append(ChunkWriter(tmp / name, parts + [(src[nm], torch_dtype) for nm, _ in shard], direct,
                                           checksums=False))  # no manifest lists an export's files
            for k in range(max(w.n for w in writers)):  # the shards' chunks in turn: every file has writes in flight
                futures += [f for w in writers if k < w.n for f in w.submit(pool, [k])]
            wait_all(pool, futures)
    finally:
        for w in writers:
            w.close()
    return {nm: name for name, shard in zip(names, shards) for nm, _ in shard}


def _partial_folder(out: Path) -> tuple[Path, FolderLock]:
    """`.NAME.partial` beside the target, created empty and locked (flock) while this export writes it: an
    earlier export's leftover (killed) is removed, one still being written is refused, and a file of that name
    that is not ours is named rather than replaced. Returns the folder and its lock, held until released."""
    tmp = out.parent / f".{out.name}.partial"
    if tmp.is_symlink() or (tmp.exists() and not tmp.is_dir()):
        raise MegatrainError(f"export: {tmp} is in the way (the export writes its shards there before renaming "
                             f"it to {out}); move or remove it")
    if tmp.is_dir():
        if (who := holder(tmp)) is not None:
            raise MegatrainError(f"export: another export is writing {out} ({who}); wait for it to end")
        if not (tmp / LOCK_FILE).is_file():  # not what a killed export leaves (its lock file in it)
            raise MegatrainError(f"export: {tmp} is in the way (the export writes its shards there before renaming "
                                 f"it to {out}) and is not an interrupted export's; move or remove it")
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp, FolderLock(tmp, "export").acquire()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_configs(ckpt: Path, manifest: dict, out: Path, hf_config, dtype_name: str) -> None:
    raw = json.loads((ckpt / "config.json").read_text())  # verified above; kept as written, unknown keys too
    raw.pop("torch_dtype", None)
    raw.pop("quantization_config", None)  # the export holds full-precision weights (MXFP4 experts dequantized)
    raw["dtype"] = dtype_name
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if "generation_config.json" in manifest["files"]:
        shutil.copyfile(verify_file(ckpt, manifest, "generation_config.json"), out / "generation_config.json")
    else:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(hf_config).save_pretrained(str(out))


def _copy_tokenizer(ckpt: Path, manifest: dict, out: Path) -> None:
    for name in small_files(manifest):
        if name.startswith("tokenizer/"):
            dest = out / name[len("tokenizer/"):]
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(verify_file(ckpt, manifest, name), dest)
