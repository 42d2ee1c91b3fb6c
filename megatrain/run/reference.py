"""The reference model's log-probs of a dpo or ipo run (preference.reference; docs/preference.md).

    precompute  before step 1, a forward-only streaming pass over every training and held-out pair at the
                reference weights (the policy at step 0, or preference.reference_path's), stored in
                output.dir/reference/<fingerprint>.safetensors: a [pairs, 2] table of (chosen, rejected) log-probs
                by pair id. The fingerprint covers the pairs' tokens, the reference weights' source and the
                precision, so a file is only ever reused for the same numbers. The pass writes what it has scored
                every PART_SECONDS into reference/<fingerprint>.partial/, so a killed pass restarts where it
                stopped; a checkpoint names the file (run_state's `reference`).
    stream      the engine's frozen bf16 copy of the reference weights in host RAM (+2 B/param), scored for each
                step's micro-batches before the step's waves; a resumed run rebuilds it from the same source.

Test-only: the environment variable MEGATRAIN_TEST_REFERENCE_DELAY_S (seconds) makes the pass sleep after each
wave and store a part after each, so that a test can kill it part-way.

Each micro-batch's `ref_logps` (float32 [2P]: rows 2i, 2i+1 = chosen, rejected of pair i) comes from `lookup`
(precompute, on the data thread) or `score` (stream, on the training thread). simpo and orpo have no reference.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ..checkpoint.resume import IGNORED_MODEL_KEYS, config_differences
from ..errors import MegatrainError
from ..runtime import MicroBatch
from .reference_weights import weights_identity

PART_SECONDS = 30.0  # a killed pass loses at most this much of its work


def reference_source(cfg) -> dict:
    """Where the reference weights come from, as the fingerprint and the log name them."""
    m, p = cfg.model, cfg.preference
    if p.reference_path:
        return {"model": str(Path(p.reference_path).resolve()), **_files(Path(p.reference_path))}
    if m.init == "random":
        return {"model": str(Path(m.path).resolve()), "init": "random", "seed": cfg.train.seed,
                "init_std": cfg.train.init_std}
    return {"model": str(Path(m.path).resolve()), **_files(Path(m.path))}


def _files(folder: Path) -> dict:
    """A model folder's weight files' identity (reference_weights.weights_identity: each file's size and sampled
    contents) and its config.json."""
    return {"files": weights_identity(folder),
            "config": (folder / "config.json").read_text() if (folder / "config.json").is_file() else ""}


# config.json keys of a reference that cannot change its log-probs: bookkeeping (checkpoint/resume.py's list),
# token ids the forward never reads (generation's), the init of weights it loads, and the outputs' form
REFERENCE_IGNORED_KEYS = IGNORED_MODEL_KEYS | {"bos_token_id", "eos_token_id", "pad_token_id", "initializer_range",
                                               "output_attentions", "output_hidden_states", "return_dict",
                                               "id2label", "label2id", "problem_type"}


def check_reference_path(cfg, adapter=None) -> None:
    """preference.reference_path: a Hugging Face model folder of the policy's architecture (every unit the same
    shapes), whose config.json gives the forward the policy's (the reference runs with the policy's config: a
    different rope, norm epsilon, activation or positions would be silently ignored), with weights. `adapter`: the
    policy's (default: built from model.path, as `megatrain plan` needs). One line naming the key; nothing
    written."""
    path = cfg.preference.reference_path
    if not path:
        return
    from ..models import get_adapter, load_hf_config

    p = Path(path)
    if not p.is_dir():
        raise MegatrainError(f"preference.reference_path: {p} is not a folder; expected a Hugging Face model folder "
                             f"(config.json, *.safetensors) of the policy's architecture")
    try:
        ref_config = load_hf_config(str(p))
        ref = get_adapter(ref_config)
    except MegatrainError as e:  # (load_hf_config names model.path, its usual caller)
        raise MegatrainError(f"preference.reference_path: {str(e).removeprefix('model.path: ')}") from None
    policy = load_hf_config(cfg.model.path)  # (as the reference's: the same defaults filled in)
    adapter = adapter if adapter is not None else get_adapter(policy)
    mine = [(u.name, u.numel) for u in adapter.units()]
    theirs = [(u.name, u.numel) for u in ref.units()]
    if ref.model_type != adapter.model_type or mine != theirs:
        diff = next((f"{a} against {b}" for a, b in zip(theirs, mine) if a != b),
                    f"{len(theirs)} units against {len(mine)}")
        raise MegatrainError(f"preference.reference_path: {p} is a {ref.model_type} of another shape than the policy "
                             f"({adapter.model_type}, model.path): {diff} (unit, parameters); the reference must have "
                             f"the policy's architecture")
    diff = config_differences(ref_config, policy, REFERENCE_IGNORED_KEYS, ("reference", "policy"), 4, private=False)
    if diff:
        raise MegatrainError(f"preference.reference_path: {p / 'config.json'} differs from the policy's "
                             f"({Path(cfg.model.path) / 'config.json'}) in {diff}; the reference is run with "
                             f"the policy's config, so these would be ignored: use a reference of the policy's "
                             f"config")
    if not any(p.glob("*.safetensors")):
        raise MegatrainError(f"preference.reference_path: {p} has no *.safetensors weights")


def choose_reference(cfg, plan, adapter, loader, tokenizer, eval_batches, resumed) -> Reference:
    """The run's reference strategy (dpo, ipo; none for simpo, orpo): a resumed run keeps its checkpoint's; else
    preference.reference, or with auto the plan's choice made again with the data's pair counts
    (planner/objective.py), which the plan then shows. With precompute, what output.dir/reference holds for this
    run is checked now, before anything is written (check_stored)."""
    ref = _strategy(cfg, plan, adapter, loader, tokenizer, eval_batches, resumed)
    if ref.strategy == "precompute":
        check_stored(cfg, pair_sides(cfg, tokenizer), resumed)
    return ref


def _strategy(cfg, plan, adapter, loader, tokenizer, eval_batches, resumed) -> Reference:
    from ..planner.objective import choose, plan_objective

    if cfg.train.objective not in ("dpo", "ipo"):
        return Reference()
    if resumed is not None and (kept := (resumed.state.get("reference") or {}).get("strategy")):
        return Reference(kept, f"the strategy of {resumed.path.name}")
    if cfg.preference.reference != "auto":
        return Reference(cfg.preference.reference, f"preference.reference: {cfg.preference.reference}")
    from ..data import all_pair_batches

    mbs, t = cfg.train.micro_batch_size, cfg.train
    set_pairs = len(all_pair_batches(cfg.data, tokenizer, micro_batch_size=mbs).pairs)
    eval_pairs = sum(len(b["pair_ids"]) for b in eval_batches or [])
    if plan is not None:
        plan_objective(plan, cfg, adapter, set_pairs, eval_pairs)
        return Reference(plan.objective["reference"], plan.objective["why"])
    pairs = t.steps * mbs * t.grad_accum_steps * getattr(loader, "world", 1)
    return Reference(*choose("auto", set_pairs + eval_pairs, pairs + eval_pairs))


def pair_sides(cfg, tokenizer) -> dict:
    """{"train": PairBatches, "eval": PairBatches (with held-out data)}: every pair the pass scores."""
    from ..data import all_pair_batches

    mbs = cfg.train.micro_batch_size
    return {side: b for side in ("train", "eval")
            if (b := all_pair_batches(cfg.data, tokenizer, micro_batch_size=mbs, side=side)) is not None}


def check_stored(cfg, sides: dict, resumed, out_dir: Path | None = None) -> tuple[str, Path, dict | None]:
    """(the fingerprint, the table's file, its tables where a pass stored them, else None) of this run's reference
    log-probs in output.dir/reference. MegatrainError naming the file where the table or a part of an interrupted
    pass cannot be read or does not hold these pairs, or where a resumed checkpoint was trained against another
    table or one that is gone. out_dir: the run's (default output.dir). Reads only."""
    fp = fingerprint(cfg, sides)
    folder = Path(out_dir or cfg.output.dir) / "reference"
    file = folder / f"{fp}.safetensors"
    named = (resumed.state.get("reference") or {}).get("file") if resumed is not None else None
    if named and named != file.name:
        raise MegatrainError(f"resume: the checkpoint {resumed.path} was trained against the reference "
                             f"log-probs {named}, but this run's data, reference model or precision give "
                             f"{file.name}: resume with the config it was trained with")
    if file.is_file():
        return fp, file, read_table(file, sides)
    if resumed is not None:
        raise MegatrainError(f"resume: the reference log-probs {file} that {resumed.path} was trained "
                             f"against are gone; they are the step-0 model's and cannot be rebuilt from a later "
                             f"checkpoint: start the run over (output.overwrite=true)")
    for f in sorted((folder / f"{fp}.partial").glob("part-*.safetensors")):
        read_part(f, sides)
    return fp, file, None


def _unreadable(path: Path, what: str, why: str) -> MegatrainError:
    return MegatrainError(f"{path}: {what} {why}; delete the file and the run scores these pairs again")


def read_table(path: Path, sides: dict) -> dict[str, torch.Tensor]:
    """The stored [pairs, 2] float32 table of each side, checked against the pairs `sides` holds."""
    what = "the stored reference log-probs"
    try:
        tables, _ = _load(path)
    except Exception as e:  # (safetensors' own error types, JSON of the metadata, ...)
        raise _unreadable(path, what, f"are unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None
    if sorted(tables) != sorted(sides):
        raise _unreadable(path, what, f"hold the sides {sorted(tables)} where {sorted(sides)} are expected")
    for side, t in tables.items():
        want = len(sides[side].pairs)
        if t.dtype != torch.float32 or t.dim() != 2 or t.shape[1] != 2:
            raise _unreadable(path, what, f"hold a {list(t.shape)} {t.dtype} table for the {side} pairs where "
                                          f"[{want}, 2] float32 is expected")
        if t.shape[0] != want:
            raise _unreadable(path, what, f"hold {t.shape[0]} pairs where {want} are expected (the {side} pairs)")
        if not torch.isfinite(t).all():
            raise _unreadable(path, what, f"hold log-probs that are not finite (the {side} pairs)")
    return tables


def read_part(path: Path, sides: dict) -> tuple[str, list[int], list]:
    """A part of an interrupted pass: (its side, pair ids, [chosen, rejected] log-probs), checked."""
    what = "a part of an interrupted reference pass"
    try:
        t, meta = _load(path)
        side, ids, logps = meta["side"], t["pair_ids"], t["logps"]
    except Exception as e:
        raise _unreadable(path, what, f"is unreadable ({type(e).__name__}: {str(e).splitlines()[0][:120]})") \
            from None
    n = len(sides[side].pairs) if side in sides else 0
    if ids.dim() != 1 or logps.shape != (len(ids), 2) or not torch.isfinite(logps).all() or \
            (len(ids) and not (0 <= int(ids.min()) and int(ids.max()) < n)):
        raise _unreadable(path, what, f"does not fit this run's {n} {side} pairs (ids {list(ids.shape)}, log-probs "
                                      f"{list(logps.shape)})")
    return side, ids.tolist(), logps.tolist()


def fingerprint(cfg, sides: dict) -> str:
    """The hash of what the reference log-probs depend on: each set of pairs' fingerprint (its tokens: the data
    layer's Pairs.fingerprint), the reference weights' source, data.max_seq_len and the precision."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"source": reference_source(cfg), "max_seq_len": cfg.data.max_seq_len,
                         "precision": cfg.train.precision, "pairs": {k: b.fingerprint() for k, b in sides.items()}},
                        sort_keys=True).encode())
    return h.hexdigest()


def _save(path: Path, tensors: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"megatrain": json.dumps(meta)})
    os.replace(tmp, path)  # a file is whole or absent


def _load(path: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {}).get("megatrain", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def microbatches(batches: list[dict]) -> list[MicroBatch]:
    return [MicroBatch.from_labels(b["input_ids"], b["labels"], b.get("position_ids"), b.get("attention_mask"),
                                   pair_ids=b["pair_ids"]) for b in batches]


class Reference:
    """The reference log-probs of a run: `strategy` is 'precompute' or 'stream' (None: the objective has none)."""

    def __init__(self, strategy: str | None = None, why: str = ""):
        self.strategy, self.why = strategy, why
        self.tables: dict[str, torch.Tensor] = {}  # precompute: side -> float32 [pairs, 2]
        self.file: Path | None = None  # precompute: the stored table
        self.fingerprint = ""
        self.weight_files: dict[str, str] | None = None  # the frozen copy's files' identity (reference_weights.py)
        self._eval: dict[int, torch.Tensor] = {}  # stream: each held-out batch's reference log-probs, scored once

    # ---- precompute -----------------------------------------------------------------------------------------
    def precompute(self, run, log, stop=None) -> None:
        """Score every training and held-out pair at the reference weights, or read the file a previous pass (or
        the checkpoint resumed) stored; a killed pass goes on from its parts."""
        sides = pair_sides(run.cfg, run.tokenizer)
        self.fingerprint, self.file, tables = check_stored(run.cfg, sides, run.resumed, run.out_dir)
        if tables is not None:
            self.tables = tables
            log.info(f"reference log-probs: {self.file} ({self._count()} pairs, stored by an earlier pass)")
            return
        self._pass(run, log, sides, self.file.parent, stop)

    def _count(self) -> int:
        return sum(int(t.shape[0]) for t in self.tables.values())

    def _pass(self, run, log, sides: dict, folder: Path, stop) -> None:
        world = run.ranks.world
        parts = folder / f"{self.fingerprint}.partial"
        done: dict[str, dict[int, tuple[float, float]]] = {s: {} for s in sides}
        if parts.is_dir():
            for f in sorted(parts.glob("part-*.safetensors")):
                side, ids, logps = read_part(f, sides)
                done[side].update(zip(ids, map(tuple, logps)))
        before = sum(len(d) for d in done.values())
        if run.writes:
            parts.mkdir(parents=True, exist_ok=True)
        run.ranks.phase("reference parts")
        wave = max(1, run.cfg.train.grad_accum_steps)  # micro-batches per streaming wave, as a step's
        per = wave * run.cfg.train.micro_batch_size  # pairs of a wave: batch i holds pair ids i*mbs .. (i+1)*mbs-1
        todo = [(s, i) for s, bs in sides.items() for i in range(0, len(bs), wave)
                if not all(p in done[s] for p in range(i // wave * per, min(i // wave * per + per, len(bs.pairs))))]
        mine = todo[world.rank::world.size]  # (batches are made when scored: a large set is never all in memory)
        total = sum(len(bs.pairs) for bs in sides.values())
        log.info(f"reference log-probs: scoring {total - before} of {total} pairs at the reference weights "
                 f"({self.why})" + (f"; {before} scored by an interrupted pass" if before else ""))
        t0, last, fresh, seq = time.perf_counter(), time.perf_counter(), {s: {} for s in sides}, 0
        new: dict[str, dict[int, tuple[float, float]]] = {s: {} for s in sides}
        delay = float(os.environ.get("MEGATRAIN_TEST_REFERENCE_DELAY_S", "0") or 0)
        # Each wave's log-probs stay on the device until a part is stored: no host sync between waves, so the next
        # wave's batches, input copies and first weights are queued while the GPU still runs this one's layers and
        # head (a .cpu() per wave drained the GPU at each wave's end and left the next wave's start exposed).
        pending: list[tuple[str, list[int], torch.Tensor]] = []
        timer = _WaveTimer(run.engine.device)

        def collect() -> None:  # the queued waves' log-probs to host, in one copy (it waits for them)
            if not pending:
                return
            pairs = torch.cat([logp.detach().float() for _, _, logp in pending]).cpu().reshape(-1, 2).tolist()
            at = 0
            for s, ids, _ in pending:
                got = list(zip(ids, map(tuple, pairs[at: at + len(ids)])))
                fresh[s].update(got)
                new[s].update(got)
                at += len(ids)
            pending.clear()

        def flush() -> None:
            nonlocal seq
            collect()
            for s, d in fresh.items():
                if d:
                    ids = torch.tensor(list(d), dtype=torch.int64)
                    _save(parts / f"part-r{world.rank}-{time.time_ns()}-{seq:05d}.safetensors",
                          {"pair_ids": ids, "logps": torch.tensor(list(d.values()), dtype=torch.float32)},
                          {"side": s})
                    seq += 1
                    d.clear()

        for side, at in mine:
            if stop is not None and stop.requested is not None:
                break
            group = sides[side][at:at + wave]
            logp, _ = run.engine.sequence_logps(microbatches(group), weights=self.weights)
            pending.append((side, [int(p) for b in group for p in b["pair_ids"]], logp))
            timer.mark()
            if delay:
                time.sleep(delay)
            if delay or time.perf_counter() - last > PART_SECONDS:
                flush()
                last = time.perf_counter()
        flush()
        if stop is not None:
            from ..checkpoint.signals import Stopped

            if (requested := run.agree_stop(stop.requested)) is not None:
                raise Stopped(requested, "the reference pass")
        run.ranks.phase("reference scored")
        for side, bs in sides.items():
            n = len(bs.pairs)
            table = torch.zeros(n, 2, dtype=torch.float64)
            for pid, v in new[side].items():
                table[pid] = torch.tensor(v, dtype=torch.float64)
            if world.rank == 0:  # the interrupted pass's pairs, once
                for pid, v in done[side].items():
                    table[pid] = torch.tensor(v, dtype=torch.float64)
            if world.size > 1:
                table = torch.tensor(run.ranks.all_sum(table.reshape(-1).tolist()),
                                     dtype=torch.float64).reshape(n, 2)
            self.tables[side] = table.float()
        if run.writes:
            _save(self.file, self.tables, {"fingerprint": self.fingerprint, "source": reference_source(run.cfg)})
            for f in parts.glob("part-*"):
                f.unlink()
            parts.rmdir()
        run.ranks.phase("reference stored")
        pass_s, waves = time.perf_counter() - t0, timer.waves()
        log.log({"step": 0, "reference_pass_s": pass_s, "reference_pairs": total - before, **waves})
        log.info(f"reference log-probs: {self._count()} pairs stored in {self.file}" + (
            f"; the pass {pass_s:.2f} s, {_wave_line(waves, run.plan)}" if waves else ""))

    @property
    def weights(self) -> str:
        """The weights the engine streams for the reference: its frozen copy when one was filled (stream, or a
        reference_path), else the store's (the step-0 policy, before any step)."""
        return "reference" if self.frozen else "policy"

    frozen = False  # a frozen reference copy is in the store (HostStore.freeze_reference or reference_path)

    def lookup(self, batch: dict, side: str = "train") -> torch.Tensor | None:
        """float32 [2P] of a batch's pairs, chosen and rejected interleaved (precompute); None otherwise."""
        if self.strategy != "precompute":
            return None
        return self.tables[side][batch["pair_ids"]].reshape(-1)

    # ---- stream ---------------------------------------------------------------------------------------------
    def score(self, engine, mbs: list[MicroBatch]) -> None:
        """stream: each micro-batch's ref_logps from the frozen copy, before the step's waves."""
        if self.strategy != "stream":
            return
        logp, _ = engine.sequence_logps(mbs, weights="reference")
        logp = logp.detach().float().cpu()
        at = 0
        for mb in mbs:
            rows = int(mb.input_ids.shape[0])
            mb.ref_logps = logp[at:at + rows].clone()
            at += rows

    def eval_refs(self, engine, mb: MicroBatch, batch: dict, index: int) -> None:
        """A held-out micro-batch's ref_logps (run.eval_batches[index]): from the table (precompute) or from the
        frozen copy (stream: scored at the first evaluation and kept, the reference never changes)."""
        if self.strategy == "precompute":
            mb.ref_logps = self.lookup(batch, "eval")
        elif self.strategy == "stream":
            if index not in self._eval:
                self.score(engine, [mb])
                self._eval[index] = mb.ref_logps
            mb.ref_logps = self._eval[index]

    def state(self) -> dict | None:
        """What a checkpoint records of it (run_state's `reference`): the strategy, the precomputed table's file, and
        the identity of the files a frozen copy is loaded from (grpo's KL reference has no strategy, only those)."""
        if self.strategy is None and self.weight_files is None:
            return None
        out = {"strategy": self.strategy, "file": self.file.name if self.file else None,
               "fingerprint": self.fingerprint}
        return out if self.weight_files is None else {**out, "weights": self.weight_files}


class _WaveTimer:
    """The reference pass's waves on the GPU, from CUDA events on the compute stream (no host sync): a wave's time
    is from the end of the one before (the pass's start for the first) to its own end, its idle included. The first
    wave also carries what happens once (a kernel's first compile)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.events = [self._event()] if self.cuda else []

    def _event(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def mark(self) -> None:
        if self.cuda:
            self.events.append(self._event())

    def waves(self) -> dict:
        """{"reference_waves", "reference_first_wave_s", "reference_wave_s" (the median of the others)}; {} on CPU
        or without a wave. Call after the waves' log-probs reached the host."""
        if len(self.events) < 2:
            return {}
        self.events[-1].synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(self.events, self.events[1:])]
        rest = sorted(times[1:])
        return {"reference_waves": len(times), "reference_first_wave_s": times[0],
                "reference_wave_s": rest[len(rest) // 2] if rest else times[0]}


def _wave_line(waves: dict, plan) -> str:
    """The log's words on the pass's waves, with the plan's forward-only wave (planner/objective.py)."""
    planned = (plan.objective or {}).get("forward_s") if plan is not None else None
    return (f"{waves['reference_waves']} waves on the GPU: the first {waves['reference_first_wave_s']:.2f} s, then "
            f"{waves['reference_wave_s']:.2f} s each (median)" + (f"; planned {planned:.2f} s a wave" if planned
                                                                   else ""))
