"""Small aids of the placement search, which plans hundreds of placements of one model: units that size themselves
once, a units list's sizes computed once, and byte tallies that keep their total as entries change (memory.py's
books)."""

from __future__ import annotations

from functools import cached_property
from itertools import accumulate

from ..models.base import Unit
from ..runtime.adamw import landing_piece
from ..runtime.schedule import gradient_order, slot_numel
from ..runtime.store import padded_numel


class _Sized(Unit):
    """A Unit whose size is summed once: the placement search sizes every unit for each placement it plans."""

    @cached_property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)


def sized(units) -> list:
    """`units` as units whose `numel` is computed once (the same units otherwise)."""
    return [u if isinstance(u, _Sized) else _Sized(u.kind, u.index, u.specs) for u in units]


class Tally(dict):
    """Bytes by key, with their total kept as entries change: every value is a whole number of bytes (a float below
    2**53), so the running total equals sum(values()) whatever the order."""

    total = 0.0

    def __setitem__(self, key, value) -> None:
        self.total += value - self.get(key, 0.0)
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self.total -= self[key]
        super().__delitem__(key)

    def setdefault(self, key, value):
        if key not in self:
            self[key] = value
        return self[key]

    def pop(self, key, *default):
        if key in self:
            self.total -= self[key]
        return super().pop(key, *default)


class Sizes:
    """A units list's sizes, computed once: the placement search plans thousands of placements of the same units."""

    def __init__(self, units):
        self.units, self.n = units, len(units)
        self.numels = [u.numel for u in units]
        self.elems = sum(padded_numel(n) for n in self.numels)  # HostStore.total_elems
        self.largest = max(self.numels)
        self.landing = landing_piece(self.largest)
        self.grad = [4.0 * n for n in self.numels]
        self.sent = list(accumulate((self.numels[i] for i in gradient_order(self.n)), initial=0))  # the first N's
        self.slots: dict[bool, int] = {}
        self.left_after: dict[tuple, list[float]] = {}

    def slot_numel(self, tied: bool) -> int:
        if tied not in self.slots:
            self.slots[tied] = slot_numel(self.numels, tied)
        return self.slots[tied]


_SIZES: dict[int, Sizes] = {}


def unit_sizes(units) -> Sizes:
    """The sizes of `units` (the list itself is the key: the cache holds it, so its id stays its own)."""
    got = _SIZES.get(id(units))
    if got is None or got.units is not units or got.n != len(units):
        if len(_SIZES) >= 32:
            _SIZES.clear()
        got = _SIZES[id(units)] = Sizes(units)
    return got
