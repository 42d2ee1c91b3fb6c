"""Export round trip: a trained run's checkpoint -> a Hugging Face model directory that transformers loads, whose
logits equal megatrain's own forward, with tokenizer, chat template and generation config; bad input named."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatrain.checkpoint.resume import load_store, open_checkpoint
from megatrain.runtime.engine import CollectGrads, Engine
from megatrain.errors import MegatrainError
from megatrain.checkpoint.export import export_checkpoint
from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime.store import HostStore
from test_checkpoint_helpers import CHAT_TEMPLATE, run, setup_run
from conftest import reference_attention


def megatrain_logits(ckpt, ids, lengths) -> torch.Tensor:
    """megatrain's own forward (fp32) on the checkpoint's weights."""
    adapter = get_adapter(load_hf_config(ckpt))
    store = HostStore(adapter, torch.float32)
    load_store(open_checkpoint(ckpt), store)
    return Engine(store, adapter, torch.device("cpu"), CollectGrads()).next_token_logits(ids, lengths)


def sample_inputs(vocab: int = 29):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (3, 11), generator=g)
    lengths = torch.tensor([11, 7, 4])  # right-padded rows: the logits at each row's last real token
    return ids, lengths


@pytest.mark.parametrize("family,tied", [("llama", False), ("mistral", False), ("qwen2", False), ("qwen3", False),
                                         ("llama", True), ("qwen3", True), ("gemma2", True), ("gemma3_text", True)],
                         ids=["llama", "mistral", "qwen2", "qwen3", "llama-tied", "qwen3-tied", "gemma2-tied",
                              "gemma3-tied"])
def test_export_at_end_loads_in_transformers_with_equal_logits(tmp_path, family, tied):
    cfg = setup_run(tmp_path, family, tied, train={"steps": 2}, data={"chat_template": CHAT_TEMPLATE},
                    export={"at_end": True, "dtype": "fp32", "max_shard_mb": 0.05})
    summary = run(cfg)
    out = tmp_path / "run" / "export"
    assert summary["export"] == str(out)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)  # 0.05 MB shards: several
    assert ("lm_head.weight" in index["weight_map"]) == (not tied)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["tie_word_embeddings"] == tied
    assert (out / "generation_config.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                 attn_implementation=reference_attention(family))
    ids, lengths = sample_inputs()
    with torch.no_grad():
        hf = model(input_ids=ids).logits[torch.arange(3), lengths - 1]
    mine = megatrain_logits(tmp_path / "run" / "checkpoints" / "step-2", ids, lengths)
    torch.testing.assert_close(hf, mine, rtol=1e-5, atol=1e-5)
    # the trained weights, not the initial ones
    initial = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    assert not torch.equal(initial.model.layers[0].mlp.up_proj.weight, model.model.layers[0].mlp.up_proj.weight)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.chat_template == CHAT_TEMPLATE  # data.chat_template travels with the model
    written = json.loads((out / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local"} & set(written)  # not how this run loaded it: the user's tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<s>user: hi</s>"


def test_cli_export_bf16_from_a_run_dir(tmp_path):
    cfg = setup_run(tmp_path, "qwen2", train={"steps": 3}, checkpoint={"every": 1, "keep": 0})
    run(cfg)
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "export", str(tmp_path / "run"), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ckpt = tmp_path / "run" / "checkpoints" / "step-3"  # the run's newest checkpoint
    assert f"exported {ckpt} to {out}" in r.stderr
    exported = {}
    for shard in set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()):
        exported.update(load_file(out / shard))
    adapter = get_adapter(load_hf_config(ckpt))
    store = HostStore(adapter, torch.float32)
    load_store(open_checkpoint(ckpt), store)
    masters = {s.hf_name: v for t in store.tiles for s, v in zip(t.unit.specs, t.views(t.master).values())}
    assert exported.keys() == masters.keys()
    for name, v in masters.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], v.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16


def test_export_bad_input(tmp_path):
    cfg = setup_run(tmp_path, train={"steps": 1})
    run(cfg)
    ckpt = tmp_path / "run" / "checkpoints" / "step-1"

    r = subprocess.run([sys.executable, "-m", "megatrain.cli", "export", str(tmp_path / "nope"), str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"megatrain: error: export: {tmp_path / 'nope'} does not exist"]

    def error(*args, **kw) -> str:
        with pytest.raises(MegatrainError) as e:
            export_checkpoint(*args, **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "no complete checkpoint" in error(tmp_path / "model", tmp_path / "o")
    assert f"{tmp_path / 'model'} is not empty" in error(ckpt, tmp_path / "model")
    assert "dtype 'fp8'" in error(ckpt, tmp_path / "o", dtype="fp8")
    unit = ckpt / "unit-00001-layer0.safetensors"
    data = bytearray(unit.read_bytes())
    data[-5] ^= 0x40  # in the Adam states: not exported, but still checked
    unit.write_bytes(bytes(data))
    assert f"{unit}: checksum mismatch" in error(ckpt, tmp_path / "o")
    assert not (tmp_path / "o").exists() and not any(p.name.startswith(".o") for p in tmp_path.iterdir())


def test_export_dir_is_checked_before_training(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    cfg = setup_run(tmp_path, train={"steps": 1}, export={"at_end": True, "dir": str(tmp_path / "other")})
    from megatrain.config import load_config
    from megatrain.run.trainer import prepare

    with pytest.raises(MegatrainError, match="export: .*other is not empty"):
        prepare(load_config(cfg))
    with pytest.raises(MegatrainError, match="export.dir: .*model is model.path"):  # (test_hardening: overlaps)
        prepare(load_config(cfg, [f"export.dir={tmp_path / 'model'}"]))
