"""The run's placement: the memory knobs' search (placement.py) with the states in host RAM, else on the SSD tier
(memory.disk_path: Adam v, then v and m, then those and the master, the first that fits), then the layers that
keep their attention (placement.with_reuse)."""

from __future__ import annotations

from dataclasses import replace

from .placement import FREE_ALL, host_total, search, with_reuse
from .profile import Profile
from .tally import sized
from .workload import Workload

DISK_SETS = (("v",), ("v", "m"), ("v", "m", "master"))  # the SSD tier's placements, least disk traffic first


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
    """choose() but for reuse_attention: the placement with the states in RAM, else on the SSD tier."""
    got, why, fits = search(adapter, units, w, prof, host_limit, gpu_limit, free)
    if fits:
        return got, why
    if disk and not w.disk_states:
        got_d, why = _on_disk(adapter, units, w, prof, host_limit, gpu_limit, free, why)
        if got_d is not None:
            return got_d, why
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

