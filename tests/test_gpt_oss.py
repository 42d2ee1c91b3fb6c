"""gpt_oss beyond the tests every family runs (conftest.FAMILIES: one step and 20 steps of unequal padded
micro-batches equal transformers + torch AdamW at 1e-5 with the router loss, tied and untied; the planner's host
buffers): the sink attention kernel piece against the explicit formula, each gpt_oss-specific piece matters, the
router loss and padding mask, packed rows, bf16, MXFP4 checkpoints (dequantization as transformers', a tiny MXFP4
checkpoint loading to transformers' values, training from it and exporting), refusals, real configs, the planner."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import make_model_dir, tiny_hf_config
from reference import Megatrain, random_batches, reference_optimizer, reference_step, rel
from test_equivalence import TOL, load_reference

from megatrain.errors import MegatrainError
from megatrain.models import attention, get_adapter, load_hf_config
from megatrain.models.base import AttnContext
from megatrain.models.gpt_oss import dequantize_mxfp4

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "bench" / "model-configs"


# ---- 1. the kernel-level piece: sink attention from a log-sum-exp ---------------------------------------------------
def _qkv(B=2, H=4, KV=2, T=29, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, n, T, d, generator=g) for n in (H, KV, KV))
    sinks = torch.randn(H, generator=g)
    return q, k, v, sinks


def _mask(B, T, window=None, docs=None):
    qi = torch.arange(T)
    m = qi[:, None] >= qi[None, :]
    if window:
        m = m & (qi[None, :] > qi[:, None] - window)
    m = m[None, None].expand(B, 1, T, T)
    if docs is not None:  # docs [B, T]: document number of each position
        m = m & (docs[:, :, None] == docs[:, None, :])[:, None]
    return m


def _reference_sink_attention(q, k, v, sinks, mask, scale):
    """float64, straight from the definition: softmax over [scores of the allowed keys, sink], sink dropped."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    e = torch.exp(q @ k.transpose(-1, -2) * scale) * mask
    z = e.sum(-1, keepdim=True) + torch.exp(sinks)[None, :, None, None]
    return (e / z) @ v


def _plain_attention_with_lse(q, k, v, mask, scale):
    """Differentiable (o, lse) without sinks, the quantities a fused kernel returns."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*inputs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99)).to(out.dtype)
    return out.detach(), torch.autograd.grad(out, inputs, dout)


@pytest.mark.parametrize("window,packed", [(None, False), (6, False), (None, True), (6, True)])
def test_explicit_sink_attention_is_the_definition(window, packed):
    """sink_attention_explicit (transformers' eager formula: scores, mask, sink column, max shift, softmax) equals
    the float64 definition, forward and backward (q, k, v, sinks), grouped-query heads, window, documents."""
    q, k, v, sinks = _qkv(seed=1 + (window or 0) + packed)
    B, T = q.shape[0], q.shape[2]
    docs = torch.tensor([[0] * 10 + [1] * 19, [0] * 17 + [1] * 12]) if packed else None
    mask, scale = _mask(B, T, window, docs), 16**-0.5
    out, grads = _grads(lambda *t: attention.sink_attention_explicit(*t, mask, scale), q, k, v, sinks)
    ref, ref_grads = _grads(lambda *t: _reference_sink_attention(*t, mask, scale), q, k, v, sinks)
    assert rel(out, ref) <= TOL
    for name, g, r in zip("q k v sinks".split(), grads, ref_grads):
        assert rel(g, r) <= TOL, name


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_from_the_log_sum_exp_equal_the_explicit_formula(window):
    """The CUDA path's algebra: o · σ(lse − sink) from a sink-free attention and its log-sum-exp equals explicit sink
    attention in value and in every gradient (q, k, v, sinks), when the gradient flows through lse too; without
    that flow (lse treated as a constant, as a kernel that drops d lse would) q and k's gradients are wrong."""
    q, k, v, sinks = _qkv(seed=7)
    mask, scale = _mask(q.shape[0], q.shape[2], window), 16**-0.5

    def via_lse(q, k, v, s, keep_lse_grad=True):
        o, lse = _plain_attention_with_lse(q, k, v, mask, scale)
        return attention.apply_sinks(o, lse if keep_lse_grad else lse.detach(), s)

    out, grads = _grads(via_lse, q, k, v, sinks)
    ref, ref_grads = _grads(lambda *t: attention.sink_attention_explicit(*t, mask, scale), q, k, v, sinks)
    assert rel(out, ref) <= TOL
    for name, g, r in zip("q k v sinks".split(), grads, ref_grads):
        assert rel(g, r) <= TOL, name
    _, cut = _grads(lambda *t: via_lse(*t, keep_lse_grad=False), q, k, v, sinks)
    assert rel(cut[0], ref_grads[0]) > 100 * TOL and rel(cut[1], ref_grads[1]) > 100 * TOL


def test_flex_attention_lse_path_forward_on_cpu(monkeypatch):
    """sink_attention's kernel path with a FlexAttention block mask (window and documents, grouped-query heads)
    equals the explicit formula. FlexAttention runs its forward on CPU (eager; its backward is CUDA-only: the
    gradient through its log-sum-exp is checked in tests/gpu/test_gpt_oss_cuda.py)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(attention, "flex_attention", lambda: flex_attention)
    q, k, v, sinks = _qkv(T=40, seed=11)
    B, T, W = q.shape[0], q.shape[2], 9
    doc = torch.tensor([[0] * 15 + [1] * 25, [0] * 31 + [1] * 9])

    def allowed(b, h, qi, kv):
        return (doc[b, qi] == doc[b, kv]) & (qi >= kv) & (kv > qi - W)

    block = create_block_mask(allowed, B, None, T, T, device="cpu")
    ctx = AttnContext(cos=None, sin=None, mask=None, block_mask=block, window=W)
    with torch.no_grad():
        out = attention.sink_attention(q, k, v, sinks, ctx, 16**-0.5)
        ref = attention.sink_attention_explicit(q, k, v, sinks, _mask(B, T, W, doc), 16**-0.5)
    assert rel(out, ref) <= TOL
    with torch.no_grad():
        plain = attention.causal_attention(q, k, v, ctx, 16**-0.5)
    assert rel(plain, ref) > 100 * TOL  # the sinks change the output


# ---- 2. each gpt_oss piece matters; router loss and padding; packed rows; bf16 ------------------------------------
def test_the_gpt_oss_specifics_have_teeth(tmp_path):
    """Each gpt_oss-specific piece changes transformers' loss by far more than the tolerance, so the family-wide
    equality tests (conftest.FAMILIES) cover them: the sinks, the SwiGLU clamp, the window, yarn scaling, biases."""
    make_model_dir(tmp_path, "gpt_oss", seed=7)
    batches = random_batches(1, 2, 97, [13], seed=8)
    ref = load_reference(tmp_path)
    base = reference_step(ref, reference_optimizer(ref), batches)[0]
    rope = dict(ref.config.rope_parameters, rope_type="default")
    for change in ({"swiglu_limit": 100.0}, {"sliding_window": 64}, {"rope_parameters": rope}, {"sinks": -30.0},
                   {"bias": 0.0}):
        kw = {k: v for k, v in change.items() if k not in ("sinks", "bias")}
        other = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32, **kw)
        with torch.no_grad():
            for name, p in other.named_parameters():
                if "sinks" in change and name.endswith("sinks"):
                    p.fill_(change["sinks"])  # exp(-30): no sink
                if "bias" in change and name.endswith("router.bias"):
                    p.zero_()
        loss = reference_step(other, reference_optimizer(other), batches)[0]
        assert abs(loss - base) > 1e-4 * abs(base), change


def test_router_loss_and_padding_mask_have_teeth(tmp_path):
    """Two padded micro-batches: megatrain equals the reference on the router's gradients; without the router
    loss, or counting padding tokens in the router statistics, they are off by far more than the tolerance."""
    make_model_dir(tmp_path, "gpt_oss", seed=1)
    batches = random_batches(2, 3, 97, [13, 9], seed=2)
    assert any((b["attention_mask"] == 0).any() for b in batches)
    ref = load_reference(tmp_path)
    ref_loss, ref_grads = reference_step(ref, reference_optimizer(ref), batches)
    router = [n for n in ref_grads if n.endswith("mlp.router.weight")]
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


def test_packed_row_equals_its_documents(tmp_path):
    """A packed row (documents across a sliding-window layer's reach) trains as its documents one by one (router
    loss off: it averages over a micro-batch's tokens, so it couples documents by design)."""
    from test_data_packing import _engine, _run

    make_model_dir(tmp_path, "gpt_oss", seed=9)
    engine, sink = _engine(tmp_path)
    engine.adapter.router_aux_coef = 0.0
    g = torch.Generator().manual_seed(10)
    lengths = [11, 3, 13]
    ids = torch.randint(3, 97, (1, sum(lengths)), generator=g)
    labels = ids.clone()
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels[0, pos[0] == 0] = -100
    packed_loss, packed_grads, packed_n = _run(engine, sink, ids, labels, pos)
    loss_sum, grads_sum, n_sum, s = 0.0, None, 0, 0
    for n in lengths:
        loss, grads, k = _run(engine, sink, ids[:, s:s + n], labels[:, s:s + n], pos[:, s:s + n])
        loss_sum, n_sum, s = loss_sum + loss, n_sum + k, s + n
        grads_sum = grads if grads_sum is None else {u: grads_sum[u] + v for u, v in grads.items()}
    assert packed_n == n_sum
    assert packed_loss == pytest.approx(loss_sum, rel=1e-5)
    for u, v in packed_grads.items():
        torch.testing.assert_close(v, grads_sum[u], rtol=1e-4, atol=1e-5)


def test_grouped_experts_equal_the_loop_on_cpu():
    """The CUDA bf16 path's logic (tokens sorted by expert, grouped GEMMs on transformers' [E, H, 2I] layout, biases
    gathered per row, routing weights, the clamp) run on CPU in fp32 (torch._grouped_mm has a CPU kernel): equal to
    the loop, forward and every gradient; the clamp acts on a share of the pre-activations."""
    from megatrain.models.gpt_oss import _grouped_clamped_ffn, _looped_clamped_ffn

    g = torch.Generator().manual_seed(0)
    N, H, I, E, k = 96, 32, 32, 8, 2
    x = torch.randn(N, H, generator=g)
    top_v, top_i = torch.topk(torch.randn(N, E, generator=g), k, dim=-1)
    weights = [torch.softmax(top_v, -1), torch.randn(E, H, 2 * I, generator=g) * 4 * H**-0.5,
               torch.randn(E, 2 * I, generator=g), torch.randn(E, I, H, generator=g) * I**-0.5,
               torch.randn(E, H, generator=g)]
    assert ((x @ weights[1][0] + weights[2][0]).abs() > 7).float().mean() > 0.01
    out = {}
    for name, fn in (("grouped", _grouped_clamped_ffn), ("looped", _looped_clamped_ffn)):
        ts = [t.clone().requires_grad_(True) for t in (x, *weights)]
        y = fn(ts[0], top_i, *ts[1:], 1.702, 7.0)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1)))
        out[name] = [y.detach()] + [t.grad for t in ts]
    for label, a, b in zip(("y", "dx", "dweights", "dgate_up", "dgate_up_bias", "ddown", "ddown_bias"),
                           out["grouped"], out["looped"]):
        assert rel(a, b) <= 1e-6, label


def test_bf16_tracks_the_fp32_reference(tmp_path):
    """bf16 weights and compute (fp32 master and Adam): the logits of transformers' bf16 model within bf16 rounding
    (transformers keeps the norms' weights in fp32, megatrain streams them in bf16: not bit for bit), and 6 steps'
    losses within 2% of transformers + AdamW in fp32."""
    from megatrain.runtime.engine import CollectGrads, Engine
    from megatrain.runtime.store import HostStore

    make_model_dir(tmp_path, "gpt_oss", seed=3)
    ids = torch.randint(3, 97, (3, 11), generator=torch.Generator().manual_seed(0))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.bfloat16)
    with torch.no_grad():
        want = hf(input_ids=ids).logits[:, -1].float()
    ad = get_adapter(AutoConfig.from_pretrained(tmp_path))
    store = HostStore(ad, torch.bfloat16, torch.bfloat16)
    store.load_safetensors(tmp_path)
    got = Engine(store, ad, torch.device("cpu"), CollectGrads()).next_token_logits(ids, torch.tensor([11] * 3))
    assert rel(got.float(), want) < 2e-2

    ref, mt = load_reference(tmp_path), Megatrain(tmp_path, dtype=torch.bfloat16)
    opt = reference_optimizer(ref)
    for step in range(6):
        batches = random_batches(2, 2, 97, [13, 9], seed=40 + step)
        ref_loss = reference_step(ref, opt, batches)[0]
        loss = mt.step(batches)[0]
        assert abs(loss - ref_loss) <= 0.02 * abs(ref_loss), step
    mt.close()


# ---- 3. MXFP4 ------------------------------------------------------------------------------------------------------
FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # e2m1 magnitudes; bit 3 of a nibble is the sign


def _decode_mxfp4(blocks, scales):
    """The documented format, element by element (float64): each byte holds two 4-bit e2m1 values, the low nibble
    first; each group of 32 values along the last dimension shares a scale 2^(scale − 127); the result is
    transposed to transformers' parameter layout [E, columns, rows]."""
    E, rows, G, _ = blocks.shape
    out = torch.empty(E, rows, G * 32, dtype=torch.float64)
    for e in range(E):
        for r in range(rows):
            for gi in range(G):
                s = 2.0 ** (int(scales[e, r, gi]) - 127)
                for j in range(16):
                    byte = int(blocks[e, r, gi, j])
                    for half, nib in enumerate((byte & 0xF, byte >> 4)):
                        val = FP4[nib & 7] * (-1.0 if nib & 8 else 1.0)
                        out[e, r, gi * 32 + 2 * j + half] = val * s
    return out.transpose(1, 2)


def test_mxfp4_dequantization_is_the_documented_format_and_transformers():
    """dequantize_mxfp4 on a small tensor (every nibble, a range of scales) equals the format decoded by hand, and
    transformers' convert_moe_packed_tensors, in fp32 and in bf16 (the values are exact in both)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble value, both halves
    scales = torch.randint(110, 140, (2, 3, 2), generator=g, dtype=torch.uint8)
    want = _decode_mxfp4(blocks, scales)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (2, 64, 3) and got.dtype == torch.float32
    assert torch.equal(got.double(), want)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales,
                                                                                                 dtype=dtype))


def mxfp4_model_dir(path, seed: int) -> dict[str, torch.Tensor]:
    """conftest's tiny gpt_oss with its expert matrices stored as MXFP4 (random blocks and scales), and config.json's
    quantization_config as the published checkpoints have it. Returns the blocks and scales written."""
    make_model_dir(path, "gpt_oss", seed=seed)
    sd = load_file(Path(path) / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    packed = {}
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        E, cols, rows = sd.pop(name).shape
        packed[name + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        packed[name + "_scales"] = torch.randint(120, 125, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    save_file({**sd, **packed}, Path(path) / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (Path(path) / "config.json").write_text(json.dumps(cfg))
    return packed


def test_mxfp4_checkpoint_loads_to_transformers_values(tmp_path):
    """A tiny checkpoint with MXFP4 experts loads, dequantized layer by layer, to exactly the values transformers
    loads it to (Mxfp4Config(dequantize=True)), every tensor; its blocks decode as the format says."""
    from transformers import Mxfp4Config

    from megatrain.runtime.store import HostStore

    packed = mxfp4_model_dir(tmp_path, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True))
    want = {n: p.detach() for n, p in hf.named_parameters()}
    ad = get_adapter(load_hf_config(tmp_path))
    store = HostStore(ad, torch.float32)
    store.load_safetensors(tmp_path)
    got = {s.hf_name: v for t in store.tiles for s, v in zip(t.unit.specs, t.views(t.master).values())}
    assert set(got) == set(want)
    for n in got:
        assert torch.equal(got[n], want[n]), n
    name = "model.layers.2.mlp.experts.down_proj"
    decoded = _decode_mxfp4(packed[name + "_blocks"][:1], packed[name + "_scales"][:1])
    assert torch.equal(got[name][:1].double(), decoded)


def test_mxfp4_checkpoint_with_wrong_shapes_is_refused(tmp_path):
    mxfp4_model_dir(tmp_path, seed=4)
    sd = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj_scales"
    sd[name] = sd[name][:, :, :1].contiguous()
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    from megatrain.runtime.store import HostStore

    store = HostStore(get_adapter(load_hf_config(tmp_path)), torch.float32)
    with pytest.raises(MegatrainError, match="gate_up_proj_blocks, .*gate_up_proj_scales: shapes"):
        store.load_safetensors(tmp_path)


def test_training_from_mxfp4_exports_full_precision_that_transformers_loads(tmp_path):
    """`megatrain train` from an MXFP4 checkpoint (2 steps), export fp32: transformers loads the export (plain
    expert tensors in its layout, no quantization_config) with megatrain's logits; metrics carry the router loss
    and expert load."""
    from test_checkpoint_helpers import make_data, make_model_with_tokenizer, records, run, write_config
    from test_export import megatrain_logits, sample_inputs

    model = make_model_with_tokenizer(tmp_path / "model", "gpt_oss", False)
    mxfp4_model_dir(model, seed=0)  # same tiny model (seed 0), experts replaced by MXFP4 ones
    cfg = write_config(tmp_path / "cfg.yaml", model, make_data(tmp_path / "train.jsonl"), tmp_path / "run",
                       tmp_path / "cache", train={"steps": 2}, export={"at_end": True, "dtype": "fp32"})
    run(cfg)
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert recs and all(0 < r["router_loss"] < r["loss"] and "expert_entropy" in r for r in recs)
    out = tmp_path / "run" / "export"
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "gpt_oss"
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)
    model_out = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    assert tuple(model_out.model.layers[0].mlp.experts.gate_up_proj.shape) == (8, 64, 128)
    ids, lengths = sample_inputs()
    with torch.no_grad():
        hf = model_out(input_ids=ids).logits[torch.arange(3), lengths - 1]
    mine = megatrain_logits(tmp_path / "run" / "checkpoints" / "step-2", ids, lengths)
    torch.testing.assert_close(hf, mine, rtol=1e-5, atol=1e-5)


# ---- 4. refusals, real configs, the planner ----------------------------------------------------------------------
@pytest.mark.parametrize("change,match", [
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}},
     "quantization_config.quant_method 'bitsandbytes'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
    ({"sliding_window": None}, "sliding_window is not set"),
    ({"layer_types": ["chunked_attention"] * 3}, "layer_types"),
])
def test_unsupported_options_are_refused_by_key(change, match):
    cfg = tiny_hf_config("gpt_oss")
    for k, v in change.items():
        setattr(cfg, k, v)
    with pytest.raises(MegatrainError, match=match):
        get_adapter(cfg).layer_kinds


# (total, active without the embedding lookup) parameters as the model cards give them, in billions
SIZES = {"gpt-oss-120b": (116.8, 5.13), "gpt-oss-20b": (20.9, 3.61)}


@pytest.mark.parametrize("name", sorted(SIZES))
def test_real_configs_total_and_active_parameters(name):
    cfg = load_hf_config(CONFIGS / name)
    ad = get_adapter(cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    units = ad.units()
    assert {s.hf_name: s.shape for u in units for s in u.specs} == {n: tuple(p.shape)
                                                                     for n, p in model.named_parameters()}
    total = sum(u.numel for u in units)
    active = sum(ad.active_numel(u) for u in units) - units[0].numel
    want_total, want_active = SIZES[name]
    assert total / 1e9 == pytest.approx(want_total, rel=0.01)
    assert active / 1e9 == pytest.approx(want_active, rel=0.01)
    assert ad.layer_kinds[:2] == ["sliding", "full"] and ad.sliding_window == 128
    assert ad.rope_scaling == pytest.approx(0.1 * math.log(32) + 1)  # yarn's attention factor


def test_plan_for_full_gpt_oss_120b_from_config_json(tmp_path, capsys):
    """`megatrain plan` for the full gpt-oss-120b on the H200 profile, 256 x 4096 = 1,048,576 tokens per step, from
    config.json alone: it fits in 1800 GiB of host RAM. (1536 GiB does not, while clipping keeps every finished
    gradient until the norm is known: 12 B/param with the fp32 master streamed + 4 B/param of gradients = 1740 GiB.)
    Prints the predicted step time and 6·N_active TFLOP/s."""
    import shutil

    from test_plan import cli

    model = tmp_path / "gpt-oss-120b"
    model.mkdir()
    shutil.copy(CONFIGS / "gpt-oss-120b" / "config.json", model / "config.json")
    tiny = ROOT / "megatrain" / "defaults" / "tiny-llama"
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny / f, model / f)
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    cfg = {"model": {"path": str(model), "init": "random"},
           "data": {"path": str(tmp_path / "train.jsonl"), "max_seq_len": 4096},
           "train": {"micro_batch_size": 8, "grad_accum_steps": 32, "device": "cuda"},
           "memory": {"host_budget_gb": 1800}, "checkpoint": {"at_end": False},
           "plan": {"profile": str(ROOT / "bench" / "results" / "probe-h200" / "profile.json")},
           "output": {"dir": str(tmp_path / "out")}}
    import yaml

    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    r = cli("plan", str(tmp_path / "cfg.yaml"), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["fits"] and out["tokens_per_step"] == 1_048_576
    assert out["gpu_needed_gib"] <= 139.8 and out["host_peak_gib"] <= 1800
    assert out["tflops_6n_active"] < out["tflops_6n"] / 15  # 5.7B of 116.8B parameters multiply each token
    with capsys.disabled():
        print(f"\ngpt-oss-120b plan, H200 profile, 256x4096/step, 1800 GiB host: {out['step_time_s']:.1f} s/step, "
              f"{out['tflops_6n_active']:.0f} TFLOP/s by 6*N_active, GPU {out['gpu_needed_gib']:.1f} GiB, host "
              f"{out['host_peak_gib']:.0f} GiB ({out['host_bytes_per_param']:.2f} B/param), {out['placement']}")
