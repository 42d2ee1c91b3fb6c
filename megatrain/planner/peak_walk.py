"""The placement search's walk of a step for the GPU peak alone (memory.gpu_peak): schedule.walk's visits, with each
wave group's run of forward uses handed to the books' `forward_run` and each run of backward uses summed here in one
loop, use by use as memory._GpuBooks' `enter` and `backward` do (the same sums in the same order, without the calls
per use: the search walks hundreds of placements; tests/test_plan_peak_walk.py holds it to the report's walk, phase
by phase, to the last bit)."""

from __future__ import annotations

from ..runtime.schedule import KINDS


def walk_peak(uses, books) -> None:
    """schedule.walk(uses, books) for peak-only books (memory._GpuBooks with peak_only)."""
    methods = {kind: getattr(books, kind) for kind in KINDS}
    run: list = []
    for use in uses:
        kind = use.kind
        if kind == "forward" or kind == "backward":
            if run and (run[-1].kind != kind or run[-1].group != use.group):
                _run(books, run)
                run = []
            run.append(use)
            continue
        if run:
            _run(books, run)
            run = []
        books.enter(use)
        methods[kind](use)
        books.leave(use)
    if run:
        _run(books, run)


def _run(books, run: list) -> None:
    if run[0].kind == "forward":
        books.forward_run(run)
    else:
        backward_run(books, run)


def backward_run(b, uses: list) -> None:
    """`enter`, `backward` and `leave` (nothing) of each of one group's consecutive backward uses: the accumulator
    taken (`_take`), the input brought back (`_bring_back`), the phase total summed as `backward` sums it, the input
    dropped, the gradient placed (`_done`), the Tally entries kept as Tally keeps them."""
    kept, stashed, parked, active, grad = b.kept, b.stashed, b.parked, b.active, b.grad
    for use in uses:
        if use.group != b.gi:
            b._begin_group(use.group)
        b.prev_out, b.last_out = b.last_out, 0.0
        unit, layer = use.grad_unit, use.layer
        if unit < 0 or unit in parked or (b.gi > 0 and b.w.placement.group_grads == "host"):
            b._take(unit)
        else:  # a new accumulator (Tally.__setitem__)
            acc = grad[unit]
            active.total += acc - active.get(unit, 0.0)
            dict.__setitem__(active, unit, acc)
        if use.fetch is not None:
            kept[use.fetch] = b.C
        if layer not in kept:  # (Tally.setdefault)
            kept[layer] = b.C
        own = stashed.pop(layer, None) if layer in stashed else None
        m, state, transient = b.bwd if own is None else b.bwd_st
        left = 0.0
        if own is not None:
            left = b.st_after[m]
            state -= left
        total = b.base_total + (stashed.total + left) + (kept.total - kept[layer] + state) + b.dh + transient + \
            active.total + b.finished + parked.total
        if total > b.peak:
            b._peak_at(total)
        kept.total -= kept[layer]  # (Tally.__delitem__)
        dict.__delitem__(kept, layer)
        b._done(unit, use.grad)
