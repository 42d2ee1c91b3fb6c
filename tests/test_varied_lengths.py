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
def test_varied_lengths_compile_each_graph_at_most_twice(tmp_path, monkeypatch, placement):
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
