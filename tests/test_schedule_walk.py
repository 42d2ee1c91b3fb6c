"""One walk of the schedule (runtime/schedule.py): every model of the step (the engine's executor, the planner's
memory and time models) is a ScheduleVisitor with a method per kind of use, and `walk` is the one dispatch. A kind
added to the schedule without a method in some model fails here (and that model cannot be instantiated)."""

import ast
from pathlib import Path

import pytest

import megatrain.planner.memory as memory
import megatrain.planner.timing as timing
import megatrain.runtime.engine as engine
from megatrain.runtime.schedule import KINDS, TIED_INPUT, Placement, ScheduleVisitor, Use, step_schedule, walk

# every model of the step: a visitor defined anywhere in the package is checked below (see test_every_visitor_...)
MODELS = {engine._StepRun: "the engine's train_step", engine._ForwardWave: "the engine's forward wave (eval)",
          memory._GpuBooks: "the memory model (gpu_phases)", timing._StepTimes: "the time model (_walk)",
          timing._Flops: "the FLOPs count (executed_flops)"}

PLACEMENTS = [Placement(), Placement(checkpoint_every=2, spill_layers=3, grads_to_host=2),
              Placement(wave_groups=2, group_grads="host", reuse_attention=2, keep_top_layers=1, checkpoint_every=2)]


def visitors_in_the_package() -> set[tuple[str, str]]:
    """(module, class) of every class in megatrain/ whose bases name ScheduleVisitor, from the source."""
    root = Path(engine.__file__).resolve().parents[1]
    out = set()
    for path in root.rglob("*.py"):
        module = ".".join(["megatrain", *path.relative_to(root).with_suffix("").parts])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("ScheduleVisitor") for b in node.bases):
                out.add((module, node.name))
    return out


def test_kinds_are_the_schedules_kinds():
    """KINDS lists exactly the kinds the schedule makes, and each is an abstract method of the protocol."""
    made = {u.kind for p in PLACEMENTS for tied in (False, True) for u in step_schedule(7, tied, p)}
    assert made == set(KINDS)
    assert ScheduleVisitor.__abstractmethods__ == frozenset(KINDS)


def test_every_visitor_of_the_package_is_a_known_model():
    """A new visitor is added to MODELS, so that the checks below cover it."""
    assert visitors_in_the_package() == {(m.__module__, m.__qualname__) for m in MODELS}


@pytest.mark.parametrize("model", MODELS, ids=lambda c: c.__qualname__)
def test_each_model_has_a_method_per_kind(model):
    missing = [k for k in KINDS if getattr(model, k) is getattr(ScheduleVisitor, k)]
    assert not missing, f"{MODELS[model]} ({model.__qualname__}) has no method for {missing}"
    assert not model.__abstractmethods__
    assert all(callable(getattr(model, k)) for k in KINDS)


@pytest.mark.parametrize("kind", KINDS)
def test_a_model_lacking_a_kind_cannot_be_instantiated(kind):
    for model in MODELS:
        lacking = type("Lacking", (ScheduleVisitor,), {k: v for k, v in vars(model).items() if k != kind})
        with pytest.raises(TypeError, match=kind):
            lacking.__new__(lacking)


class Recorder(ScheduleVisitor):
    def __init__(self):
        self.calls = []

    def enter(self, use):
        self.calls.append(("enter", use))

    def leave(self, use):
        self.calls.append(("leave", use))


for _kind in KINDS:  # one recording method per kind, named after it
    setattr(Recorder, _kind, lambda self, use, k=_kind: self.calls.append((k, use)))
Recorder.__abstractmethods__ = frozenset()


@pytest.mark.parametrize("placement", PLACEMENTS, ids=str)
@pytest.mark.parametrize("tied", [False, True])
def test_walk_dispatches_every_use_to_its_kinds_method(placement, tied):
    uses = step_schedule(8, tied, placement)
    rec = Recorder()
    walk(uses, rec)
    assert rec.calls == [c for u in uses for c in (("enter", u), (u.kind, u), ("leave", u))]


def test_walk_fails_loudly_on_an_unknown_kind():
    uses = step_schedule(4, False) + [Use((1,), "sideways")]
    rec = Recorder()
    with pytest.raises(ValueError, match="sideways"):
        walk(uses, rec)
    assert rec.calls[-1] == ("leave", uses[-2])  # nothing of the unknown use ran


@pytest.mark.parametrize("tied", [False, True])
def test_uses_name_the_accumulators_they_continue_into(tied):
    """What the engine brings back ahead of a use when accumulators wait in host memory between groups, and the
    unit whose gradient `Use.grad` places."""
    for u in step_schedule(6, tied, Placement(wave_groups=2, group_grads="host")):
        expected = {"head": (u.units[0] if u.units else 0, 0), "backward": u.units,
                    "embed_backward": (TIED_INPUT,) if tied else ()}.get(u.kind, ())
        assert u.accumulators == expected
        assert u.grad_unit == (0 if u.kind == "embed_backward" else u.units[0])
