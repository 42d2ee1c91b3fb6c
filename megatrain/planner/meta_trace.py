"""Meta-device runs without importing torch._dynamo.

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
Modules the meta kernels import on first use (sympy, torch.fx's symbolic shapes) load as usual; one that bound the
stand-in to a name is given the real module afterwards.
"""

from __future__ import annotations

import sys
import threading
import types
from contextlib import contextmanager

__all__ = ["Tripped", "measure", "without_dynamo"]


class Tripped(Exception):
    """Something under `without_dynamo` needed more than the stand-in gives."""


class _NoDynamoImports:
    """A meta-path finder that refuses torch._dynamo's submodules while the stand-in is in place."""

    def __init__(self, state: dict):
        self.state = state

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("torch._dynamo."):
            return None
        self.state["tripped"] = f"import {name}"
        raise Tripped(f"import {name}")


@contextmanager
def without_dynamo():
    """Yields a dict whose "tripped" key says what needed the real torch._dynamo (the run under it is then void);
    with torch._dynamo already loaded, or another Python thread alive (the stand-in is process-wide: a thread
    compiling or running torch meanwhile must see the real module), an empty dict and nothing replaced."""
    state: dict = {}
    if "torch._dynamo" in sys.modules or threading.active_count() > 1:
        yield state
        return
    import torch

    marked = []

    def disable(fn=None, recursive=True, **kwargs):
        if fn is None or kwargs.keys() - {"wrapping", "reason"}:
            state["tripped"] = "torch._dynamo.disable as a decorator factory"
            raise Tripped(state["tripped"])
        marked.append(fn)
        return fn

    def other(name):
        state["tripped"] = f"torch._dynamo.{name}"
        raise Tripped(state["tripped"])

    stub = types.ModuleType("torch._dynamo", "the planner's stand-in (planner/meta_trace.py)")
    stub.disable = disable
    stub.__getattr__ = other
    stub.__path__ = []  # a package: its submodules reach the finder, which refuses them
    finder = _NoDynamoImports(state)
    before = set(sys.modules)
    sys.modules["torch._dynamo"] = stub
    sys.meta_path.insert(0, finder)
    try:
        yield state
    finally:
        sys.meta_path.remove(finder)
        if sys.modules.get("torch._dynamo") is stub:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stub:
            del torch._dynamo
        for fn in marked:  # torch caches the "disabled" kernel on the function: forget the stand-in's
            if getattr(fn, "__dict__", {}).get("__dynamo_disable") is fn:
                del fn.__dynamo_disable
        leaked = [(m, k) for name in set(sys.modules) - before for m in [sys.modules[name]]
                  for k, v in list(getattr(m, "__dict__", {}).items()) if v is stub]
        if leaked:  # a module imported meanwhile holds the stand-in: hand it the real one
            import importlib

            real = importlib.import_module("torch._dynamo")
            for m, k in leaked:
                setattr(m, k, real)


def measure(fn, *args, **kwargs):
    """fn(*args, **kwargs) under `without_dynamo`; again with the real torch._dynamo when the stand-in was not
    enough (or the run failed under it)."""
    with without_dynamo() as state:
        try:
            out = fn(*args, **kwargs)
        except Exception:
            if not state:
                raise
            out = None
    if state.get("tripped"):
        return fn(*args, **kwargs)
    return out
