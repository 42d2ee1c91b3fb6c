"""Records of the GPU tests: each writes its measurements as JSON into $MEGATRAIN_GPU_RESULTS when that is set (a
device call sets it to its output folder, so the results can be committed under bench/results/), in the layout of
the benchmarks' JSON: date, machine, git revision (MEGATRAIN_REV when set: the device's copy of the tree has no
usable git history), command, result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ENV = "MEGATRAIN_GPU_RESULTS"


def _git_rev() -> str:
    if os.environ.get("MEGATRAIN_REV", "unknown") != "unknown":
        return os.environ["MEGATRAIN_REV"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def write_result(name: str, test: str, result) -> Path | None:
    """Write {date, machine, git, command, result} to $MEGATRAIN_GPU_RESULTS/<name>.json; None when unset."""
    folder = os.environ.get(ENV)
    if not folder:
        return None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "machine": f"{gpu}, {os.cpu_count()} CPUs, torch {torch.__version__}", "git": _git_rev(),
               "command": f"pytest {test} ({' '.join(sys.argv[1:])})", "result": result}
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
    return path
