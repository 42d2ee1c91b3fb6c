"""Mixture-of-experts families (qwen3_moe, mixtral, olmoe) beyond the tests every family runs (conftest.FAMILIES:
one step and 20 steps of unequal padded micro-batches equal transformers + torch AdamW at 1e-5 with the router
loss, tied and untied, bf16, placements, checkpoints, export): the router loss and the padding mask matter, the
stacked experts map to the checkpoint's per-expert tensors, metrics, refusals, real configs, the planner."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import make_model_dir, tiny_hf_config
from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from test_equivalence import TOL, load_reference

from megatrain.errors import MegatrainError
from megatrain.models import get_adapter, load_hf_config
from megatrain.runtime.router_loss import expert_load

MOE = ["qwen3_moe", "mixtral", "olmoe"]
CONFIGS = Path(__file__).resolve().parents[1] / "bench" / "model-configs"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "model-configs"


@pytest.mark.parametrize("family", MOE)
def test_router_loss_and_padding_mask_have_teeth(tmp_path, family):
    """Two padded micro-batches: megatrain equals the reference; without the router loss, or counting padding
    tokens in the router statistics, the router's gradient is off by far more than the tolerance."""
    make_model_dir(tmp_path, family, seed=1)
    batches = random_batches(2, 3, 97, [13, 9], seed=2)
    assert any((b["attention_mask"] == 0).any() for b in batches)
    ref = load_reference(tmp_path)
    ref_loss, ref_grads = reference_step(ref, reference_optimizer(ref), batches)
    router = [n for n in ref_grads if n.endswith("mlp.gate.weight")]
    assert len(router) == 3

    def worst(mt, bs):
        loss, grads = mt.step(bs)
        return abs(loss - ref_loss) / abs(ref_loss), max(rel(grads[n], ref_grads[n]) for n in router)

    loss_err, grad_err = worst(Megatrain(tmp_path), batches)
    assert loss_err <= TOL and grad_err <= TOL
    no_aux = Megatrain(tmp_path)
    no_aux.adapter.router_aux_coef = 0.0
    assert worst(no_aux, batches)[1] > 100 * TOL
    unmasked = [{k: v for k, v in b.items() if k != "attention_mask"} for b in batches]
    assert worst(Megatrain(tmp_path), unmasked)[1] > 100 * TOL


def test_router_loss_is_the_mean_over_microbatches(tmp_path):
    """The step's router loss: the mean of its micro-batches' (transformers' aux for one forward each)."""
    make_model_dir(tmp_path, "qwen3_moe", seed=3)
    batches = random_batches(3, 2, 97, [7, 11, 9], seed=4)
    ref = load_reference(tmp_path)
    auxes = []
    with torch.no_grad():
        for b in batches:
            out = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])
            auxes.append(out.aux_loss.item())
    mt = Megatrain(tmp_path)
    from megatrain.runtime import MicroBatch

    out = mt.engine.train_step([MicroBatch.from_labels(b["input_ids"], b["labels"], None, b["attention_mask"])
                                for b in batches])
    coef = ref.config.router_aux_loss_coef
    assert out.aux_loss.item() == pytest.approx(coef * sum(auxes) / 3, rel=1e-5)
    counts = out.expert_counts
    assert counts.shape == (3, 4)  # MoE layers x experts
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    assert torch.all(counts.sum(-1) == 2 * real)  # every real token routed to its top 2, in every layer
    mt.pipeline.finish_step(lr=0.0, clip_coef=1.0)
    mt.close()


def test_expert_load_metrics():
    balanced = expert_load(torch.full((2, 4), 5.0))
    assert balanced == {"expert_load_min": 1.0, "expert_load_max": 1.0, "expert_entropy": pytest.approx(1.0)}
    skewed = expert_load(torch.tensor([[10.0, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]]))
    assert skewed["expert_load_min"] == 0.0 and skewed["expert_load_max"] == 4.0
    assert skewed["expert_entropy"] == pytest.approx(0.5)


def test_stacked_experts_are_the_checkpoints_per_expert_tensors(tmp_path):
    """Each expert's gate, up and down rows in megatrain's stacked tensors are exactly the checkpoint's tensors
    (mixtral's w1, w3, w2 and its block_sparse_moe router) and the training run writes them back by those names."""
    from safetensors import safe_open

    make_model_dir(tmp_path, "mixtral", seed=5)
    mt = Megatrain(tmp_path)
    params = mt.params()
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        gate_up = params["model.layers.1.mlp.experts.gate_up_proj"]
        assert gate_up.shape == (4, 2, 160, 64)
        assert torch.equal(gate_up[2, 0], f.get_tensor("model.layers.1.block_sparse_moe.experts.2.w1.weight"))
        assert torch.equal(gate_up[2, 1], f.get_tensor("model.layers.1.block_sparse_moe.experts.2.w3.weight"))
        assert torch.equal(params["model.layers.1.mlp.experts.down_proj"][3],
                           f.get_tensor("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
        assert torch.equal(params["model.layers.1.mlp.gate.weight"],
                           f.get_tensor("model.layers.1.block_sparse_moe.gate.weight"))
    mt.close()


@pytest.mark.parametrize("family", MOE)
def test_training_run_exports_and_logs_expert_load(tmp_path, family):
    """`megatrain train` on a MoE model: the metrics carry the router loss and expert load, and the export loads
    in transformers with megatrain's logits."""
    from test_checkpoint_helpers import records, run, setup_run
    from test_export import megatrain_logits, sample_inputs

    cfg = setup_run(tmp_path, family, False, train={"steps": 2},
                    export={"at_end": True, "dtype": "fp32"})
    run(cfg)
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert recs and all({"router_loss", "expert_load_min", "expert_load_max", "expert_entropy"} <= set(r)
                        for r in recs)
    assert all(0 < r["router_loss"] < r["loss"] for r in recs)
    out = tmp_path / "run" / "export"
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any("gate_up_proj" in n for n in names)  # the checkpoint's per-expert layout
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa")
    ids, lengths = sample_inputs()
    with torch.no_grad():
        hf = model(input_ids=ids).logits[torch.arange(3), lengths - 1]
    mine = megatrain_logits(tmp_path / "run" / "checkpoints" / "step-2", ids, lengths)
    torch.testing.assert_close(hf, mine, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,match", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
])
def test_unsupported_options_are_refused(change, match):
    cfg = tiny_hf_config("mixtral" if "jitter" in match else "qwen3_moe")
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(MegatrainError, match=match):
        get_adapter(cfg)


# (total, active) parameters as the model cards give them, in billions
SIZES = {"qwen3-30b-a3b": (30.5, 3.3), "mixtral-8x7b": (46.7, 12.9), "olmoe-1b-7b": (6.9, 1.3)}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_real_configs_total_and_active_parameters(name):
    d = CONFIGS / name if (CONFIGS / name).is_dir() else SHARED / name
    if not d.is_dir():
        pytest.skip(f"{name}/config.json is not in this checkout")
    cfg = load_hf_config(d)
    ad = get_adapter(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(u.numel for u in ad.units())
    assert total == sum(p.numel() for p in model.parameters())
    active = sum(ad.active_numel(u) for u in ad.units())
    want_total, want_active = SIZES[name]
    assert total / 1e9 == pytest.approx(want_total, rel=0.02)
    assert active / 1e9 == pytest.approx(want_active, rel=0.05)


def test_plan_counts_active_flops_and_all_bytes():
    """The planner: host bytes by all parameters, compute by the active ones (6·N_total and 6·N_active)."""
    from megatrain.planner.flops import active_params, flops_per_token

    ad = get_adapter(tiny_hf_config("qwen3_moe"))
    total = sum(u.numel for u in ad.units())
    active = active_params(ad)
    experts = sum(s.numel for u in ad.units() for s in u.specs if s.name.startswith("mlp.experts."))
    assert active == total - experts // 2  # top 2 of 4 experts
    six_n, model_flops = flops_per_token(ad, 16)
    assert six_n == 6.0 * total and model_flops < 6.0 * active + 1e6


def test_grouped_experts_equal_the_loop_on_cpu():
    """The CUDA bf16 path's logic (pairs sorted by expert, rows gathered into expert order and back through the
    inverse permutation with gathers both ways, grouped GEMMs, the combine summing the k slots) run on CPU in fp32
    (torch._grouped_mm has a CPU kernel): equal to transformers' loop, forward and every gradient, with an expert
    that no token picks."""
    from megatrain.models.moe import _grouped_ffn, _looped_ffn

    g = torch.Generator().manual_seed(4)
    N, H, I, E, k = 96, 32, 48, 8, 2
    x = torch.randn(N, H, generator=g)
    logits = torch.randn(N, E, generator=g)
    logits[:, 5] = -1e9  # expert 5 gets no token: an empty group
    top_p, top_i = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    weights = [top_p / top_p.sum(-1, keepdim=True), torch.randn(E, 2 * I, H, generator=g) * H**-0.5,
               torch.randn(E, H, I, generator=g) * I**-0.5]
    out = {}
    for name, fn in (("grouped", _grouped_ffn), ("looped", _looped_ffn)):
        ts = [t.clone().requires_grad_(True) for t in (x, *weights)]
        y = fn(ts[0], top_i, *ts[1:])
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        out[name] = [y.detach()] + [t.grad for t in ts]
    assert (top_i == 5).sum() == 0
    for label, a, b in zip(("y", "dx", "dtop_w", "dgate_up", "ddown"), out["grouped"], out["looped"]):
        assert rel(a, b) <= 1e-6, label
