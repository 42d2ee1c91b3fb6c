"""The llama-style rope without transformers' modeling_llama (models/decoder.llama_rope): inv_freq and the attention
scaling exactly as transformers' LlamaRotaryEmbedding computes them, for every real config here whose rope is one
set of parameters (llama 3's, linear, yarn and the default among them), and the adapters' own tables equal to it."""

import copy
import os
from pathlib import Path

import pytest
import torch

from megatrain.models import get_adapter, load_hf_config
from megatrain.models.decoder import llama_rope

ROOT = Path(__file__).resolve().parent.parent
DIRS = sorted({p.name: p for base in (ROOT / "bench" / "model-configs", Path("/work/shared/model-configs"))
               if base.is_dir() for p in base.iterdir() if (p / "config.json").is_file()}.items())


def _reference(cfg):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(copy.deepcopy(cfg))
    return rotary.inv_freq, float(rotary.attention_scaling)


def _one_rope(cfg) -> bool:
    params = getattr(cfg, "rope_parameters", None)
    return isinstance(params, dict) and isinstance(params.get("rope_type"), str)


@pytest.mark.parametrize("name,path", DIRS, ids=[n for n, _ in DIRS])
def test_llama_rope_equals_transformers(name, path):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    if not _one_rope(cfg):
        pytest.skip(f"{name}: rope parameters per layer type (the family computes its own)")
    inv, scale = llama_rope(copy.deepcopy(cfg))
    ref_inv, ref_scale = _reference(cfg)
    assert inv.dtype == ref_inv.dtype and torch.equal(inv, ref_inv)
    assert scale == ref_scale


@pytest.mark.parametrize("name,path", DIRS, ids=[n for n, _ in DIRS])
def test_adapter_tables_equal_transformers(name, path):
    """The adapter's inv_freq and rope_scaling (read when a layer first runs) for the families on the llama path."""
    cfg = load_hf_config(str(path))
    adapter = get_adapter(cfg)
    if "inv_freq" in vars(adapter) or not _one_rope(cfg):
        pytest.skip(f"{name}: the family sets its own tables")
    ref_inv, ref_scale = _reference(cfg)
    assert torch.equal(adapter.inv_freq, ref_inv.detach().float()) and adapter.rope_scaling == ref_scale


def test_default_rope_when_the_config_names_none():
    """A config without rope parameters of its own (transformers' default type, theta 10000 filled in)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=96, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      num_hidden_layers=1, vocab_size=64)
    assert cfg.rope_parameters["rope_type"] == "default"
    inv, scale = llama_rope(cfg)
    ref_inv, ref_scale = _reference(cfg)
    assert torch.equal(inv, ref_inv) and scale == ref_scale


def test_the_tables_import_no_modeling_module():
    """Reading a llama adapter's rope tables loads no family modeling module of transformers (modeling_llama: seconds, it loads modeling_utils)."""
    import subprocess
    import sys

    code = ("import sys; from megatrain.models import get_adapter, load_hf_config; "
            f"a = get_adapter(load_hf_config({str(ROOT / 'bench' / 'model-configs' / 'llama-3.1-8b')!r})); "
            "a.inv_freq; print(sorted(m for m in sys.modules if m.startswith('transformers.models.')"
            " and 'modeling_' in m and not m.startswith('transformers.models.auto')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]"
