"""`megatrain train | data` (plan, probe and export arrive with their issues): parse, validate, call."""

from __future__ import annotations

import argparse
import sys

from .errors import MegatrainError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatrain", description="Train Hugging Face causal LMs larger than GPU memory.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train (no CONFIG: the embedded tiny default)")
    t.add_argument("config", nargs="?", help="YAML config; omit for the embedded default")
    t.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. train.lr=1e-4")
    d = sub.add_parser("data", help="show what the model will see")
    d.add_argument("config", nargs="?")
    d.add_argument("overrides", nargs="*")
    d.add_argument("--preview", type=int, default=3, metavar="N", help="examples to print")
    return p


def _split(config: str | None, overrides: list[str]) -> tuple[str | None, list[str]]:
    # `megatrain train train.steps=10` means the default config with an override
    if config and "=" in config and not config.endswith((".yaml", ".yml")):
        return None, [config, *overrides]
    return config, overrides


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .config import load_config

    try:
        cfg = load_config(*_split(args.config, args.overrides))
        if args.command == "train":
            from .trainer import train

            train(cfg)
        elif args.command == "data":
            from . import data as data_lib
            from .trainer import _load_tokenizer

            data_lib.validate_inputs(cfg.data)
            print(data_lib.preview(cfg.data, _load_tokenizer(cfg.model.tokenizer or cfg.model.path), args.preview))
    except MegatrainError as e:
        print(f"megatrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megatrain: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
