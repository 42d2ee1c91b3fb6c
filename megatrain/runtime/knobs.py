"""The placement knobs, each declared once: every field of schedule.Placement is made by `knob`, which attaches a
`Knob` (its config key memory.<name>, default, least value or allowed words, what the planner does when the key is
unset, a one-line doc) to the field's metadata.

Derived from these declarations: the validation of a Placement (`allows`), the `memory:` schema's fields for the
knobs (config.py), the plan's placement line (`settings`), the copy of the model `engine.tune_first` compiles on
(planner/tune_copy.py: the knobs marked `graphs`) and docs/configuration.md (scripts/make_config_reference.py).
tests/test_config_reference.py fails when a Placement field has no Knob or the reference is stale.

A new knob is a Placement field made by `knob` (then rerun scripts/make_config_reference.py); what no declaration
can say is how the schedule, the engine, the memory and time models (planner/memory.py, timing.py) and the
planner's search (planner/placement.py) treat it.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from typing import Any


@dataclass(frozen=True)
class Knob:
    name: str  # the Placement field (filled in by `knobs`); the config key is memory.<name>
    default: int | str  # the default placement's value, where the planner starts from
    doc: str  # one line: what it does
    ge: int | None = None  # a count: the least value allowed
    choices: tuple[str, ...] = ()  # a word: the values allowed
    zero: str = ""  # a count: what 0 means
    unset: str = "chosen"  # what happens when the config leaves the key unset
    shown: str = ""  # in the plan's placement line: 'always'; another knob's name: when that one is above its
    #                  default; '': when not at its own default
    graphs: bool = False  # what the layers compile depends on it: engine.tune_first's copy runs the run's value
    code: str = ""  # where the runtime acts on it, beyond the schedule

    @property
    def key(self) -> str:
        return f"memory.{self.name}"

    def allows(self, value: Any) -> bool:
        return value in self.choices if self.choices else value >= self.ge

    @property
    def description(self) -> str:
        """The config key's description: the doc, then what 0 means and what unset means."""
        return f"{self.doc} ({f'0: {self.zero}; ' if self.zero else ''}default: {self.unset})"


def knob(default: int | str, doc: str, **kw) -> Any:
    """A dataclass field with its Knob (keywords: Knob's fields after `doc`)."""
    return field(default=default, metadata={"knob": Knob("", default, doc, **kw)})


@lru_cache(maxsize=None)
def knobs(cls: type) -> tuple[Knob, ...]:
    """The Knobs of a dataclass whose fields are made by `knob`, in field order; TypeError for a field without one."""
    missing = [f.name for f in fields(cls) if "knob" not in f.metadata]
    if missing:
        raise TypeError(f"{cls.__name__}: fields {missing} are not declared with runtime.knobs.knob (config key, "
                        f"bounds, doc)")
    return tuple(replace(f.metadata["knob"], name=f.name) for f in fields(cls))


def settings(obj: Any) -> str:
    """A placement as the config keys the plan shows (Knob.shown), e.g. 'memory.checkpoint_every=1 ...'."""
    ks = knobs(type(obj))
    default = {k.name: k.default for k in ks}

    def shown(k: Knob) -> bool:
        if k.shown == "always":
            return True
        if k.shown:
            return getattr(obj, k.shown) > default[k.shown]
        return getattr(obj, k.name) != k.default

    return " ".join(f"{k.key}={getattr(obj, k.name)}" for k in ks if shown(k))
