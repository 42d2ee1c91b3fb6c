"""Meta-device runs without importing torch._dynamo or sympy.

torch's Python meta kernels (elementwise type promotion, most shape functions) are wrapped by torch._disable_dynamo,
whose first call imports torch._dynamo only to mark the kernel as one dynamo must not trace. That import takes
seconds (tens on a host without bytecode caches: it pulls in FSDP, DTensor, Inductor's pieces and registers custom
ops), and `megatrain plan` never compiles: while torch._dynamo is not loaded, no dynamo can trace anything, and the
mark is moot. `without_dynamo` runs the planner's meta-device measurements (in a process with one Python thread, as
`megatrain plan`; with threads alive, the real module) with a stand-in for torch._dynamo whose `disable(fn)` returns
`fn` itself, then removes the stand-in and every mark torch cached with it, so that a later torch.compile sees
torch's own wrappers and imports the real module.

The stand-in answers nothing else: any other attribute of it, and any of torch._dynamo's submodules imported while it
is in place, trips it (`Tripped`), and `measure` then runs the measurement again with the real torch._dynamo. The
sizes are the same either way (what a meta kernel allocates does not depend on the mark); only the time differs.

The meta kernels also import sympy (a third of a second) to ask whether an operand is a sympy expression, and
torch.fx's symbolic shapes (which imports sympy) for guards on sizes. Neither is needed on concrete sizes: while
sympy is not loaded no sympy object exists, so a stand-in whose `Basic` nothing is an instance of answers the same;
the symbolic shapes' stand-in has the guard functions the kernels call, each as torch's own on plain ints and bools,
and trips on a symbolic value or any other name. A run that raises under the stand-ins is run again with the real
modules too. A module imported meanwhile that bound a stand-in (or one of its functions) to a name is given the
real one afterwards.
"""

from __future__ import annotations

import sys
import threading
import types
from contextlib import contextmanager

__all__ = ["Tripped", "measure", "without_dynamo"]


class Tripped(Exception):
    """Something under `without_dynamo` needed more than the stand-in gives."""


class _NoImports:
    """A meta-path finder that refuses the stood-in modules' submodules while the stand-ins are in place."""

    def __init__(self, state: dict, packages: tuple[str, ...]):
        self.state, self.prefixes = state, tuple(p + "." for p in packages)

    def find_spec(self, name, path=None, target=None):
        if not name.startswith(self.prefixes):
            return None
        self.state["tripped"] = f"import {name}"
        raise Tripped(f"import {name}")


SHAPES, FUNCTIONS = "torch.fx.experimental.symbolic_shapes", "torch.utils._sympy.functions"


def _shapes_stand_in(torch, trip) -> types.ModuleType:
    """torch.fx.experimental.symbolic_shapes as the meta kernels use it on concrete sizes: each function as torch's
    own does for plain ints and bools (their errors included), tripping on a symbolic value (none exists without
    the real module: SymInts come from its ShapeEnv) and on any other name."""
    import functools
    import operator

    from torch.utils._ordered_set import OrderedSet

    sym = (torch.SymInt, torch.SymFloat, torch.SymBool)

    def concrete(*values):
        if any(isinstance(v, sym) for v in values):
            trip(f"{SHAPES} of a symbolic value")

    def boolean(a, skip=0):  # expect_true, guard_or_false/true, guard_size_oblivious, statically_known_true
        concrete(a)
        if not isinstance(a, bool):
            raise AssertionError(f"Expected bool, got {a}")
        return a

    def sym_eq(x, y):
        if isinstance(x, (tuple, list)) and isinstance(y, (list, tuple)):
            return len(x) == len(y) and functools.reduce(operator.and_, map(sym_eq, x, y), True)
        if isinstance(x, int) and isinstance(y, int):
            return x == y
        concrete(x, y)
        raise AssertionError(f"unexpected sym_eq between {type(x)} {type(y)}")

    def joined(op):
        def f(x, *others):
            concrete(x, *others)
            return functools.reduce(op, others, x)
        return f

    def is_nested_int(s):
        concrete(s)
        return False

    def guarding_hint_or_throw(a):
        if isinstance(a, int):  # (bool too)
            return a
        trip(f"{SHAPES}.guarding_hint_or_throw of {type(a).__name__}")

    def has_guarding_hint(a):  # (and has_hint, its older name)
        concrete(a)
        return True

    def size_hint(a, fallback=None):  # (torch releases before guarding_hint_or_throw)
        concrete(a)
        if type(a) is not int:
            raise AssertionError(f"Expected int, got {type(a)}")
        return a

    def free_unbacked_symbols(x):
        if isinstance(x, torch.Tensor) and x.layout == torch.strided and not x.is_nested and \
                all(type(v) is int for v in (*x.shape, *x.stride(), x.storage_offset())):
            return OrderedSet()
        trip(f"{SHAPES}.free_unbacked_symbols of {type(x).__name__}")

    stub = types.ModuleType(SHAPES, "the planner's stand-in (planner/meta_trace.py)")
    for name in ("expect_true", "guard_or_false", "guard_or_true", "guard_size_oblivious", "statically_known_true"):
        setattr(stub, name, boolean)
    stub.sym_eq, stub.sym_and, stub.sym_or = sym_eq, joined(operator.and_), joined(operator.or_)
    stub.is_nested_int, stub.guarding_hint_or_throw, stub.has_guarding_hint = \
        is_nested_int, guarding_hint_or_throw, has_guarding_hint
    stub.has_hint, stub.size_hint = has_guarding_hint, size_hint
    stub.free_unbacked_symbols = free_unbacked_symbols
    stub.__getattr__ = _other(f"{SHAPES}.", trip)
    return stub


def _other(prefix: str, trip):
    """A stand-in's module __getattr__: trips on any name it lacks, but a dunder (a probe such as `__file__`, answered
    as a module without it answers)."""
    def other(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        trip(prefix + name)
    return other


@contextmanager
def without_dynamo():
    """Yields a dict whose "tripped" key says what needed a real module (the run under it is then void: so is one
    that raised under the stand-ins); with torch._dynamo already loaded, or another Python thread alive (the
    stand-ins are process-wide: a thread compiling or running torch meanwhile must see the real modules), an empty
    dict and nothing replaced. sympy and torch's symbolic shapes are stood in for only when not loaded yet."""
    state: dict = {}
    if "torch._dynamo" in sys.modules or threading.active_count() > 1:
        yield state
        return
    import torch

    marked = []

    def trip(what: str):
        state["tripped"] = what
        raise Tripped(what)

    def disable(fn=None, recursive=True, **kwargs):
        if fn is None or kwargs.keys() - {"wrapping", "reason"}:
            trip("torch._dynamo.disable as a decorator factory")
        marked.append(fn)
        return fn

    stub = types.ModuleType("torch._dynamo", "the planner's stand-in (planner/meta_trace.py)")
    stub.disable = disable
    stub.__getattr__ = _other("torch._dynamo.", trip)
    stub.__path__ = []  # a package: its submodules reach the finder, which refuses them
    stubs = {"torch._dynamo": stub}
    if "sympy" not in sys.modules:  # no sympy object can exist yet: isinstance(x, sympy.Basic) is False for all
        sympy = stubs["sympy"] = types.ModuleType("sympy", "the planner's stand-in (planner/meta_trace.py)")
        sympy.Basic = type("Basic", (), {})
        sympy.__getattr__ = _other("sympy.", trip)
        sympy.__path__ = []
    if SHAPES not in sys.modules:
        stubs[SHAPES] = _shapes_stand_in(torch, trip)
    if FUNCTIONS not in sys.modules:  # (torch's size checks import its Max, which concrete sizes never call)
        functions = stubs[FUNCTIONS] = types.ModuleType(FUNCTIONS, "the planner's stand-in (planner/meta_trace.py)")
        functions.Max = lambda *args, **kwargs: trip(f"{FUNCTIONS}.Max")
        functions.__getattr__ = _other(f"{FUNCTIONS}.", trip)
    finder = _NoImports(state, tuple(k for k in stubs if k not in (SHAPES, FUNCTIONS)))
    before = set(sys.modules)
    sys.modules.update(stubs)
    sys.meta_path.insert(0, finder)
    try:
        yield state
    except Exception as e:  # (Tripped included: caught by the run it tripped, or not)
        state.setdefault("tripped", f"{type(e).__name__} under the stand-ins")
        raise
    finally:
        sys.meta_path.remove(finder)
        for name, module in stubs.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
        if torch.__dict__.get("_dynamo") is stub:
            del torch._dynamo
        for fn in marked:  # torch caches the "disabled" kernel on the function: forget the stand-in's
            if getattr(fn, "__dict__", {}).get("__dynamo_disable") is fn:
                del fn.__dynamo_disable
        _hand_back(stubs, set(sys.modules) - before)


def _hand_back(stubs: dict, imported: set) -> None:
    """A module imported under the stand-ins that holds one (or one of their functions): given the real one."""
    held = {id(m): (name, None) for name, m in stubs.items()}
    held.update({id(v): (name, k) for name, m in stubs.items() for k, v in vars(m).items() if callable(v)})
    leaked = [(m, k, held[id(v)]) for name in imported for m in [sys.modules.get(name)]
              for k, v in list(getattr(m, "__dict__", {}).items()) if id(v) in held and not k.startswith("__")]
    if leaked:
        import importlib

        for m, k, (name, attr) in leaked:
            real = importlib.import_module(name)
            setattr(m, k, real if attr is None else getattr(real, attr))


def measure(fn, *args, **kwargs):
    """fn(*args, **kwargs) under `without_dynamo`; again with the real modules when the stand-ins were not enough
    (or the run failed under them)."""
    state: dict = {}
    try:
        with without_dynamo() as state:
            out = fn(*args, **kwargs)
    except Exception:
        if not state.get("tripped"):
            raise
    if state.get("tripped"):
        return fn(*args, **kwargs)
    return out
