"""HostStore.init_random: each unit from its own generator (seed, position), so the values are the same whatever
the number of threads filling the units, and the same with the master on the SSD tier (filled unit by unit)."""

import pytest
import torch
from transformers import AutoConfig

from megatrain.models import get_adapter
from megatrain.runtime.store import HostStore


@pytest.fixture(scope="module")
def adapter():
    cfg = AutoConfig.for_model("qwen2", vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               tie_word_embeddings=False)
    return get_adapter(cfg)


def reference(adapter, seed: int, std: float) -> list[torch.Tensor]:
    """Each unit's master as one generator per unit draws it, spec after spec, on one thread."""
    out = []
    for i, u in enumerate(adapter.units()):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        parts = []
        for s in u.specs:
            n = s.numel
            parts.append(torch.empty(n).normal_(0.0, std, generator=g) if s.init == "normal" else
                         torch.ones(n) if s.init == "ones" else torch.zeros(n))
        out.append(torch.cat(parts))
    return out


@pytest.mark.parametrize("threads", [1, 3, None])
def test_values_do_not_depend_on_threads(adapter, threads):
    want = reference(adapter, 7, 0.02)
    store = HostStore(adapter, torch.bfloat16)
    store.init_random(7, 0.02, threads=threads)
    assert len(store.tiles) == len(want) > 3
    for t, w in zip(store.tiles, want):
        assert torch.equal(t.master, w)
        assert torch.equal(t.stream, w.to(torch.bfloat16))  # the streaming copy cast from it
        assert any(s.init != "normal" for s in t.unit.specs) or t.master.std() > 0.01
    fp32 = HostStore(adapter, torch.float32)  # fp32 streaming: the stream is the master
    fp32.init_random(7, 0.02, threads=threads)
    assert all(torch.equal(t.stream, w) for t, w in zip(fp32.tiles, want))


def test_master_on_the_ssd_tier_gets_the_same_values(adapter, tmp_path):
    want = reference(adapter, 3, 0.05)
    store = HostStore(adapter, torch.bfloat16, disk_path=str(tmp_path), disk_states=("v", "m", "master"))
    try:
        store.init_random(3, 0.05, threads=4)
        for i, w in enumerate(want):
            with store.unit_state(i, ("master",), read=True, write=False) as st:
                assert torch.equal(st["master"], w)
            assert torch.equal(store.tiles[i].stream, w.to(torch.bfloat16))
    finally:
        store.disk.close()
