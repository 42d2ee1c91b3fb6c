"""A resumed run whose frozen reference is loaded again from files (dpo's streamed reference, grpo's KL reference)
streams the files it started from: other weights there are refused by name before anything is written; the same
weights copied elsewhere keep their identity."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatrain.config import load_config
from megatrain.errors import MegatrainError
from megatrain.run.reference_weights import weights_identity
from preference_helpers import pair_config
from test_pref_grpo_hardening import TINY


def pretrained(tmp_path):
    """The demo model's config and tokenizer with random weights saved as transformers saves them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    return folder


def perturbed(folder):
    """The folder's weights with every tensor nudged, saved over them."""
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    tensors = {k: v + 1e-3 * torch.randn_like(v) for k, v in load_file(str(f)).items()}
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_the_identity_follows_the_weights_not_the_file(tmp_path):
    folder = pretrained(tmp_path)
    ident = weights_identity(folder)
    assert list(ident) == ["model.safetensors"]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    assert weights_identity(copy) == ident
    perturbed(copy)
    assert weights_identity(copy) != ident


def train(cfg, *overrides):
    from megatrain.run.trainer import train as run

    return run(load_config(cfg, list(overrides)))


@pytest.mark.parametrize("objective, section", [("dpo", {"preference": {"reference": "stream"}}),
                                                ("grpo", None)])
def test_a_resume_against_other_reference_weights_is_refused(tmp_path, objective, section):
    folder = pretrained(tmp_path)
    if objective == "dpo":
        cfg = pair_config(tmp_path, "dpo", train={"steps": 2}, checkpoint={"every": 2, "keep": 0}, **section)
    else:
        from test_grpo_run import grpo_config

        cfg = grpo_config(tmp_path, train={"steps": 2}, checkpoint={"every": 2, "keep": 0})  # (beta 0.05)
    model = [f"model.path={folder}", "model.init=pretrained"]
    train(cfg, *model)
    out = tmp_path / "run"
    state = json.loads((out / "checkpoints" / "step-2" / "run_state.json").read_text())
    assert state["reference"]["weights"] == weights_identity(folder)
    moved = tmp_path / "moved"
    folder.rename(moved)  # the same files elsewhere: the run goes on
    train(cfg, f"model.path={moved}", "model.init=pretrained", "resume=auto", "train.steps=3")
    moved.rename(folder)
    perturbed(folder)
    files = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(MegatrainError, match=r"reference weights in .* are not those checkpoint .* "
                                             r"\(model.safetensors has other contents\)"):
        train(cfg, *model, "resume=auto", "train.steps=4")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == files
