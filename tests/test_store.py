"""HostStore: layout, loading memory, schedules of the optimizer that writes it."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import make_model_dir
from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime.adamw import lr_at
from megatrain.runtime.store import PAGE, HostStore


def test_tiles_are_page_aligned_and_laid_out_by_spec(tmp_path):
    make_model_dir(tmp_path, "qwen2", seed=61)
    st = HostStore(get_adapter(load_hf_config(tmp_path)), torch.bfloat16)
    for t in st.tiles:
        for buf in (t.master, t.exp_avg, t.exp_avg_sq, t.stream):
            assert buf.data_ptr() % PAGE == 0
        decay = [s.decay for s in t.unit.specs]
        assert decay == sorted(decay, reverse=True), "decayed tensors first: the optimizer splits the tile once"
    assert st.host_bytes() == st.total_elems * 14
    st32 = HostStore(get_adapter(load_hf_config(tmp_path)), torch.float32)
    assert st32.stream.data_ptr() == st32.master.data_ptr() and st32.host_bytes() == st32.total_elems * 12


LOAD_SCRIPT = textwrap.dedent("""
    import json, resource, sys, torch
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime.store import HostStore
    d = sys.argv[1]
    adapter = get_adapter(load_hf_config(d))
    store = HostStore(adapter, torch.bfloat16)
    for buf in (store.master, store.exp_avg, store.exp_avg_sq, store.stream):
        buf.fill_(1)  # make the whole store resident first, so what follows measures the loader alone
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    store.load_safetensors(d)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    unit = max(u.numel for u in store.units) * 4
    print(json.dumps({"growth": peak - base, "model_fp32": store.num_params * 4, "unit": unit}))
""")


def test_loading_peaks_within_store_plus_one_layer(tmp_path):
    """Loading streams unit by unit from the safetensors files: never a second copy of the model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", vocab_size=4096, hidden_size=512, intermediate_size=1536,
                               num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=8)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, max_shard_size="40MB")
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # beyond the store, the loader may hold about one unit (plus allocator slack); a second copy of the model
    # (here 0.18 GB in fp32, more than four times that bound) would not pass
    assert r["growth"] <= 2 * r["unit"] + 16 * 2**20, r
    assert r["model_fp32"] > 4 * (2 * r["unit"] + 16 * 2**20)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_schedules(schedule):
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, schedule=schedule, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(14)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup reaches the peak at the last warmup step
    if schedule == "constant":
        assert all(x == 1.0 for x in lrs[4:])
    else:
        assert lrs[4] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
        assert lr_at(14, **kw) == pytest.approx(0.1)  # decays to min_lr_ratio * lr at the end
    if schedule == "cosine":
        assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half way
