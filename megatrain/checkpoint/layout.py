"""Where a checkpoint's files are, which checkpoints are complete, and reading their manifests and small files.

    output.dir/checkpoints/
        step-N/                               a complete checkpoint (it is renamed into place only when complete)
            manifest.json                     sha256 and size of every other file; written last
            run_state.json                    step, LR schedule, data sampler position, RNG states, config, versions
            config.json                       the model's Hugging Face config (generation_config.json if it had one)
            tokenizer/                        the run's tokenizer, data.chat_template applied
            unit-00000-embed.safetensors      per unit, in forward order: master/<hf name>, exp_avg/<hf name>,
            unit-00001-layer0.safetensors       exp_avg_sq/<hf name> (all fp32) and the unit's Adam `step`
            ...
        .step-N.tmp/                          a save in progress (or killed): never read, removed by the next save
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import MegatrainError, escape_problem
from .tensorfile import sha256_file

MANIFEST = "manifest.json"
RUN_STATE = "run_state.json"
FORMAT = "megatrain-checkpoint"
STEP_DIR = re.compile(r"^step-(\d+)$")


def unit_file_name(i: int, unit) -> str:
    tag = f"layer{unit.index}" if unit.kind == "layer" else unit.kind
    return f"unit-{i:05d}-{tag}.safetensors"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / MANIFEST).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def newest_checkpoint(root: Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def locate(path: Path, what: str) -> Path:
    """A checkpoint directory from a checkpoint, a run's `checkpoints/` folder, or a run's output.dir."""
    p = Path(path).expanduser()
    if not p.exists():
        raise MegatrainError(f"{what}: {p} does not exist")
    if not p.is_dir():
        raise MegatrainError(f"{what}: {p} is a file; expected a checkpoint directory (step-N) or a run's output.dir")
    if (p / MANIFEST).is_file():
        return p
    if STEP_DIR.match(p.name) and p.is_dir():
        raise MegatrainError(f"{what}: {p} has no {MANIFEST}: it is not a complete checkpoint")
    for root in (p / "checkpoints", p):
        newest = newest_checkpoint(root)
        if newest is not None:
            return newest
    raise MegatrainError(f"{what}: {p} holds no complete checkpoint (a step-N directory with {MANIFEST}, "
                         f"or a run directory with checkpoints/step-N)")


def read_manifest(ckpt: Path) -> dict:
    f = Path(ckpt) / MANIFEST
    try:
        m = json.loads(f.read_text())
    except FileNotFoundError:
        raise MegatrainError(f"{f} is missing: {ckpt} is not a complete checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MegatrainError(f"{f}: malformed checkpoint manifest ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT or not isinstance(m.get("files"), dict) \
            or not isinstance(m.get("units"), list):
        raise MegatrainError(f"{f}: not a megatrain checkpoint manifest")
    # every name the manifest gives is read (resume, export) and some are written under another folder (export's
    # tokenizer files): each must stay inside the checkpoint
    names = [("files", n) for n in m["files"]] + [("units", u.get("file") if isinstance(u, dict) else None)
                                                   for u in m["units"]]
    for where, name in names:
        problem = escape_problem(name)
        if problem is not None:
            raise MegatrainError(f"{f}: {where} entry {problem.replace('its folder', 'the checkpoint')}")
        if where == "units" and name not in m["files"]:
            raise MegatrainError(f"{f}: unit file '{name}' is not listed among its files")
    for name, info in m["files"].items():
        if (problem := entry_problem(info)) is not None:
            raise MegatrainError(f"{f}: the entry of {name} {problem}")
    step = m.get("step")
    if not _whole(step):
        raise MegatrainError(f"{f}: 'step' is missing or not a whole number >= 0")
    if (named := STEP_DIR.match(Path(ckpt).name)) and int(named.group(1)) != step:
        raise MegatrainError(f"{f}: the checkpoint of step {step} sits in a folder named {Path(ckpt).name}; "
                             f"rename it step-{step} (resume and clean-up order checkpoints by their names)")
    return m


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def entry_problem(info) -> str | None:
    """Why a manifest's file entry cannot be checked (None: it can): bytes, and a sha256 or per-chunk sha256s with
    the chunk size, one checksum per chunk."""
    if not isinstance(info, dict):
        return "is not an object"
    if not _whole(info.get("bytes")):
        return "has no 'bytes' (a whole number)"
    if "sha256_chunks" not in info:
        return None if isinstance(info.get("sha256"), str) else "has no 'sha256' (a string)"
    chunk, sums = info.get("chunk_bytes"), info["sha256_chunks"]
    if not _whole(chunk) or chunk == 0:
        return "has no 'chunk_bytes' (a whole number above 0)"
    if not (isinstance(sums, list) and all(isinstance(x, str) for x in sums)) or \
            len(sums) != max(1, -(-info["bytes"] // chunk)):
        return f"does not list one sha256 per chunk of {chunk} bytes ('sha256_chunks')"
    return None


def verify_file(ckpt: Path, manifest: dict, name: str) -> Path:
    """Check one listed file's size and sha256; returns its path. Errors name the file."""
    info = manifest["files"].get(name)
    path = Path(ckpt) / name
    if info is None:
        raise MegatrainError(f"{Path(ckpt) / MANIFEST}: does not list {name}")
    if not path.is_file():
        raise MegatrainError(f"{path}: checkpoint file is missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise MegatrainError(f"{path}: truncated or altered: {size} bytes, the manifest says {info['bytes']}")
    if "sha256_chunks" in info:  # a unit file: one sha256 per chunk, checked in parallel
        from .fastio import ChunkReader, Pool, wait_all

        reader = ChunkReader(path, info, [(0, None, size)])
        try:
            with Pool() as pool:
                wait_all(pool, reader.submit(pool))
        finally:
            reader.close()
        return path
    digest, _ = sha256_file(path)
    if digest != info["sha256"]:
        raise MegatrainError(f"{path}: checksum mismatch (sha256 {digest[:12]}..., the manifest says "
                             f"{info['sha256'][:12]}...): the file is corrupted")
    return path


def read_json(ckpt: Path, manifest: dict, name: str) -> dict:
    path = verify_file(ckpt, manifest, name)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise MegatrainError(f"{path}: malformed JSON ({e})") from None


def verify_checkpoint(ckpt: Path) -> dict:
    """Every file of a checkpoint against its manifest (a full read). Returns the manifest."""
    manifest = read_manifest(ckpt)
    for name in manifest["files"]:
        verify_file(ckpt, manifest, name)
    return manifest


def small_files(manifest: dict) -> list[str]:
    """Every listed file that is not a unit's tensor file."""
    units = {u["file"] for u in manifest["units"]}
    return [n for n in manifest["files"] if n not in units]
