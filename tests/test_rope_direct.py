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


FAMILY_ROTARY = {  # model_type -> transformers' rotary embedding class the family's tables must equal
    "gemma2": "transformers.models.gemma2.modeling_gemma2.Gemma2RotaryEmbedding",
    "gemma3_text": "transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
    "gemma3": "transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding",
    "olmo2": "transformers.models.olmo2.modeling_olmo2.Olmo2RotaryEmbedding",
    "phi3": "transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding",
}


def _family_reference(cfg) -> dict[str, tuple[torch.Tensor, float]]:
    """Per layer type (or "" for one set), transformers' own tables for the family."""
    import importlib

    module, name = FAMILY_ROTARY[cfg.model_type].rsplit(".", 1)
    rotary = getattr(importlib.import_module(module), name)(copy.deepcopy(cfg))
    out = {lt: (getattr(rotary, f"{lt}_inv_freq"), float(getattr(rotary, f"{lt}_attention_scaling")))
           for lt in ("full_attention", "sliding_attention") if hasattr(rotary, f"{lt}_inv_freq")}
    return out or {"": (rotary.inv_freq, float(rotary.attention_scaling))}


def _variants(cfg):
    """The config as shipped, and with its rope made linear (factor 4) and, for phi3, partial (0.5): the direct
    formulas' other branches."""
    yield "as shipped", cfg
    linear = copy.deepcopy(cfg)
    params = linear.rope_parameters
    for p in (params.values() if isinstance(params.get("full_attention"), dict) else [params]):
        if isinstance(p, dict):
            p.update(rope_type="linear", factor=4.0)
    yield "linear", linear
    if cfg.model_type == "phi3":
        partial = copy.deepcopy(cfg)
        partial.rope_parameters["partial_rotary_factor"] = 0.5
        yield "partial", partial


FAMILY_DIRS = [(n, p) for n, p in DIRS if __import__("json").loads((p / "config.json").read_text())
               .get("model_type") in FAMILY_ROTARY]


@pytest.mark.parametrize("name,path", FAMILY_DIRS, ids=[n for n, _ in FAMILY_DIRS])
def test_family_tables_equal_their_transformers_class(name, path):
    """Gemma 2 and 3 (per layer type), OLMo 2 and Phi-3 compute their rope tables without transformers' modeling
    modules (decoder.static_rope): equal bit for bit to the family's own rotary class, for the real config and for
    the linear type (and phi3's partial rotation)."""
    from megatrain.models import ADAPTERS

    assert len(FAMILY_DIRS) >= 4
    base = load_hf_config(str(path))
    for what, cfg in _variants(base):
        adapter = ADAPTERS[cfg.model_type](cfg) if cfg.model_type in ADAPTERS else get_adapter(cfg)
        ref = _family_reference(cfg)
        ropes = getattr(adapter, "ropes", None)
        for lt, (ref_inv, ref_scale) in ref.items():
            inv, scale = ropes["sliding" if lt == "sliding_attention" else "full"] if ropes else \
                (adapter.inv_freq, adapter.rope_scaling)
            assert torch.equal(inv, ref_inv.detach().float()), (what, lt)
            assert scale == ref_scale, (what, lt)


def test_gpt_oss_tables_equal_its_rotary_embedding_without_importing_it():
    """gpt_oss's tables (yarn) equal GptOssRotaryEmbedding's, and reading them loads neither modeling_gpt_oss nor what
    it pulls in (torch._dynamo, triton: whose bindings report leaked objects when `megatrain plan` exits)."""
    import subprocess
    import sys

    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    path = ROOT / "bench" / "model-configs" / "gpt-oss-20b"
    cfg = load_hf_config(str(path))
    adapter = get_adapter(cfg)
    ref = GptOssRotaryEmbedding(copy.deepcopy(cfg))
    assert cfg.rope_parameters["rope_type"] == "yarn"
    assert torch.equal(adapter.inv_freq, ref.inv_freq.detach().float())
    assert adapter.rope_scaling == float(ref.attention_scaling)
    code = ("import sys; from megatrain.models import get_adapter, load_hf_config; "
            f"a = get_adapter(load_hf_config({str(path)!r})); a.inv_freq; "
            "print(sorted(m for m in sys.modules if m in ('triton', 'torch._dynamo') or 'modeling_gpt_oss' in m))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]" and "leaked" not in p.stderr
