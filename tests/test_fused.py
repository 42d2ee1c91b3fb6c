"""Fused q/k/v and gate/up projections (the CUDA default): views of adjacent tile rows, the same function as the
per-tensor form, and the same training step as transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir, tiny_hf_config
from megatrain.models import get_adapter
from megatrain.models.base import TensorSpec, Unit
from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel


def test_fused_views_are_the_members_rows(family):
    adapter = get_adapter(tiny_hf_config(family))
    unit = adapter.units()[1]
    flat = torch.randn(unit.numel)
    plain, fused = {}, unit.compute_views(flat)
    off = 0
    for s in unit.specs:
        plain[s.name] = flat[off: off + s.numel].view(s.shape)
        off += s.numel
    for name, members in unit.fused:
        assert torch.equal(fused[name], torch.cat([plain[m] for m in members]))
        assert fused[name].data_ptr() == plain[members[0]].data_ptr()  # a view, not a copy
        assert not any(m in fused for m in members)
    kept = set(plain) - {m for _, ms in unit.fused for m in ms}
    assert kept <= set(fused)
    assert sum(v.numel() for v in fused.values()) == unit.numel


def test_fused_groups_must_be_adjacent():
    a = TensorSpec("a", "a", (2, 3), True, "normal")
    b = TensorSpec("b", "b", (2, 3), True, "normal")
    c = TensorSpec("c", "c", (4, 3), True, "normal")
    Unit("layer", 0, (a, b, c), fused=(("ab", ("a", "b")),))
    with pytest.raises(ValueError, match="adjacent"):
        Unit("layer", 0, (a, c, b), fused=(("ab", ("a", "b")),))


def test_fused_layer_equals_per_tensor_layer(family):
    """Forward output and every gradient, fp32, fresh random weights and inputs."""
    torch.manual_seed(0)
    adapter = get_adapter(tiny_hf_config(family))
    unit = adapter.units()[1]
    flat = torch.randn(unit.numel, dtype=torch.float64) * 0.1
    B, T = 2, 11
    h = torch.randn(B, T, adapter.hidden_size, dtype=torch.float64)
    dh = torch.randn_like(h)
    ctx = adapter.make_context(torch.arange(T).expand(B, T), torch.float64, packed=False)
    out = {}
    for form in ("plain", "fused"):
        g = torch.zeros_like(flat)
        w = {k: v.detach().requires_grad_(True) for k, v in
             (unit.compute_views(flat) if form == "fused" else _plain(unit, flat)).items()}
        x = h.clone().requires_grad_(True)
        y = adapter.layer_forward(w, x, ctx)
        grads = torch.autograd.grad(y, [x, *w.values()], dh)
        gviews = unit.compute_views(g) if form == "fused" else _plain(unit, g)
        for acc, gi in zip(gviews.values(), grads[1:]):
            acc.add_(gi)
        out[form] = (y, grads[0], g)
    for a, b in zip(out["plain"], out["fused"]):
        assert rel(b, a) <= 1e-12  # float64: the two forms are the same function


def _plain(unit, flat):
    views, off = {}, 0
    for s in unit.specs:
        views[s.name] = flat[off: off + s.numel].view(s.shape)
        off += s.numel
    return views


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fused_engine_step_matches_transformers(tmp_path, family, tied):
    make_model_dir(tmp_path, family, tied=tied, seed=1)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa", dtype=torch.float32)
    mt = Megatrain(tmp_path)
    mt.engine.fuse = True
    opt = reference_optimizer(ref)
    for step in range(3):
        batches = random_batches(3, 2, 97, [13, 6, 9], seed=20 + step)
        ref_loss, ref_grads = reference_step(ref, opt, batches)
        loss, grads = mt.step(batches)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        for name, g in grads.items():
            assert rel(g, ref_grads[name]) <= 1e-5, f"gradient of {name} at step {step}"
    ref_params = dict(ref.named_parameters())
    for name, p in mt.params().items():
        assert rel(p, ref_params[name].detach()) <= 1e-5, f"updated {name}"
