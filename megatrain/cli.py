"""`megatrain train | data | plan | probe | export`: parse, validate, call.

`megatrain train` under torchrun (`torchrun --nproc-per-node=N -m megatrain train CONFIG`) is one rank of a
distributed run (megatrain/run/launch.py); `megatrain plan --nproc-per-node N --nnodes M` plans one node of it.

Every user error, of every subcommand and of the arguments themselves, is one line `megatrain: error: <message>`
on stderr and exit status 2 (errors.report, errors.ArgumentParser); `megatrain plan` exits 1 when the run will not
fit. `train`, `plan` and `data` without a config file: no arguments run the embedded demo; overrides alone start
from the schema's defaults (config.load_command_line).
"""

from __future__ import annotations

import errno
import gc
import os
import signal
import sys
import time
from pathlib import Path

from .errors import ArgumentParser, MegatrainError, count, positive_int, positive_number, report


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="megatrain", description="Train Hugging Face causal LMs larger than GPU memory.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (no arguments: the embedded demo)")
    t.add_argument("config", nargs="?", help="YAML config; omit it and every override for the embedded demo "
                                             "(overrides alone start from the defaults)")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.lr=1e-4")
    d = sub.add_parser("data", help="show what the model will see")
    d.add_argument("config", nargs="?")
    d.add_argument("overrides", nargs="*")
    d.add_argument("--preview", type=count, default=3, metavar="N", help="examples to print")
    pl = sub.add_parser("plan", help="host RAM, GPU memory, disk and step time of a run, before running it "
                                     "(exit status 1: it will not fit)")
    pl.add_argument("config", nargs="?", help="YAML config; omit it and every override for the embedded demo")
    pl.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.device=cuda to plan for a GPU")
    pl.add_argument("--json", action="store_true", help="print the plan as one JSON object (fits, gpu_peak_gib, "
                                                        "host_peak_gib, host_bytes_per_param, step_time_s, "
                                                        "tflops_6n, placement, ...) for scripts")
    pl.add_argument("--nproc-per-node", type=positive_int, default=1, metavar="N",
                    help="ranks (GPUs) per node, as torchrun's --nproc-per-node: host RAM is then planned per node "
                         "(one shared store), with the gradients' network traffic")
    pl.add_argument("--nnodes", type=positive_int, default=1, metavar="M", help="nodes, as torchrun's --nnodes")
    sub.add_parser("probe", help="measure this machine for the planner (see megatrain probe --help)", add_help=False)
    e = sub.add_parser("export", help="write a Hugging Face model directory from a checkpoint")
    e.add_argument("source", metavar="CHECKPOINT_OR_RUN_DIR",
                   help="a checkpoint (step-N) or a run's output.dir (its newest complete checkpoint)")
    e.add_argument("out_dir", metavar="OUT_DIR", help="new (or empty) directory for the model")
    e.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="dtype of the weights (default bf16)")
    e.add_argument("--max-shard-mb", type=positive_number, default=5000.0, help="largest shard in MB (default 5000)")
    return p


def _split(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    # `megatrain train model.path=m data.path=d`: no config file, overrides only
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, overrides


def _exit_status(e: SystemExit) -> int:
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)


class _Stopped(BaseException):
    """SIGTERM or SIGINT before a run installs its own handler (run/trainer.py): the imports and the checks."""


_STOPPED_WHILE = {"train": "during start-up, before anything was written",
                  "export": "during the export: its target was not written (the next export removes its partial "
                            "folder)"}


_RUN_PID = [0]  # the process main() runs in


def _stop_early(signum, frame):
    if os.getpid() != _RUN_PID[0]:  # a forked child that inherited the handler (a pool's worker): it ends, quietly,
        raise SystemExit(128 + signum)  # unwinding (a lock it holds, its pool's queue's, is released)
    raise _Stopped(signal.Signals(signum).name)


class _ReaderGone:
    """sys.stdout or sys.stderr, writing nowhere once its reader is gone (EPIPE: `| tee` ended by the same Ctrl-C;
    EIO: the terminal closed): a log line that cannot be written must not end a run that can still save. The file
    descriptor then points at /dev/null, so that nothing buffered fails again at exit."""

    def __init__(self, stream):
        self._stream, self._gone = stream, False

    def _quiet(self, fn, *args):
        if self._gone:
            return None
        try:
            return fn(*args)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO):
                raise
            self._gone = True
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            except (OSError, ValueError):
                pass
            return None

    def write(self, text):
        self._quiet(self._stream.write, text)
        return len(text)

    def flush(self):
        self._quiet(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    top, argv = argv is None, sys.argv[1:] if argv is None else list(argv)
    import threading

    handlers = {}
    _RUN_PID[0] = os.getpid()
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, _stop_early) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    if top:
        sys.stdout, sys.stderr = _ReaderGone(sys.stdout), _ReaderGone(sys.stderr)
        if not sys.stderr.isatty():  # a log file: datasets' bars would write a line per update (the steps' bar is
            os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # a terminal's alone too)
    # `megatrain plan` builds no garbage worth collecting in its short life (its meta-device runs measure storages
    # freed by reference counting, never by the collector): without collections while torch is imported and the
    # search runs, and, as the command line's process ends with it, with its objects frozen so that the interpreter's
    # exit does not walk them (a third of a second with torch loaded)
    plan, collecting = argv[:1] == ["plan"], gc.isenabled()
    if plan:
        gc.disable()
    try:
        return _main(argv)
    except _Stopped as e:  # nothing was produced: a failure's status, 128 + the signal's number, as a shell gives
        print(f"megatrain: stopped by {e} {_STOPPED_WHILE.get(argv[0] if argv else '', 'before it finished')}",
              file=sys.stderr)
        return 128 + signal.Signals[str(e)].value
    finally:
        for s, old in handlers.items():
            signal.signal(s, old)
        if plan and top:
            gc.freeze()
        elif plan and collecting:
            gc.enable()


def _main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["probe"]:  # its own options, no config: runs where only torch and transformers are installed
            from .planner.probe import main as probe_main

            return probe_main(argv[1:])
        parser = _parser()
        args, extra = parser.parse_known_args(argv)
        # overrides after an option (`megatrain plan CONFIG --json KEY=VALUE`): argparse stops filling the
        # overrides at the option and leaves the rest over
        stray = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
        if stray:
            parser.error(f"unrecognized arguments: {' '.join(stray)}")
        if extra:
            args.overrides = [*args.overrides, *extra]
        return _run(args)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return _exit_status(e)
    except MegatrainError as e:
        return report(e)
    except KeyboardInterrupt as e:  # a second signal (run/trainer.py says what it stopped), or one outside a run
        print(f"megatrain: {e}" if str(e).startswith("stopped") else "megatrain: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.command == "export":  # reads a checkpoint, not a config
        from .checkpoint.export import export_checkpoint

        res = export_checkpoint(args.source, args.out_dir, dtype=args.dtype, max_shard_mb=args.max_shard_mb)
        print(f"megatrain: exported {res['checkpoint']} to {res['path']} ({res['shards']} shard(s), "
              f"{res['bytes'] / 1e6:.1f} MB, {res['seconds']:.1f}s)", file=sys.stderr)
        return 0
    from .config import check_paths, load_command_line

    cfg = load_command_line(*_split(args.config, args.overrides))
    if args.command == "train":
        from .data.sources import check_files

        check_files(cfg.data, need=False)  # a missing data file named now, before seconds of importing torch
        read_at = time.time()
        from .run import train

        summary = train(cfg, since_process_start=True, config_read_at=read_at)  # checks every path (check_inputs)
        if (summary or {}).get("stopped_during") == "start-up":  # nothing produced: as a stop before the handler
            return 128 + signal.Signals[summary["stopped_by"]].value
    elif args.command == "plan":
        from .planner import plan_command
        from .planner.profile import default_profile_path

        check_paths(cfg, outputs=False, default_profile=default_profile_path())
        from .run.bounds import check_run_batch
        from .models import load_hf_config
        from .planner import World
        from .planner.plan import target_device
        from .planner.profile import load_profile

        prof = load_profile(cfg.plan.profile)  # the batch bounded before the planner walks it
        hf = load_hf_config(cfg.model.path, plan_only=True)
        _check_seq_len(cfg, hf)
        if cfg.preference.reference_path:  # its folder, config.json and weights, as train checks them
            from .run.reference import check_reference_path

            check_reference_path(cfg)
        check_run_batch(cfg, hf.hidden_size, target_device(cfg, prof), args.nnodes * args.nproc_per_node,
                        args.nproc_per_node, prof)
        return plan_command(cfg, as_json=args.json, world=World(args.nnodes, args.nproc_per_node))
    elif args.command == "data":
        from . import data as data_lib

        check_paths(cfg, outputs=False)
        if (Path(cfg.model.path) / "config.json").is_file():  # (a tokenizer folder alone previews the data)
            from .models import load_hf_config

            _check_seq_len(cfg, load_hf_config(cfg.model.path, plan_only=True))
        data_lib.validate_inputs(cfg.data)
        tok = data_lib.load_tokenizer(cfg.model.tokenizer or cfg.model.path,
                                      "model.tokenizer" if cfg.model.tokenizer else "model.path")
        print(data_lib.preview(cfg.data, tok, args.preview))
    return 0


def _check_seq_len(cfg, fields) -> None:
    """data.max_seq_len within the model's positions (`fields`: config.json read for the plan), refused as `megatrain
    train` refuses it (run/prepare.py): after config.json is read whole, as train reads it first, so that a config
    transformers cannot read is that error, as in train."""
    if cfg.data.max_seq_len > getattr(fields, "max_position_embeddings", cfg.data.max_seq_len):
        from .models import load_hf_config

        hf = load_hf_config(cfg.model.path)
        if cfg.data.max_seq_len > getattr(hf, "max_position_embeddings", cfg.data.max_seq_len):
            raise MegatrainError(f"data.max_seq_len: {cfg.data.max_seq_len} exceeds the model's "
                                 f"max_position_embeddings ({hf.max_position_embeddings})")


if __name__ == "__main__":
    sys.exit(main())
