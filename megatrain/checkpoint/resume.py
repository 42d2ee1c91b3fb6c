"""Resuming: which checkpoint, whether it fits this run, and loading it into the store.

The checkpoint replaces the model's weights: the store is filled from it directly (fp32 master, Adam m and v,
Adam step per unit), never from the model directory first, which then only supplies config.json and the
tokenizer. Every unit file is checked against the manifest's sha256 in the same pass that reads it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import MegatrainError
from .folder_lock import LOCK_FILE, removed_while_read
from .layout import RUN_STATE, STEP_DIR, complete_checkpoints, locate, newest_checkpoint, read_json, read_manifest, \
    verify_file
from .saver import KINDS
from .fastio import CHUNK, ChunkReader, Pool, byte_view, wait_all
from .tensorfile import DTYPES, TensorFileReader, tensor_nbytes, read_header

# config.json keys that say nothing about the model's weights or computation
IGNORED_MODEL_KEYS = {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "architectures"}
# config sections whose change is expected on resume (where to write, how often to save)
IGNORED_RUN_KEYS = ("resume", "output", "checkpoint", "export")


@dataclass
class Resumed:
    path: Path
    step: int
    state: dict  # run_state.json
    manifest: dict


def resolve(resume: str | None, out_dir: Path) -> Path | None:
    """The checkpoint `resume:` names: 'auto' -> newest complete one in output.dir (None: start fresh)."""
    if not resume:
        return None
    if resume == "auto":
        return newest_checkpoint(Path(out_dir) / "checkpoints")
    return locate(Path(resume), "resume")


# what a run writes in its output.dir: a folder holding only these is a run's, and may be started over
RUN_FILES = {"config.json", "plan.json", "metrics.jsonl", "checkpoints", "tensorboard", "export", "reference",
             LOCK_FILE}


def check_fresh_start(out_dir: Path, overwrite: bool, resume: str | None) -> None:
    """A run about to start from step 0 in `out_dir` (no checkpoint to resume from) loses nothing: the folder is
    empty, or output.overwrite says so, or (resume=auto with no checkpoint yet) it holds only a run's own files
    and no checkpoint folder. Anything else, a model's folder or checkpoint folders none of which is complete, is
    refused: starting over would replace it."""
    out_dir = Path(out_dir)
    if overwrite or not out_dir.is_dir() or not any(out_dir.iterdir()) or trained_nothing(out_dir):
        return
    if not resume:
        raise MegatrainError(f"output.dir: {out_dir} is not empty; choose another, set output.overwrite=true, "
                             f"or resume=auto to continue its run")
    foreign = sorted(p.name for p in out_dir.iterdir() if p.name not in RUN_FILES or _model_config(p))
    if foreign:
        raise MegatrainError(f"output.dir: {out_dir} holds {foreign[0]}, which a megatrain run does not write, and "
                             f"no checkpoint to resume from; choose another output.dir (or set "
                             f"output.overwrite=true to write into it anyway)")
    # a run killed before its first save left no checkpoint: starting over redoes its steps, as resuming would.
    # Checkpoint folders none of which is complete (manifests lost) are another matter: their steps are not redone
    # by anything the user chose
    ckpts = out_dir / "checkpoints"
    broken = sorted(p.name for p in ckpts.iterdir() if STEP_DIR.match(p.name)) if ckpts.is_dir() else []
    if broken:
        raise MegatrainError(f"output.dir: {ckpts} holds {', '.join(broken[:3])}{' ...' if len(broken) > 3 else ''} "
                             f"but no complete checkpoint (manifest.json) to resume from; starting over would "
                             f"replace them and metrics.jsonl: set output.overwrite=true to do so, or choose another "
                             f"output.dir")


STARTUP_FILES = {"config.json", "plan.json", "metrics.jsonl", "tensorboard", "checkpoints", LOCK_FILE}


def trained_nothing(out_dir: Path) -> bool:
    """Whether `out_dir` holds only what a run writes before its first step (a run stopped at start-up, or a reward
    that failed at the first rollout): the run's config, plan, lock, an empty checkpoints folder, metrics without a
    training step (the step-0 evaluation), TensorBoard's events. Starting over there loses nothing."""
    names = {p.name for p in out_dir.iterdir()}
    if not names <= STARTUP_FILES or any(_model_config(out_dir / n) for n in names):
        return False
    ckpts = out_dir / "checkpoints"
    if ckpts.is_symlink() or (ckpts.exists() and (not ckpts.is_dir() or any(ckpts.iterdir()))):
        return False
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_symlink() or (metrics.exists() and not metrics.is_file()):
        return False
    return all("loss" not in r and r.get("step", 0) == 0 for r in metrics_records(metrics))


def metrics_records(path: Path) -> list[dict]:
    """metrics.jsonl's records, a line torn by a crash left out; none where the file is missing or unreadable."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for line in lines:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def _model_config(p: Path) -> bool:
    """A config.json that is a model's (Hugging Face: a top-level model_type), not the run's resolved config."""
    if p.name != "config.json" or not p.is_file():
        return False
    try:
        return "model_type" in json.loads(p.read_text())
    except (ValueError, TypeError, OSError):
        return True  # not the run's (it writes valid JSON): not ours to replace


def open_checkpoint(path: Path) -> Resumed:
    manifest = read_manifest(path)
    state = read_json(path, manifest, RUN_STATE)
    where = Path(path) / RUN_STATE
    if not isinstance(state, dict):
        raise MegatrainError(f"{where}: not a run state (an object)")
    for k in ("step", "loader", "rng", "config"):
        if k not in state:
            raise MegatrainError(f"{where}: key '{k}' is missing")
    if state["step"] != manifest["step"]:
        raise MegatrainError(f"{where}: step {state['step']!r}, the manifest's is {manifest['step']}")
    return Resumed(Path(path), int(state["step"]), state, manifest)


def check_run_state(r: Resumed) -> None:
    """The parts of a run state a resumed run restores (the data's position, the random generators, the config) are
    a run state's, named where not: checked before the run writes anything."""
    where = r.path / RUN_STATE
    loader = r.state["loader"]
    grpo = isinstance(loader, dict) and "grpo" in loader  # the rollout batches' state, not a sampler's position
    for k, keys in (("loader", ("prompts", "batch", "k") if grpo else ("epoch", "cursor", "seed")),
                    ("rng", ("torch", "python", "numpy")), ("config", ("train",))):
        if not isinstance(r.state[k], dict) or (gone := [x for x in keys if x not in r.state[k]]):
            raise MegatrainError(f"{where}: '{k}' is not a run state's (it lacks "
                                 f"{gone[0] if isinstance(r.state[k], dict) else 'everything: not an object'})")
    if not isinstance(r.state.get("summary", {}), dict):
        raise MegatrainError(f"{where}: 'summary' is not an object")


def check_model_config(r: Resumed, hf_config, model_path: str) -> None:
    """Refuse a model whose config.json differs from the checkpoint's, naming the differing keys."""
    from ..models import load_hf_config

    verify_file(r.path, r.manifest, "config.json")
    diff = config_differences(load_hf_config(r.path), hf_config, IGNORED_MODEL_KEYS, ("checkpoint", "now"), 5)
    if diff:
        raise MegatrainError(f"resume: {Path(model_path) / 'config.json'} differs from checkpoint {r.path}: "
                             f"{diff}; resume with the model config it was trained with")


def config_differences(a, b, ignored, names: tuple[str, str], shown: int, private: bool = True) -> str:
    """The keys in which Hugging Face configs `a` and `b` differ, beyond `ignored` (and, unless `private`, the keys
    starting with "_"), as "key (NAME_A a, NAME_B b), ... and N more" with `shown` of them; "" when none."""
    x = {k: v for k, v in a.to_dict().items() if k not in ignored and (private or not k.startswith("_"))}
    y = {k: v for k, v in b.to_dict().items() if k not in ignored and (private or not k.startswith("_"))}
    diff = sorted(k for k in x.keys() | y.keys() if x.get(k) != y.get(k))
    more = f" and {len(diff) - shown} more" if len(diff) > shown else ""
    return ", ".join(f"{k} ({names[0]} {x.get(k)!r}, {names[1]} {y.get(k)!r})" for k in diff[:shown]) + more


def check_resume_target(out_dir: Path, ckpt: Path, overwrite: bool) -> None:
    """A run resumed from the checkpoint `ckpt` (resume: PATH) writes into output.dir only where that loses nothing:
    never into the checkpoint (or its checkpoints folder); and, where the checkpoint is not one of output.dir's own,
    output.dir is new, empty, or (as for a fresh start) holds a run's files but no checkpoint of its own, which this
    run's saves would then prune and its metrics.jsonl mix with another run's."""
    out, c = Path(out_dir).resolve(), Path(ckpt).resolve()
    if out == c or c in out.parents or (out == c.parent and c.parent.name == "checkpoints"):
        raise MegatrainError(f"output.dir: {out_dir} {'is' if out in (c, c.parent) else 'lies inside'} "
                             f"{'the checkpoint' if out != c.parent else 'the checkpoints folder of'} {ckpt} being "
                             f"resumed, which the run would write over; choose an output.dir outside it")
    if c.parent == out / "checkpoints":
        return  # continuing this output.dir's own run (check_no_newer)
    theirs = complete_checkpoints(out / "checkpoints")
    if theirs and not overwrite:
        raise MegatrainError(f"output.dir: {out_dir} holds checkpoints of its own run ({theirs[-1][1].name}), not "
                             f"{ckpt}'s: resuming there would prune them and mix two runs' metrics; choose an empty "
                             f"output.dir (or resume=auto to continue the run in {out_dir})")
    check_fresh_start(out_dir, overwrite, "auto")


def check_objective(r: Resumed, objective: str) -> None:
    """A checkpoint continues under the objective that wrote it: another one's loss (and its data, reference and
    logged metrics) would change what the run trains while metrics.jsonl and the checkpoints went on as one run."""
    was = (r.state["config"].get("train") or {}).get("objective", "sft")
    if was != objective:
        raise MegatrainError(f"train.objective: {objective}, but the checkpoint {r.path} was written by a {was} run; "
                             f"resume it with train.objective: {was}, or start the {objective} run from its weights "
                             f"in another output.dir (model.path: an export of it)")


def check_no_newer(r: Resumed, out_dir: Path) -> None:
    """A newer checkpoint left in output.dir would be what a later `resume: auto` picks, not this run's."""
    newer = [p for s, p in complete_checkpoints(Path(out_dir) / "checkpoints")
             if s > r.step and p.resolve() != r.path.resolve()]
    if newer:
        raise MegatrainError(f"resume: {newer[-1]} is newer than the checkpoint resumed ({r.path}, step {r.step}); "
                             f"a later resume=auto would pick it: delete it or choose another output.dir")


def load_store(r: Resumed, store, threads: int | None = None) -> dict:
    """Fill every tile from the checkpoint, verifying each chunk's (or, in checkpoints written before chunked
    checksums, each file's) sha256 as it is read. Units are read in parallel (fastio), except those of kinds on
    the SSD tier, staged one unit at a time. Returns {"bytes", "seconds"}. A checkpoint that goes meanwhile (a
    running run's clean-up) is said to be so."""
    try:
        return _load_store(r, store, threads)
    except (MegatrainError, OSError):
        if r.path.is_dir():
            raise
        raise removed_while_read(r.path, "resume", "resume from a checkpoint it keeps") from None


def _load_store(r: Resumed, store, threads: int | None) -> dict:
    t0 = time.perf_counter()
    units = r.manifest["units"]
    if len(units) != len(store.tiles):
        raise MegatrainError(f"{r.path}: holds {len(units)} units, this model has {len(store.tiles)}")
    infos = []
    for u in units:
        info = r.manifest["files"].get(u["file"])
        if info is None:
            raise MegatrainError(f"{r.path / 'manifest.json'}: does not list {u['file']}")
        infos.append(info)
    staged = any(k in store.on_disk for k in KINDS)
    readers: list[ChunkReader] = []
    try:
        with Pool(threads) as pool:
            _fill(r, store, units, infos, staged, pool, readers)
    finally:
        for reader in readers:  # those a failed chunk left open (the pool has stopped)
            reader.close()
    return {"bytes": sum(int(i["bytes"]) for i in infos), "seconds": time.perf_counter() - t0}


def _fill(r: Resumed, store, units: list, infos: list, staged: bool, pool: Pool, readers: list) -> None:
    futures, casts = [], []  # the chunks' tasks; the streaming copies' (submitted as each unit is complete)
    for i, (tile, u, info) in enumerate(zip(store.tiles, units, infos)):
        # kinds on the SSD tier are staged (one unit) and written to it when the unit is complete
        with store.unit_state(i, KINDS, read=False, write=True) as st:
            dest = {f"{k}/{s.hf_name}": v for k in KINDS
                    for s, v in zip(tile.unit.specs, tile.views(st[k]).values())}
            dest["step"] = tile.step
            path = r.path / u["file"]
            if "sha256_chunks" not in info:
                _load_unit_serial(path, info, dest, tile)
                store.refresh_stream_copy(tile, st["master"])
                continue
            segs = unit_segments(path, info, dest, tile.unit.name)
            master = st["master"]
            reader = ChunkReader(path, info, segs, direct=True,
                                 on_done=lambda t=tile, m=master: _stream_copy(store, t, m, pool, casts))
            readers.append(reader)
            futures += reader.submit(pool)
            if staged:  # the staging buffers are written back and reused when this block ends
                wait_all(pool, futures)
                wait_all(pool, casts)
    wait_all(pool, futures)  # every unit's last chunk has submitted its casts
    wait_all(pool, casts)


def _stream_copy(store, tile, master, pool: Pool, casts: list) -> None:
    """The tile's streaming copy cast from its master (store.refresh_stream_copy) in CHUNK-sized pieces on the pool:
    one I/O thread casting a whole unit alone (an embedding: half a billion values) would be the resume's tail."""
    if not store.separate_stream_copy:
        return
    step = CHUNK // 4

    def piece(a: int) -> None:
        tile.stream[a: a + step].copy_(master[a: a + step])
    casts.extend(pool.submit(piece, a) for a in range(0, master.numel(), step))


def unit_segments(path: Path, info: dict, dest: dict, unit_name: str) -> list:
    """(offset, uint8 tensor or None, length) covering a unit file, from its header: each tensor to its `dest`
    entry (None where `dest` maps it to None). Names a tensor that is not this unit's, or one it lacks."""
    head, entries, _ = read_header(path, int(info["bytes"]))
    segs, pos = [(0, None, len(head))], len(head)
    seen = set()
    for start, end, name, dtype, shape in entries:
        if name not in dest:
            raise MegatrainError(f"{path}: tensor '{name}' is not part of {unit_name} of this model")
        t = dest[name]
        if len(head) + start != pos or end - start != tensor_nbytes(dtype, shape) or \
                (t is not None and (t.dtype != dtype or tuple(t.shape) != tuple(shape))):
            raise MegatrainError(f"{path}: tensor '{name}' is {DTYPES.get(dtype, dtype)}{list(shape)} at bytes "
                                 f"{start}-{end}, not what {unit_name} of this model holds there")
        segs.append((pos, None if t is None else byte_view(t), end - start))
        pos += end - start
        seen.add(name)
    missing = sorted(set(dest) - seen)
    if missing:
        raise MegatrainError(f"{path}: tensor '{missing[0]}' ({unit_name}) is missing")
    if pos != int(info["bytes"]):
        raise MegatrainError(f"{path}: {int(info['bytes']) - pos} bytes after its last tensor")
    return segs


def _load_unit_serial(path: Path, info: dict, dest: dict, tile) -> None:
    """A unit file of a checkpoint with one sha256 per file (format_version 1): one pass, hashing as it reads."""
    reader = TensorFileReader(path, info["bytes"])
    seen = set()
    try:
        for name, _, _ in reader:
            if name not in dest:
                raise MegatrainError(f"{reader.path}: tensor '{name}' is not part of {tile.unit.name} of this model")
            reader.read_into(dest[name])
            seen.add(name)
        reader.finish(info["sha256"])
    finally:
        reader.close()
    missing = sorted(set(dest) - seen)
    if missing:
        raise MegatrainError(f"{reader.path}: tensor '{missing[0]}' ({tile.unit.name}) is missing")


def config_notes(r: Resumed, config_now: dict, world: dict | None = None) -> list[str]:
    """Human-readable differences between the checkpoint's run and this one (allowed, but worth saying).
    world: this run's ranks (as the manifest's "world": world_size, nodes, ranks_per_node)."""
    notes = []
    was = r.manifest.get("world", {"world_size": 1})
    now = world or {"world_size": 1}
    if was.get("world_size") != now.get("world_size"):
        notes.append(f"world size {was.get('world_size')} -> {now.get('world_size')}: the data continues at the "
                     f"next micro-batch, each step now takes train.grad_accum_steps per rank from every rank (the "
                     f"global batch changes unless grad_accum_steps does), and the reductions' order differs (not "
                     f"bit-identical to continuing on {was.get('world_size')})")
    for key, (a, b) in sorted(_diff(r.state["config"], config_now).items()):
        if not key.startswith(IGNORED_RUN_KEYS):
            notes.append(f"{key}: {a!r} -> {b!r}")
    from .state import package_versions

    for k, v in package_versions().items():
        was = r.state.get("versions", {}).get(k)
        if was is not None and was != v and k != "megatrain":
            notes.append(f"{k} {was} -> {v} (results may differ in the last bits)")
    return notes


def _diff(a, b, prefix="") -> dict:
    """Keys whose values differ; a tuple equals the list it becomes in the checkpoint's JSON."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = {}
        for k in a.keys() | b.keys():
            out.update(_diff(a.get(k), b.get(k), f"{prefix}{k}."))
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        out = {}
        for i, (x, y) in enumerate(zip(a, b)):
            out.update(_diff(x, y, f"{prefix}{i}."))
        return {prefix[:-1]: (a, b)} if out else {}
    return {} if a == b else {prefix[:-1]: (a, b)}


def trim_metrics(out_dir: Path, step: int) -> None:
    """metrics.jsonl keeps the records of steps up to `step` (those after it are re-done): no duplicate steps.
    step < 0: a fresh start, the file is emptied."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                keep.append(line + "\n")
        except (json.JSONDecodeError, AttributeError):
            continue  # a line torn by a crash
    tmp = path.with_suffix(".jsonl.tmp")
    try:
        tmp.write_text("".join(keep))
        os.replace(tmp, path)
    except OSError as e:  # a full disk: metrics.jsonl is left as it was
        tmp.unlink(missing_ok=True)
        raise MegatrainError(f"output.dir: rewriting {path} failed ({e.strerror or e}); make room in {out_dir} and "
                             f"start again") from None
