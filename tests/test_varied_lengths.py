"""Rows of varied lengths with engine.compile on: unpacked rows are padded per micro-batch to its longest row, so
nearly every micro-batch has a length of its own. The compiled layer template must not compile again for each
(past torch's recompile limit, 8, Dynamo would silently run the layer uncompiled): its graphs are compiled static for
the first micro-batch shape a template runs, exactly as for rows of one length, and once more with the token
dimension dynamic for every other shape (runtime/layer.py, ShapeCompiled).

The compiles are counted with a backend that records each graph (and whether its sizes are symbolic) in place of
Inductor: the graph capture is Dynamo's, the same as with Inductor. One test runs Inductor itself over varied
lengths and compares the step with the eager one."""

import pytest
import torch

from conftest import make_model_dir
from megatrain.runtime import Placement
from reference import Megatrain, random_batches, rel

LENGTHS = [64, 23, 31, 40, 47, 58, 71, 83, 90, 101]  # ten micro-batch lengths, as unpacked SFT rows give; the
# first micro-batch's is the one-length run's
# The ways a template's function is called, each a graph of its own: the forward wave (no autograd), the backward's
# recompute of q, k, v without autograd over the weights that require it, and the backward with autograd.
MODES = 3


class Compiles:
    """torch.compile with a recording backend: `graphs` lists (function name, dynamic) per graph compiled."""

    def __init__(self, monkeypatch):
        self.graphs: list[tuple[str, bool]] = []
        real = torch.compile

        def compile(fn, **kwargs):
            name = getattr(fn, "__name__", repr(fn))

            def backend(gm, inputs):
                dynamic = any(isinstance(s, torch.SymInt) for x in inputs if isinstance(x, torch.Tensor)
                              for s in x.shape) or any(isinstance(x, torch.SymInt) for x in inputs)
                self.graphs.append((name, dynamic))
                return gm.forward

            return real(fn, backend=backend, **kwargs)

        monkeypatch.setattr(torch, "compile", compile)

    def count(self, dynamic: bool) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, d in self.graphs:
            if d == dynamic:
                out[name] = out.get(name, 0) + 1
        return out


def run(tmp_path, monkeypatch, placement: Placement, lengths: list[int], steps: int = 2):
    """(graphs compiled, [(loss, grads)] per step) of a compiled engine over micro-batches of `lengths`; Dynamo set
    to raise where it would fall back to eager (its recompile limit hit)."""
    torch._dynamo.reset()
    compiles = Compiles(monkeypatch)
    mt = Megatrain(tmp_path, compile_layers=True, placement=placement)
    out = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step in range(steps):
            out.append(mt.step(random_batches(len(lengths), 2, 97, lengths, seed=500 + step)))
    mt.close()
    monkeypatch.undo()
    torch._dynamo.reset()
    return compiles, out


PLACEMENTS = [
    pytest.param(Placement(), id="whole"),
    pytest.param(Placement(seq_tile=32, checkpoint_every=2, reuse_attention=1), id="tiled-stash"),
    pytest.param(Placement(seq_tile=48, attn_block=32), id="blocked"),
]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_varied_lengths_compile_the_first_shape_static_and_every_other_once(tmp_path, monkeypatch, placement):
    """Ten lengths compile each function's graphs for the first micro-batch's shape, static, as rows of that one
    length do, and at most once more per way it is called (MODES) with dynamic sizes, however many lengths follow;
    nothing runs uncompiled. Rows of one length compile static graphs only."""
    make_model_dir(tmp_path, "qwen3", seed=43)
    fixed, _ = run(tmp_path, monkeypatch, placement, LENGTHS[:1])
    assert fixed.graphs and fixed.count(dynamic=True) == {}, fixed.graphs
    varied, _ = run(tmp_path, monkeypatch, placement, LENGTHS)
    static, once = varied.count(dynamic=False), fixed.count(dynamic=False)
    assert static == once, (static, once)
    dynamic = varied.count(dynamic=True)
    assert dynamic and max(dynamic.values()) <= MODES, varied.graphs


def test_varied_lengths_step_equals_eager(tmp_path):
    """Inductor's static and dynamic graphs over varied lengths compute the step the eager layers compute (the
    tolerances of tests/test_compile.py)."""
    make_model_dir(tmp_path, "qwen3", seed=44)
    torch._dynamo.reset()
    eager, compiled = Megatrain(tmp_path), Megatrain(tmp_path, compile_layers=True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for step in range(2):
            batches = random_batches(4, 2, 97, [37, 52, 45, 61], seed=600 + step)
            loss_e, grads_e = eager.step(batches)
            loss_c, grads_c = compiled.step(batches)
            assert abs(loss_c - loss_e) <= 1e-6 * loss_e
            for name in grads_e:
                assert rel(grads_c[name], grads_e[name]) <= 1e-5, name
    torch._dynamo.reset()


def test_a_dynamic_graph_that_fails_to_compile_falls_back_to_static_graphs(tmp_path, monkeypatch):
    """A compiler that cannot take symbolic sizes: the run warns once, runs the other lengths uncompiled and
    computes the eager layers' step."""
    make_model_dir(tmp_path, "qwen3", seed=45)
    torch._dynamo.reset()
    real, static_graphs = torch.compile, []

    def compile(fn, **kwargs):
        def backend(gm, inputs):
            if any(isinstance(x, torch.SymInt) for x in inputs) or any(
                    isinstance(s, torch.SymInt) for x in inputs if isinstance(x, torch.Tensor) for s in x.shape):
                raise NotImplementedError("no symbolic sizes here")
            static_graphs.append(getattr(fn, "__name__", ""))
            return gm.forward
        return real(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", compile)
    eager, compiled = Megatrain(tmp_path), Megatrain(tmp_path, compile_layers=True)
    lengths = [41, 29, 50]
    with pytest.warns(UserWarning, match="dynamic token dimension failed") as caught:
        batches = random_batches(3, 2, 97, lengths, seed=700)
        loss_e, grads_e = eager.step(batches)
        loss_c, grads_c = compiled.step(batches)
    assert sum("dynamic token dimension failed" in str(w.message) for w in caught) == 1
    assert abs(loss_c - loss_e) <= 1e-6 * loss_e
    for name in grads_e:
        assert rel(grads_c[name], grads_e[name]) <= 1e-5, name
    assert static_graphs and all(n == "layer_forward" for n in static_graphs)  # the first shape's, compiled
    eager.close()
    compiled.close()
    monkeypatch.undo()
    torch._dynamo.reset()


@pytest.mark.parametrize("resumed", [False, True])
def test_tune_first_compiles_the_graphs_the_run_then_uses(tmp_path, monkeypatch, resumed):
    """engine.tune_first's copy and the run compile the first training micro-batch's shape static (a fresh run
    evaluates step 0 first, a resumed one trains first), and the run over varied lengths compiles nothing after it
    (one recording backend for both: Dynamo's graphs are shared between the copy and the run)."""
    from megatrain.models import get_adapter, load_hf_config
    from megatrain.runtime import EngineOptions, MicroBatch
    from megatrain.runtime.layer import expect_first_shape
    from megatrain.run.tune_first import tune_first

    make_model_dir(tmp_path, "qwen3", seed=45)
    torch._dynamo.reset()
    graphs = []
    real = torch.compile

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=backend, **kw))
    step = Megatrain.microbatches(random_batches(3, 2, 97, [40, 57, 33], seed=700))
    evals = random_batches(2, 2, 97, [29, 61], seed=701)
    tune_first(get_adapter(load_hf_config(tmp_path)), torch.device("cpu"),
               EngineOptions(compile_layers=True, placement=Placement()), "fp32", step, evals, resumed)
    copied = len(graphs)
    mt = Megatrain(tmp_path, compile_layers=True)
    expect_first_shape(mt.engine.layer, *step[0].input_ids.shape)  # as the run does (run/prepare.py)

    def evaluate():
        for b in evals:
            mt.engine.eval_loss([MicroBatch.from_labels(b["input_ids"], b["labels"])])

    if not resumed:
        evaluate()
    mt.train_step(random_batches(3, 2, 97, [40, 57, 33], seed=700))
    if resumed:
        evaluate()
    mt.close()
    torch._dynamo.reset()
    assert copied > 0 and len(graphs) == copied, (copied, len(graphs))


def test_step_records_count_the_graphs_compiled(tmp_path):
    """metrics.jsonl's step records: the graphs Dynamo compiled since the last step record, and its recompile-limit
    hits (a function left uncompiled from then on)."""
    import json

    from megatrain.run.metrics import MetricsLogger

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x.sin() + 1, dynamic=False, backend="eager")
    fn(torch.randn(3))  # before the logger: not a step's
    log = MetricsLogger(tmp_path, 3, stream=open(tmp_path / "log.txt", "w"))
    record = {"loss": 1.0, "grad_norm": 1.0, "lr": 1e-5, "tokens_per_s": 1.0}
    with torch._dynamo.config.patch(recompile_limit=2):
        fn(torch.randn(3))
        log.log({"step": 1, **record})
        fn(torch.randn(4))
        fn(torch.randn(5))  # a third shape: past the limit of 2, run uncompiled
        fn(torch.randn(6))
        log.log({"step": 2, **record})
    log.close()
    torch._dynamo.reset()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["compiled_graphs"], r["compile_limit_hits"]) for r in rows] == [(0, 0), (1, 1)]


def test_a_compiled_layer_is_not_guarded_on_the_longest_document(monkeypatch):
    """Packed rows on CUDA run the variable-length kernel outside the compiled graph, given the micro-batch's
    segments and its longest one (AttnContext.max_seqlen); the compiled layer must not be specialised to that number,
    which changes from micro-batch to micro-batch (the kernel stood in for by SDPA here, on CPU)."""
    from torch._dynamo.utils import counters

    import megatrain.models.varlen_call as call
    from conftest import tiny_hf_config
    from megatrain.models import get_adapter
    from megatrain.models.base import AttnContext

    @torch.compiler.disable
    def kernel(q, k, v, ctx, scale):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    monkeypatch.setattr(call, "varlen_call", kernel)
    adapter = get_adapter(tiny_hf_config("qwen3", layers=1, vocab=97))
    unit = next(u for u in adapter.units() if u.kind == "layer")
    w = unit.views(torch.randn(unit.numel, generator=torch.Generator().manual_seed(46)) * 0.02)
    torch._dynamo.reset()
    layer = torch.compile(adapter.layer_forward, dynamic=False, backend="eager")
    B, T = 2, 64
    cos, sin = adapter.rope(torch.arange(T).repeat(B, 1), torch.float32)
    frames = []
    for longest in (10, 20, 30, 40):
        ctx = AttnContext(cos=cos, sin=sin, mask=None, cu_seqlens=torch.tensor([0, 64, 128], dtype=torch.int32),
                          max_seqlen=longest)
        with torch.no_grad():
            layer(w, torch.randn(B, T, adapter.hidden_size), ctx)
        frames.append(counters["frames"]["total"])
    torch._dynamo.reset()
    assert frames[1:] == frames[:1] * 3, frames


def test_the_training_shape_gets_the_static_graphs_after_an_evaluation_of_other_rows(tmp_path, monkeypatch):
    """A fresh run evaluates step 0 before its first step, often over rows of another length: the run names its
    first training micro-batch's shape before anything runs (expect_first_shape), so the evaluation takes the
    dynamic graphs and the training exactly the static graphs a run of its one shape compiles."""
    from megatrain.runtime import MicroBatch
    from megatrain.runtime.layer import expect_first_shape

    make_model_dir(tmp_path, "qwen3", seed=46)
    fixed, _ = run(tmp_path, monkeypatch, Placement(), [40], steps=1)
    torch._dynamo.reset()
    compiles = Compiles(monkeypatch)
    mt = Megatrain(tmp_path, compile_layers=True)
    expect_first_shape(mt.engine.layer, 2, 40)
    ev = random_batches(1, 2, 97, [29], seed=703)[0]
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        mt.engine.eval_loss([MicroBatch.from_labels(ev["input_ids"], ev["labels"])])
        assert compiles.graphs and compiles.count(dynamic=False) == {}, compiles.graphs
        evaluated = len(compiles.graphs)
        mt.step(random_batches(1, 2, 97, [40], seed=500))
    mt.close()
    monkeypatch.undo()
    torch._dynamo.reset()
    trained = compiles.graphs[evaluated:]
    assert trained and not any(dynamic for _, dynamic in trained), trained
    assert compiles.count(dynamic=False) == fixed.count(dynamic=False)


def test_expect_first_shape_leaves_a_template_that_ran_and_an_uncompiled_one():
    from megatrain.runtime.layer import Shapes, ShapeCompiled, expect_first_shape

    shapes = Shapes()
    shapes.note(torch.zeros(3, 7, 4))
    expect_first_shape(ShapeCompiled(lambda w, h, ctx: h, shapes, rows=True), 2, 40)
    assert shapes.first == (3, 7)
    expect_first_shape(lambda w, h, ctx: h, 2, 40)  # an uncompiled template: nothing to set
