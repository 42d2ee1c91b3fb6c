"""The run's placement: the memory knobs' search (placement.py) with the states in host RAM, else on the SSD tier
(memory.disk_path: Adam v, then v and m, then those and the master, the first that fits), then the layers that
keep their attention (placement.with_reuse). When nothing fits host RAM but a placement fits the GPU, the plan is
that placement's under the least host budget that holds one (bisected to LEAST_HOST_STEP), so host RAM is the one
problem it names, with what the run needs of it: the default placement's host RAM may be less, but come with a GPU
need no placement of it meets."""

from __future__ import annotations

from dataclasses import replace

from ..runtime.schedule import Placement
from .placement import FREE_ALL, describe, host_total, search, with_reuse
from .profile import Profile
from .tally import sized
from .workload import Workload

DISK_SETS = (("v",), ("v", "m"), ("v", "m", "master"))  # the SSD tier's placements, least disk traffic first
LEAST_HOST_STEP = 1.02  # the host budget of least_host_fit's bisection, to within this ratio


def choose(adapter, units, w: Workload, prof: Profile, host_limit: float | None, gpu_limit: float | None,
           free: frozenset = FREE_ALL, disk: bool = False) -> tuple[Workload, str]:
    """The workload with its placement chosen (the keys in `free`; the others as given), and why. disk: the SSD
    tier may take states (memory.disk_path set, memory.disk_states not): tried, in DISK_SETS order, when no
    placement fits host RAM. Then, with the rest settled, the layers that keep their attention (`with_reuse`)."""
    units = sized(units)
    w, why = _choose_states(adapter, units, w, prof, host_limit, gpu_limit, free - {"reuse_attention"}, disk)
    if "reuse_attention" in free and w.device == "cuda":
        w, more = with_reuse(adapter, units, w, prof, host_limit, gpu_limit, free)
        why += more
    return w, why


def _choose_states(adapter, units, w: Workload, prof: Profile, host_limit: float | None, gpu_limit: float | None,
                   free: frozenset, disk: bool) -> tuple[Workload, str]:
    """choose() but for reuse_attention: the placement with the states in RAM, else on the SSD tier; when none fits
    host RAM but one fits the GPU, the one that needs the least host RAM (least_host_fit), so that the plan reports
    host RAM alone short, by what it lacks."""
    got, why, fits = search(adapter, units, w, prof, host_limit, gpu_limit, free)
    if fits:
        return got, why
    if disk and not w.disk_states:
        got_d, why = _on_disk(adapter, units, w, prof, host_limit, gpu_limit, free, why)
        if got_d is not None:
            return got_d, why
    if w.device == "cuda" and free and host_limit is not None:
        least = least_host_fit(adapter, units, w, prof, host_limit, gpu_limit, free)
        if least is not None:
            return least, (f"{why}; the GPU fits with {describe(least.placement, len(least.groups))}, the least "
                           f"host RAM of the placements that fit it")
    return got, why


def _on_disk(adapter, units, w: Workload, prof: Profile, host_limit: float | None, gpu_limit: float | None,
             free: frozenset, why: str) -> tuple[Workload | None, str]:
    """The placement with states on the SSD tier (DISK_SETS in order) that fits, and why; (None, why it did not)."""
    last = ""  # why the last SSD placement tried did not fit either
    for states in DISK_SETS:
        if "master" in states and (w.precision == "fp32" or w.placement.stream_dtype == "fp32" and
                                   "stream_dtype" not in free):
            continue  # the GPU streams the fp32 master itself: it stays in RAM
        wd = replace(w, disk_states=states)
        if w.device != "cuda":
            if host_total(adapter, units, wd, prof) <= host_limit:
                return wd, f"host RAM holds the run with {', '.join(states)} on the SSD tier"
            continue
        got_d, why_d, fits_d = search(adapter, units, wd, prof, host_limit, gpu_limit, free)
        if fits_d:
            return got_d, (f"no placement fits host RAM with every state there; with {', '.join(states)} on the SSD "
                           f"tier (memory.disk_path): {why_d}")
        last = f" ({why_d})"
    return None, why + "; nor with v, m and the master on the SSD tier" + last


def least_host_fit(adapter, units, w: Workload, prof: Profile, host_limit: float, gpu_limit: float | None,
                   free: frozenset) -> Workload | None:
    """When no placement fits `host_limit`: the one the search chooses under the least host budget above it under
    which one fits (bisected to LEAST_HOST_STEP), or None when none fits the GPU whatever the host."""
    got, _, ok = search(adapter, units, w, prof, None, gpu_limit, free)
    if not ok:
        return None
    bare = {k: getattr(Placement(), k) for k in free} | ({"stream_dtype": "fp32"} if "stream_dtype" in free else {})
    floor = host_total(adapter, units, replace(w, placement=replace(w.placement, **bare)), prof)  # nothing needs
    #                                                      less: gradients, inputs and groups sent to host add to it
    lo, hi = max(host_limit, floor / LEAST_HOST_STEP), host_total(adapter, units, got, prof)
    while hi > lo * LEAST_HOST_STEP:
        mid = (lo * hi) ** 0.5
        cand, _, ok = search(adapter, units, w, prof, mid, gpu_limit, free)
        if ok:
            got, hi = cand, host_total(adapter, units, cand, prof)
        else:
            lo = mid
    return got
