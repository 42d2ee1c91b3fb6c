"""A checkpoint -> a Hugging Face model directory that `AutoModelForCausalLM.from_pretrained` loads.

    OUT_DIR/model-0000k-of-0000n.safetensors   the fp32 masters cast to bf16 or kept fp32, sharded
    OUT_DIR/model.safetensors.index.json       tensor name -> shard
    OUT_DIR/config.json                        the model's config, dtype set to the export's
    OUT_DIR/generation_config.json             the model's, or one derived from config.json
    OUT_DIR/tokenizer files                    the run's tokenizer, data.chat_template included

Memory: the export streams, tensor by tensor, from the checkpoint's unit files into the shards. The shard layout
is planned from config.json before any tensor is read (so each shard's header is known up front), and only one
tensor in fp32 plus its cast copy is held at a time: far less than one layer of the host store. Every unit file
is checked against the checkpoint's sha256 as it is read. Tied embeddings export no lm_head.weight
(config.json's tie_word_embeddings makes transformers share it). The directory appears only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch

from .folder_lock import LOCK_FILE, FolderLock, holder
from .layout import locate, read_manifest, small_files, verify_file
from .tensorfile import TensorFileReader, TensorFileWriter, fsync_dir
from ..errors import MegatrainError, check_dir_target
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


class _ShardStream:
    """Writes tensors, arriving in plan order, into the planned shard files one after another."""

    def __init__(self, out: Path, shards: list[list], dtype: torch.dtype):
        self.out, self.shards, self.dtype = out, shards, dtype
        n = len(shards)
        self.names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self.weight_map: dict[str, str] = {}
        self._k, self._i, self._writer = 0, 0, None

    def put(self, name: str, t: torch.Tensor) -> None:
        if self._writer is None:
            plan = [(nm, self.dtype, shape) for nm, shape in self.shards[self._k]]
            self._writer = TensorFileWriter(self.out / self.names[self._k], plan, metadata={"format": "pt"})
        expected = self.shards[self._k][self._i][0]
        if name != expected:
            raise MegatrainError(f"export: checkpoint tensor '{name}' arrived where '{expected}' was planned")
        self._writer.write(t.to(self.dtype).contiguous())
        self.weight_map[name] = self.names[self._k]
        self._i += 1
        if self._i == len(self.shards[self._k]):
            self._writer.close()
            self._writer, self._k, self._i = None, self._k + 1, 0

    def done(self) -> bool:
        return self._k == len(self.shards)


def check_export_target(out: Path, replace_export: bool = False) -> None:
    """The export goes to a new or empty directory, or (replace_export) replaces an earlier export: never over
    anything else, and never where a file is in the way (`out` a file, or under one)."""
    out = Path(out).expanduser()
    check_dir_target(out, "export")
    if out.exists() and any(out.iterdir()) and not (replace_export and (out / INDEX).is_file()):
        raise MegatrainError(f"export: {out} is not empty; choose another directory")


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
                      replace_export: bool = False) -> dict:
    """Export the checkpoint `source` (a checkpoint, a run's checkpoints/ folder or its output.dir: the newest
    complete checkpoint) to `out_dir`. Returns {"path", "checkpoint", "shards", "bytes", "seconds"}.
    replace_export: out_dir may hold an earlier export, which is replaced (export.at_end of a resumed run)."""
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise MegatrainError(f"export: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    if not (isinstance(max_shard_mb, (int, float)) and math.isfinite(max_shard_mb) and max_shard_mb > 0):
        raise MegatrainError(f"export: the largest shard must be a finite number of MB above 0, got {max_shard_mb!r}")
    torch_dtype, dtype_name = DTYPES[dtype]
    ckpt = locate(Path(source), "export")
    manifest = read_manifest(ckpt)
    out = Path(out_dir).expanduser()
    check_export_target(out, replace_export)
    _check_outside_checkpoints(ckpt, out)
    verify_file(ckpt, manifest, "config.json")
    adapter = get_adapter(load_hf_config(ckpt))
    units = adapter.units()
    if len(units) != len(manifest["units"]):
        raise MegatrainError(f"{ckpt}: holds {len(manifest['units'])} units, its config.json implies {len(units)}")
    esize = torch.empty((), dtype=torch_dtype).element_size()
    specs = {s.hf_name: s for u in units for s in u.specs}
    shards = plan_shards([(n, s.part_shape) for s in specs.values() for n in s.checkpoint_names], esize,
                         max(1, int(max_shard_mb * 1e6)))

    tmp, lock = _partial_folder(out)
    try:
        stream = _ShardStream(tmp, shards, torch_dtype)
        for unit, u in zip(units, manifest["units"]):
            info = manifest["files"].get(u["file"])
            if info is None:
                raise MegatrainError(f"{ckpt / 'manifest.json'}: does not list {u['file']}")
            reader = TensorFileReader(ckpt / u["file"], info["bytes"])
            try:
                for name, _, _ in reader:
                    if name.startswith("master/"):  # one tensor at a time, split as the checkpoint stores it
                        spec = specs.get(name[len("master/"):])
                        if spec is None:
                            raise MegatrainError(f"{ckpt / u['file']}: holds '{name}', not part of this model")
                        for part_name, part in spec.split(reader.read()):
                            stream.put(part_name, part)
                reader.finish(info["sha256"])  # Adam states are skipped but still hashed
            finally:
                reader.close()
        if not stream.done():
            raise MegatrainError(f"{ckpt}: some tensors of the model are missing from its unit files")
        total = sum(esize * _numel(shape) for shard in shards for _, shape in shard)
        index = {"metadata": {"total_size": total, "megatrain_checkpoint": str(ckpt), "step": manifest["step"]},
                 "weight_map": stream.weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2))
        _write_configs(ckpt, manifest, tmp, adapter.hf_config, dtype_name)
        _copy_tokenizer(ckpt, manifest, tmp)
        (tmp / LOCK_FILE).unlink()  # the export holds model files only; the lock stays held on its descriptor
        for p in tmp.iterdir():
            if p.is_file() and not p.name.endswith(".safetensors"):  # shards were fsynced as written
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        lock.release()
    return {"path": out, "checkpoint": ckpt, "shards": len(shards), "bytes": total,
            "seconds": time.perf_counter() - t0}


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
