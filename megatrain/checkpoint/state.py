"""The part of a checkpoint that is not tensors: the run state (JSON) and the model's small files.

Every global generator is saved, used today or not (megatrain's own randomness is seeded per purpose: the data
order is a pure function of seed, epoch and cursor; random init of seed and unit), so code added later that
draws from them resumes exactly too.
"""

from __future__ import annotations

import base64
import json
import platform
import random
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import MegatrainError


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng() -> dict:
    version, state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    out = {
        "torch": _b64(torch.get_rng_state()),
        "python": {"version": version, "state": list(state), "gauss": gauss},
        "numpy": {"name": np_name, "keys": np_keys.tolist(), "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "gauss": float(np_gauss)},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = [_unb64(s) for s in state["cuda"]]
        if len(cuda) == torch.cuda.device_count():  # a different GPU count: the CUDA generators start fresh
            torch.cuda.set_rng_state_all(cuda)


def package_versions() -> dict:
    import safetensors
    import transformers

    from .. import __version__

    return {"megatrain": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "numpy": np.__version__, "python": platform.python_version()}


def run_state(*, step: int, lr: float | None, config: dict, loader_state: dict, summary: dict,
              reference: dict | None = None) -> dict:
    """Everything besides the store that step `step + 1` depends on, captured at the step boundary. reference: a
    dpo or ipo run's reference log-probs (run/reference.py's Reference.state: the strategy, and the file of
    precomputed log-probs the run was trained against, in output.dir/reference)."""
    t = config["train"]
    schedule = {k: t[k] for k in ("lr", "lr_schedule", "warmup_steps", "steps", "min_lr_ratio")}
    out = {"step": step, "lr_schedule": {**schedule, "last_lr": lr}, "loader": loader_state,
           "rng": capture_rng(), "config": config, "versions": package_versions(), "summary": summary}
    if reference is not None:
        out["reference"] = reference
    return out


MODEL_FILES = ("config.json", "generation_config.json")  # generation_config.json: when the model has one


def model_files_writer(model_path: str | Path, tokenizer) -> Callable[[Path], None]:
    """Writes what an export needs besides weights: config.json, generation_config.json, the run's tokenizer
    (with data.chat_template applied to it), so a checkpoint exports even if the model directory is gone.

    The config files are read now, once (call it at start-up, before the first step), and every checkpoint gets
    these bytes: the model folder edited or removed during a run cannot make a checkpoint record a config other than
    the one its weights were built from (such a checkpoint could be neither resumed nor exported)."""
    model_path = Path(model_path)
    files = {}
    for name in MODEL_FILES:
        p = model_path / name
        if name != "config.json" and not p.is_file():
            continue
        try:
            files[name] = p.read_bytes()
        except OSError as e:
            raise MegatrainError(f"model.path: cannot read {p}: {e.strerror or e}") from None

    def write(dest: Path) -> None:
        for name, data in files.items():
            (dest / name).write_bytes(data)
        if tokenizer is not None:
            save_tokenizer(tokenizer, dest / "tokenizer")

    return write


LOADER_ARGUMENTS = ("local_files_only", "is_local")  # how megatrain loaded the tokenizer, which transformers saves


def save_tokenizer(tokenizer, folder: Path) -> None:
    """tokenizer.save_pretrained, without the loader's own arguments in tokenizer_config.json (an export's
    tokenizer is the user's, not a record of how this run opened it)."""
    tokenizer.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    if path.is_file():
        config = json.loads(path.read_text())
        if any(k in config for k in LOADER_ARGUMENTS):
            path.write_text(json.dumps({k: v for k, v in config.items() if k not in LOADER_ARGUMENTS}, indent=2,
                                       ensure_ascii=False) + "\n")
