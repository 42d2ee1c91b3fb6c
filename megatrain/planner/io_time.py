"""Seconds of the work around the steps: loading pretrained weights, a checkpoint's save, a resume, the export;
and the share of a run's wall time its periodic saves take.

Each is bytes over the disk's rate (the profile's `disk`, `megatrain probe --disk PATH`, else the defaults: the
calibration's DEFAULT_DISK_*; the same disk is assumed for output.dir and model.path) times the share of that rate
the code reaches (calibration.IO_EFFICIENCY, measured by bench/bench_io.py), a checkpoint's save and resume at most
at the rate its I/O threads hash (IO_HASH_BPS):

    load          the safetensors files read: params x the config's dtype, gpt-oss's MXFP4 experts (config.json's
                  quantization_config) at 17/32 B/param (two 4-bit values a byte, an 8-bit scale per 32 values)
    save          the checkpoint (fp32 master, Adam m and v: 12 B/param) written
    resume        the checkpoint read
    export        the bf16 export (2 B/param) written from the store, at the end of a run
    export_ckpt   `megatrain export CHECKPOINT`: the masters (4 B/param) read and the bf16 written

A periodic save overlaps the steps after it: the writer goes through the units in the optimizer's order while the
next step runs; that step's updates begin about one step after the save, and a unit not yet written is copied into
a staging pool (checkpoint/saver.py) while it has room, else the update waits for the writer. The pool's bound is
half the host RAM the plan leaves free (the other half stays for the page cache and what the plan does not count),
at most one checkpoint. So a save costs the run the writer's time for the bytes neither written during that step
nor staged, max(0, save - one step - staging / the save's rate), plus the staging copies on the optimizer (timed
as AdamW over as many parameters: the copy moves 24 B a parameter, AdamW more); every `checkpoint.every` steps
that is the share below. Without headroom that is max(0, save - one step): the optimizer waits unit by unit.
"""

from __future__ import annotations

from .calibration import IO_EFFICIENCY, IO_HASH_BPS


def dtype_bytes(name: str) -> int:
    """Bytes per element of a config's dtype name (float32: 4, the 16-bit ones: 2)."""
    return 4 if "32" in name else 2


class _Quantized:
    """The tensor names of a checkpoint that stores every quantizable tensor as `*_blocks` and `*_scales`."""

    def __contains__(self, name) -> bool:
        return str(name).endswith(("_blocks", "_scales"))


def load_bytes(adapter, file_dtype: str | None) -> int:
    """Bytes of the model's pretrained safetensors: every parameter at the config's dtype, except the tensors the
    adapter reads from MXFP4 (config.json's quantization_config says mxfp4: gpt-oss's experts). 0 with file_dtype
    None (random init)."""
    if not file_dtype:
        return 0
    q = getattr(adapter.hf_config, "quantization_config", None) or {}
    mxfp4 = (q.get("quant_method") if isinstance(q, dict) else getattr(q, "quant_method", None)) == "mxfp4"
    from ..models.gpt_oss import MXFP4_GROUP

    mx = (MXFP4_GROUP // 2 + 1) / MXFP4_GROUP  # bytes a value: two 4-bit values a byte, an 8-bit scale a group
    per, total = dtype_bytes(str(file_dtype)), 0.0
    for u in adapter.units():
        for s in u.specs:
            packed = mxfp4 and adapter.packed_source(s, _Quantized()) is not None
            total += s.numel * (mx if packed else per)
    return int(total)


def staging_limit(headroom: float | None, checkpoint_bytes: float) -> float:
    """Host RAM a periodic save may stage units in: half the plan's headroom (available - needed), at most one
    checkpoint; 0 without headroom (or none known)."""
    if headroom is None or headroom <= 0:
        return 0
    return min(headroom / 2, checkpoint_bytes)


def io_times(params: int, read_bps: float, write_bps: float, step_s: float, every: int = 0,
             file_dtype: str | None = "bfloat16", source: str = "", file_bytes: int | None = None,
             headroom: float | None = None, adamw_params_per_s: float | None = None) -> dict:
    """The seconds of each operation, the wall-time cost of one periodic save and its share at `every` steps.
    file_dtype: the pretrained files' dtype (None: random init, nothing is loaded); file_bytes: their size when
    known (load_bytes: quantized tensors), else params x file_dtype's size. headroom: host RAM the plan leaves free
    (bounds the staging pool); adamw_params_per_s: the CPU AdamW's rate (times the staging copies)."""
    e = IO_EFFICIENCY
    ckpt = 12 * params
    if file_bytes is None:
        file_bytes = params * dtype_bytes(str(file_dtype)) if file_dtype else 0
    out = {"read_bps": read_bps, "write_bps": write_bps, "source": source, "checkpoint_bytes": ckpt,
           "load_bytes": file_bytes,
           "load_s": (file_bytes / (read_bps * e["load"])) if file_dtype else 0.0,
           "save_s": ckpt / min(write_bps * e["save"], IO_HASH_BPS),  # every byte hashed on the I/O threads
           "resume_s": ckpt / min(read_bps * e["resume"], IO_HASH_BPS),
           "export_s": 2 * params / (write_bps * e["export"]),
           "export_ckpt_s": (4 * params / read_bps + 2 * params / write_bps) / e["export_ckpt"]}
    rate = ckpt / out["save_s"]
    staging = staging_limit(headroom, ckpt)
    staged = min(staging, max(0.0, ckpt - rate * step_s))  # what the writer has not written when the updates begin
    out["staging_bytes"] = staging
    out["staged_bytes"] = staged
    out["save_wait_s"] = max(0.0, out["save_s"] - step_s - staging / rate)
    out["stage_copy_s"] = staged / 12 / adamw_params_per_s if adamw_params_per_s else 0.0
    out["save_cost_s"] = out["save_wait_s"] + out["stage_copy_s"]
    out["every"] = every
    out["save_share"] = out["save_cost_s"] / (every * step_s + out["save_cost_s"]) if every and step_s > 0 else 0.0
    return out


def io_lines(io: dict) -> list[str]:
    """The report's lines (planner/report.py)."""
    if not io:
        return []
    load = f"load {io['load_s']:.0f} s, " if io["load_s"] else ""
    staging = io.get("staging_bytes", 0)
    pool = (f"staging {staging / 1e9:.1f} GB of host RAM (half the headroom) for units not yet written"
            if staging else "no host headroom to stage units: the optimizer waits for the writer")
    every = (f"; checkpoint.every {io['every']}: {pool}, a save costs {io['save_cost_s']:.0f} s beyond the step it "
             f"overlaps, {io['save_share']:.1%} of the run's wall time" if io["every"] else "")
    return [f"disk work (predicted, disk read {io['read_bps'] / 1e9:.2f} / write {io['write_bps'] / 1e9:.2f} GB/s, "
            f"{io['source']}): {load}save {io['save_s']:.0f} s, resume {io['resume_s']:.0f} s, "
            f"export {io['export_s']:.0f} s (from a checkpoint {io['export_ckpt_s']:.0f} s){every}"]
