"""The reference model of dpo and ipo, two ways: log-probs precomputed by the streaming forward at step 0
(Engine.sequence_logps) and passed in, or the store's frozen copy streamed every step (weights="reference"), from the
policy at step 0 or from another model folder. Both equal, both equal transformers; the per-target scale of the LM
head leaves the scalar (SFT) path as it was; bad preference micro-batches are refused."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import make_model_dir, tiny_hf_config
from reference import Megatrain, pair_batches, rel, row_logps, step_and_grads
from test_equivalence import TOL, load_reference
from test_preference_engine import OBJECTIVES

from megatrain.models import get_adapter
from megatrain.runtime import HeadKernels, HostStore, Placement
from megatrain.runtime.lmhead import head_loss
from megatrain.runtime.objective import Objective


def test_row_sums_do_not_depend_on_the_order_of_the_targets():
    """A row's log-prob is the same bits whatever order its targets arrive in (index_add_ adds in arrival order, and
    on CUDA in whatever order its atomics land: the precomputed and the streamed reference then differed in the last
    bits), and within float32 rounding of the float64 sum."""
    from megatrain.runtime.head_objective import row_sums

    g = torch.Generator().manual_seed(7)
    B, T = 6, 257
    index = torch.randperm(B * T, generator=g)[: 3 * T]
    values = -torch.rand(len(index), generator=g, dtype=torch.float64) * 12
    want = torch.zeros(B, dtype=torch.float64).index_add_(0, index // T, values)
    got = row_sums(values.float(), index, B, T)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()
    for seed in range(5):
        p = torch.randperm(len(index), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(row_sums(values.float()[p], index[p], B, T), got)


@pytest.mark.parametrize("family,chunk,groups", [("llama", 0, 1), ("gemma2", 3, 1), ("qwen3_moe", 5, 2)])
def test_sequence_logps_equal_transformers(tmp_path, family, chunk, groups):
    """Per-row sums and counts over micro-batches of unequal lengths, the head in chunks that cross rows, the
    micro-batches in wave groups."""
    make_model_dir(tmp_path, family, tied=family == "llama", seed=31)
    ref = load_reference(tmp_path)
    mt = Megatrain(tmp_path, loss_chunk_tokens=chunk, placement=Placement(wave_groups=groups))
    batches = pair_batches(3, 2, 97, [9, 14, 6], seed=32)
    logp, n = mt.engine.sequence_logps(mt.microbatches(batches))
    with torch.no_grad():
        want = [row_logps(ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits, b["labels"])
                for b in batches]
    assert torch.equal(n, torch.cat([w[1] for w in want]))
    expect = torch.cat([w[0] for w in want])
    assert (logp - expect).abs().max().item() <= TOL * expect.abs().max().item()
    mt.close()


@pytest.mark.parametrize("name,dtype", [("dpo", torch.float32), ("ipo", torch.float32), ("dpo", torch.bfloat16)])
def test_precomputed_and_streamed_reference_are_equal(tmp_path, name, dtype):
    """Run A scores every pair of the run at step 0 first (the precompute pass), run B freezes its step-0 weights
    and streams them each step: the same reference log-probs bit for bit, the same losses and weights."""
    make_model_dir(tmp_path, "qwen2" if name == "ipo" else "llama", seed=33)
    steps = [pair_batches(2, 2, 97, [9, 12], seed=34 + s) for s in range(3)]
    a = Megatrain(tmp_path, dtype, objective=OBJECTIVES[name])
    pre = [[a.engine.sequence_logps(a.microbatches([b]))[0] for b in batches] for batches in steps]
    b = Megatrain(tmp_path, dtype, objective=OBJECTIVES[name])
    b.store.freeze_reference()
    for s, batches in enumerate(steps):
        streamed = [b.engine.sequence_logps(b.microbatches([mb]), weights="reference")[0] for mb in batches]
        assert all(torch.equal(x, y) for x, y in zip(pre[s], streamed)), f"reference log-probs at step {s}"
        assert a.step(batches, ref_logps=pre[s])[0] == b.step(batches, ref_logps=streamed)[0], f"loss at step {s}"
    pa, pb = a.params(), b.params()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # the policy moved, the reference did not
    now, _ = b.engine.sequence_logps(b.microbatches(steps[0]))
    assert not torch.equal(now, torch.cat(pre[0]))
    a.close()
    b.close()


def test_reference_from_another_model_folder(tmp_path):
    """load_reference fills the frozen copy from another folder (another seed: other weights): its log-probs are that
    model's under transformers, the policy's stay the policy's; the store counts the copy's bytes."""
    make_model_dir(tmp_path / "policy", "qwen2", seed=35)
    make_model_dir(tmp_path / "other", "qwen2", seed=36)
    mt = Megatrain(tmp_path / "policy", objective=OBJECTIVES["dpo"])
    before = mt.store.host_bytes()
    mt.store.load_reference(tmp_path / "other", progress=False)
    assert mt.store.host_bytes() - before == mt.store.total_elems * 4  # fp32 compute: 4 B/param (bf16: 2)
    batches = pair_batches(2, 2, 97, [8, 11], seed=37)
    for folder, weights in (("other", "reference"), ("policy", "policy")):
        ref = load_reference(tmp_path / folder)
        with torch.no_grad():
            want = torch.cat([row_logps(ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits,
                                        b["labels"])[0] for b in batches])
        got, _ = mt.engine.sequence_logps(mt.microbatches(batches), weights=weights)
        assert (got - want).abs().max().item() <= TOL * want.abs().max().item(), weights
    mt.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_init_reference_is_the_step_0_policy(dtype):
    """A resumed run of a randomly initialised model rebuilds its reference from the seed: the same copy as frozen at
    step 0."""
    adapter = get_adapter(tiny_hf_config("qwen3_moe"))
    a, b = HostStore(adapter, dtype), HostStore(adapter, dtype)
    a.init_random(7, 0.02)
    a.freeze_reference()
    b.init_reference_random(7, 0.02)
    assert torch.equal(a.reference, b.reference) and b.reference.abs().sum() > 0


@pytest.mark.parametrize("stream", ["bf16", "fp32"])
def test_bf16_reference_copy_counts_two_bytes_per_parameter(tmp_path, stream):
    """bf16 compute: the copy is bf16 (+2 B/param) whether the policy streams bf16 or its fp32 master (cast in the
    slots): its log-probs are the step-0 policy's bit for bit."""
    make_model_dir(tmp_path, "llama", seed=38)
    mt = Megatrain(tmp_path, torch.bfloat16, placement=Placement(stream_dtype=stream))
    before = mt.store.host_bytes()
    mt.store.freeze_reference()
    assert mt.store.reference.dtype == torch.bfloat16
    assert mt.store.host_bytes() - before == 2 * mt.store.total_elems
    assert torch.equal(mt.store.reference, mt.store.stream.to(torch.bfloat16))
    mbs = mt.microbatches(pair_batches(2, 2, 97, [9, 12], seed=46))
    assert torch.equal(mt.engine.sequence_logps(mbs)[0], mt.engine.sequence_logps(mbs, weights="reference")[0])
    mt.close()


def test_per_target_scale_equals_the_scalar_path():
    """head_loss with a constant per-target scale vector gives the scalar path's gradients bit for bit, and a vector
    of per-row weights gives the weighted sum's gradient."""
    torch.manual_seed(0)
    H, V, n = 16, 37, 11

    def norm(w, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    h, norm_w, lm_w = torch.randn(2, 9, H), torch.rand(H) + 0.5, torch.randn(V, H) * 0.3
    index, targets = torch.randperm(18)[:n], torch.randint(0, V, (n,))
    kernels = HeadKernels(False, False)

    def run(scale):
        ng, lg = torch.zeros(H), torch.zeros(V, H)
        loss, dh = head_loss(norm, h, index, targets, norm_w, lm_w, ng, lg, scale, 4, kernels, softcap=2.5)
        return loss, dh, ng, lg

    s_loss, *scalar = run(0.37)
    v_loss, *vector = run(torch.full((n,), 0.37))
    assert all(torch.equal(x, y) for x, y in zip(scalar, vector))
    assert torch.allclose(v_loss * 0.37, s_loss)
    w = torch.rand(n, dtype=torch.float64)
    _, dh, ng, lg = run(w.float())
    x, nw, lw = h.double().requires_grad_(), norm_w.double().requires_grad_(), lm_w.double().requires_grad_()
    z = norm(nw, x.reshape(-1, H)[index]) @ lw.t()
    z = 2.5 * torch.tanh(z / 2.5)
    (torch.nn.functional.cross_entropy(z, targets, reduction="none") * w).sum().backward()
    for got, want in ((dh, x.grad), (ng, nw.grad), (lg, lw.grad)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_bad_preference_microbatches_are_refused(tmp_path):
    make_model_dir(tmp_path, "llama", seed=39)
    mt = Megatrain(tmp_path, objective=OBJECTIVES["dpo"])
    batches = pair_batches(1, 2, 97, [9], seed=40)
    with pytest.raises(ValueError, match="needs ref_logps"):
        mt.engine.train_step(mt.microbatches(batches))
    odd = [{k: v[:3] for k, v in batches[0].items()}]
    with pytest.raises(ValueError, match="in pairs"):
        mt.engine.train_step(mt.microbatches(odd, [torch.zeros(3)]))
    with pytest.raises(ValueError, match="reference copy"):
        mt.engine.sequence_logps(mt.microbatches(batches), weights="reference")
    mt.close()
    for bad in (dict(name="kto"), dict(name="ipo", beta=0.0), dict(name="dpo", label_smoothing=0.5)):
        with pytest.raises(ValueError, match="objective"):
            Objective(**bad)


KERNEL_SCRIPT = r"""
import json, torch
from megatrain.runtime import ce_triton, lmhead
torch.manual_seed(0)
out = []
for dtype in (torch.float32, torch.bfloat16):
    for V in (1000, 2 * ce_triton.BLOCK + 7):
        n = 5
        base = (torch.randn(n, V + 3) * 4).to(dtype)
        logits = base[:, :V]  # rows strided by V + 3
        t = torch.randint(0, V, (n,))
        t[1] = -100
        scale = torch.rand(n) - 0.5
        keep = base.clone()
        losses = ce_triton.ce_token_losses(logits, t)
        untouched = bool(torch.equal(keep, base))
        lf = logits.float()
        want = torch.where(t >= 0, torch.logsumexp(lf, -1) - lf.gather(1, t.clamp_min(0)[:, None])[:, 0], 0.0)
        l_ref, g_ref = lmhead._ce_eager(logits.clone(), t, scale)
        l, g = ce_triton.ce_loss_and_grad_(logits, t, scale)
        gr = g_ref.float()
        out.append({"dtype": str(dtype), "untouched": untouched, "loss_diff": (losses - want).abs().max().item(),
                    "loss_ref": want.abs().max().item(), "sum": float(l), "sum_ref": float(l_ref),
                    "max_diff": (g.float() - gr).abs().max().item(), "max_ref": gr.abs().max().item(),
                    "masked_row_max": g[1].float().abs().max().item()})
print(json.dumps(out))
"""


def test_kernel_per_row_scale_and_forward_only():
    """The Triton cross-entropy's two new forms, by Triton's CPU interpreter: a scale per row (pass 2) equals the eager
    version; the forward-only form (pass 1) gives each row's token loss and leaves the logits untouched."""
    pytest.importorskip("triton", reason="triton (the test extra) runs the kernel in its CPU interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(rows) == 4
    for row in rows:
        assert row["untouched"], row
        assert row["loss_diff"] <= 1e-6 * row["loss_ref"], row
        assert abs(row["sum"] - row["sum_ref"]) <= 1e-6 * abs(row["sum_ref"]), row
        tol = 1e-6 if row["dtype"] == "torch.float32" else row["max_ref"] * 2**-7
        assert row["max_diff"] <= tol, row
        assert row["masked_row_max"] == 0.0, row


@pytest.mark.parametrize("name", ["orpo", "ipo"])
def test_ranks_shares_with_the_step_totals_add_up_to_the_step(tmp_path, name):
    """What a distributed step does (distributed/step.py): each rank runs its micro-batches with the whole step's
    totals (targets, micro-batches, pairs, chosen targets); the ranks' losses, gradients and metric sums add up to the
    one-process step's."""
    make_model_dir(tmp_path, "qwen3_moe" if name == "orpo" else "llama", seed=44)  # MoE: the router loss's share too
    batches = pair_batches(3, 2, 97, [9, 12, 7], seed=45)
    refs = [torch.randn(4) * 3 - 20 for _ in batches] if OBJECTIVES[name].needs_reference else None

    mbs = Megatrain.microbatches(batches, refs)

    def run(share, totals=None):
        return step_and_grads(tmp_path, OBJECTIVES[name], [mbs[m] for m in share], totals)

    whole, g = run([0, 1, 2])
    chosen = sum(int((b["labels"][0::2, 1:] != -100).sum()) for b in batches)
    totals = (sum(mb.num_targets for mb in mbs), 3, 6, chosen)
    (a, ga), (b, gb) = run([0, 2], totals), run([1], totals)
    assert abs(a.loss_sum.item() + b.loss_sum.item() - whole.loss_sum.item()) <= TOL * abs(whole.loss_sum.item())
    for i in g:
        assert rel(ga[i] + gb[i], g[i]) <= TOL, f"unit {i}"
    for k, v in whole.metrics.items():
        assert abs(a.metrics[k].item() + b.metrics[k].item() - v.item()) <= TOL * max(1.0, abs(v.item())), k


@pytest.mark.parametrize("name", ["dpo", "ipo", "simpo", "orpo"])
@pytest.mark.parametrize("chunk", [64, 23, 5])  # every pair in one chunk / chunks of whole pairs / the two passes
def test_one_pass_head_equals_autograd_of_the_pair_loss(name, chunk):
    """PreferenceStep.head over chunks of whole pairs (pair_chunks: given the host micro-batch) and over two passes
    (without it, or with a pair longer than the chunk): the step loss, its gradients (hidden states, final norm, LM
    head) and the metric sums equal float64 autograd of the pair loss over log-probs from the full logits."""
    from megatrain.runtime.head_objective import PreferenceStep, pair_chunks
    from megatrain.runtime.microbatch import MicroBatch
    from megatrain.runtime.objective import pair_loss

    g = torch.Generator().manual_seed(sum(map(ord, name)) * 100 + chunk)
    H, V, B, T = 16, 37, 6, 9
    obj = {"dpo": Objective("dpo", beta=0.5, label_smoothing=0.1), "ipo": Objective("ipo", beta=0.5),
           "simpo": Objective("simpo", beta=0.5, simpo_gamma=0.3), "orpo": Objective("orpo", orpo_lambda=0.2)}[name]

    def norm(w, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    for r in range(B):  # a prompt of 1..4 tokens without loss, then the completion
        labels[r, : 1 + int(torch.randint(0, 4, (), generator=g))] = -100
    ref = torch.randn(B, generator=g) * 5 - 20 if obj.needs_reference else None
    host = MicroBatch.from_labels(ids, labels, ref_logps=ref)
    h = torch.randn(B, T, H, generator=g)
    norm_w, lm_w = torch.rand(H, generator=g) + 0.5, torch.randn(V, H, generator=g) * 0.3
    kernels = HeadKernels(False, False)
    chosen = int((host.target_index // T % 2 == 0).sum())

    def run(given):
        step = PreferenceStep(obj, B // 2, chosen, torch.device("cpu"), [host] if given else None)
        ng, lg, loss = torch.zeros(H), torch.zeros(V, H), torch.zeros(())
        dh = step.head(norm, h, host, norm_w, lm_w, ng, lg, chunk, kernels, 2.5, loss)
        return loss, dh, ng, lg, step.metrics

    x, nw, lw = h.double().requires_grad_(), norm_w.double().requires_grad_(), lm_w.double().requires_grad_()
    z = norm(nw, x.reshape(-1, H)[host.target_index]) @ lw.t()
    tok = -torch.nn.functional.cross_entropy(2.5 * torch.tanh(z / 2.5), host.targets, reduction="none")
    rows = host.target_index // T
    logp = torch.zeros(B, dtype=torch.float64).index_add(0, rows, tok)
    n = torch.bincount(rows, minlength=B)
    want_loss, want_metrics = pair_loss(obj, logp, n, None if ref is None else ref.double())
    want_loss = want_loss / (B // 2)
    if name == "orpo":
        want_metrics["nll_loss"] = -logp[0::2].sum() / chosen * (B // 2)
        want_loss = want_loss - logp[0::2].sum() / chosen
    want_loss.backward()
    assert (pair_chunks(host, chunk) is None) == (chunk == 5)  # (a pair here holds 10 targets or more)
    for given in (True, False):
        loss, dh, ng, lg, metrics = run(given)
        assert abs(float(loss) - float(want_loss)) <= 1e-5 * max(1.0, abs(float(want_loss)))
        for got, want in ((dh, x.grad), (ng, nw.grad), (lg, lw.grad)):
            assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
        assert float(metrics["pairs"]) == B // 2
        for k, v in want_metrics.items():
            assert abs(float(metrics[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), k
