"""Bad input: one clear line naming the key, file, line or tensor; nothing written to output.dir."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import make_model_dir
from megatrain.config import load_config
from megatrain.errors import ConfigError, MegatrainError
from megatrain.run.trainer import prepare
from megatrain.models import ADAPTERS


def write_config(tmp_path, model_dir, data_file, **train):
    cfg = {
        "model": {"path": str(model_dir), "init": "pretrained"},
        "data": {"path": str(data_file), "format": "text", "max_seq_len": 32},
        "train": {"steps": 2, "micro_batch_size": 2, "precision": "fp32", **train},
        "output": {"dir": str(tmp_path / "out")},
    }
    import yaml

    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.fixture
def setup(tmp_path):
    from transformers import PreTrainedTokenizerFast

    model_dir = tmp_path / "model"
    make_model_dir(model_dir, "llama")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz "))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>").save_pretrained(model_dir)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": "hello world " * 3}) + "\n" for _ in range(8)))
    return tmp_path, model_dir, data


def error_of(tmp_path, cfg_path, *overrides) -> str:
    with pytest.raises(MegatrainError) as e:
        prepare(load_config(cfg_path, list(overrides)))
    assert not (tmp_path / "out").exists(), "nothing may be written before the inputs are validated"
    msg = str(e.value)
    assert "Traceback" not in msg
    return msg


def test_valid_setup_prepares(setup):
    tmp_path, model_dir, data = setup
    run = prepare(load_config(write_config(tmp_path, model_dir, data)))
    assert run.store.num_params > 0 and not (tmp_path / "out").exists()


def test_config_errors_are_all_reported_with_lines_and_suggestions(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\ntrain:\n  lr: fast\n  setps: 3\n  lr_schedule: exp\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, ["train.micro_batch_size=0"])
    msg = str(e.value)
    assert "4 problems" in msg
    assert f"{p}:4: train.lr" in msg and "'fast'" in msg
    assert f"{p}:5: train.setps: unknown key; did you mean 'train.steps'?" in msg
    assert f"{p}:6: train.lr_schedule" in msg and "'constant', 'linear' or 'cosine'" in msg
    assert "command line: train.micro_batch_size" in msg


def test_malformed_yaml_names_line(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  path: x\n train: [\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+: malformed YAML"):
        load_config(p)


def test_missing_model_dir(setup):
    tmp_path, model_dir, data = setup
    msg = error_of(tmp_path, write_config(tmp_path, tmp_path / "nope", data))
    assert "model.path" in msg and "nope" in msg and "does not exist" in msg


def test_missing_and_malformed_config_json(setup):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    (model_dir / "config.json").rename(model_dir / "config.bak")
    assert "config.json is missing" in error_of(tmp_path, cfg)
    (model_dir / "config.json").write_text('{"model_type": "llama",\n "hidden_size": }')
    assert "config.json:2: malformed JSON" in error_of(tmp_path, cfg)
    (model_dir / "config.json").write_text('{"model_type": "gpt2"}')
    msg = error_of(tmp_path, cfg)
    assert "'gpt2' is not supported" in msg and ", ".join(sorted(ADAPTERS)) in msg


def test_safetensors_shape_and_name_mismatch(setup):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    f = model_dir / "model.safetensors"
    good = load_file(f)
    bad = dict(good)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, f)
    msg = error_of(tmp_path, cfg)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "[3, 3]" in msg and "model.safetensors" in msg
    bad = dict(good)
    del bad["model.layers.2.self_attn.q_proj.weight"]
    save_file(bad, f)
    assert "'model.layers.2.self_attn.q_proj.weight' (layer 2) is missing" in error_of(tmp_path, cfg)
    bad = dict(good)
    bad["model.layers.9.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(bad, f)
    assert "model.layers.9.mlp.up_proj.weight" in error_of(tmp_path, cfg)


def test_data_file_missing_empty_or_without_field(setup):
    tmp_path, model_dir, data = setup
    cfg = write_config(tmp_path, model_dir, data)
    msg = error_of(tmp_path, cfg, f"data.path={tmp_path / 'missing.jsonl'}")
    assert "data.path" in msg and "missing.jsonl" in msg
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "empty" in error_of(tmp_path, cfg, f"data.path={empty}")
    wrong = tmp_path / "wrong.jsonl"
    wrong.write_text(json.dumps({"content": "x"}) + "\n")
    msg = error_of(tmp_path, cfg, f"data.path={wrong}")
    assert "wrong.jsonl" in msg and "text" in msg


def test_cli_prints_one_line_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "train", "train.stepz=3"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2
    assert "did you mean 'train.steps'" in r.stderr and "Traceback" not in r.stderr


def test_the_profile_sets_the_optimizers_chunks_per_call(setup):
    """A profile's cpu.adamw_chunks_per_call reaches the run's CPU AdamW (runtime/adamw.CpuAdamW); without it, one."""
    tmp_path, model_dir, data = setup
    run = prepare(load_config(write_config(tmp_path, model_dir, data)))
    assert run.runtime.pipeline.optimizer.chunks_per_call == 1
    run.runtime.close()
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"host": "", "cpu": {"adamw_params_per_s": 2e9, "adamw_chunks_per_call": 4}}))
    run = prepare(load_config(write_config(tmp_path, model_dir, data), [f"plan.profile={profile}"]))
    assert run.runtime.pipeline.optimizer.chunks_per_call == 4
    run.runtime.close()
