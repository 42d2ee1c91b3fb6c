"""Where things live: the planner chooses a run's placement (runtime/schedule.Placement) from the budgets.

The knobs, cheapest first in step time (docs/design.md, rules 9-11):

    grads_to_host N     finished gradients copied to pinned host memory during backward (the copies overlap the
                        backward, and the next step's copy-out shrinks): costs 4 B/param of host RAM for those units
    spill_layers S      kept layer inputs in pinned host memory, fetched back a block ahead (PCIe, mostly idle)
    checkpoint_every K  a block's inner inputs rebuilt in backward: (K-1)/K of a layer forward more per layer
    keep_top_layers T   with K > 1, the top T layers keep their inputs: rebuilds only in the layers below, so the
                        step time grows with what the memory needs, not in one jump from K = 1 to K = 2
    wave_groups G       the micro-batches in G groups: weights stream 2-3 times per group; with group_grads=host
                        the accumulators wait in pinned host memory between groups (in the gradients' own host
                        buffers for units sent to host: no more host RAM than N = all)
    stream_dtype fp32   bf16 runs stream the fp32 master and cast it on the GPU: no bf16 copy on the host (12 B/param
                        instead of 14) for twice the bus traffic; chosen when it fits where the copy does not, is
                        more than NEAR_FASTEST faster (room for kept checkpoints and gradients), or when the copy's
                        placements would leave less than HOST_HEADROOM of the host RAM free
    seq_tile t          each layer's per-token work (q/k/v, o_proj, MLP) over tiles of t tokens (runtime/layer.py):
                        the same FLOPs and bus traffic, a working set of the attention's q, k, v and output plus one
                        tile instead of the micro-batch's [tokens, intermediate] tensors; the first knob tried when
                        the default placement does not fit (SEQ_TILE tokens)
    attn_block b        plain causal rows longer than b tokens run the attention's backward over (query block, key
                        block) pairs of b tokens (models/attention.blockwise_causal): the same FLOPs, without the
                        fused kernel's row-sized fp32 d(q) and per-query-head d(k), d(v) (16 GiB of a 7-8B layer at
                        512k tokens), at a cost (profile.BLOCKED_ATTENTION_SLOWDOWN): when the tiled layer does not
                        fit, the placements with it (ATTN_BLOCK tokens) are searched beside those without
    reuse_attention N   the top N layers keep their attention (q, k, v, output) on the GPU from the forward wave to
                        their backward, which does not run it again: a knob that buys time with spare GPU memory,
                        tried last, on the placement chosen, at rows of REUSE_FROM tokens or more (`with_reuse`)

    disk_states         with memory.disk_path and host RAM too small for every placement above: Adam v on the SSD
                        tier, then v and m, then v, m and the master (the master beside the bf16 copy only), the
                        first that fits (the least disk traffic), each searched as above (runtime/disk_tier.py;
                        choice.py tries them)

`search` keeps every key the config sets and, when the default placement does not fit, searches the others: for
each (G, where accumulators wait) the smallest K that fits, each with the fewest gradients sent to host and then
the fewest spilled inputs that bring the GPU under its budget (both shrink the GPU need monotonically), for K > 1
also with the most top layers kept that still fits (host and GPU) by the same rule, and keeps,
of the candidates predicted (timing.py) within NEAR_FASTEST of the shortest step, the one with the least host RAM
(host RAM is the scarce resource: docs/design.md, rule 11), then the fewest groups; the bf16 copy is kept when a
placement with it is among those and leaves HOST_HEADROOM of the host RAM free (a placement planned to the last GiB of
the host is one the plan's error can overrun, so one with room comes first). Every
candidate is planned by the same memory model as the plan itself (memory.py), so what is chosen is what is
reported.
"""

from __future__ import annotations

from dataclasses import replace

from ..runtime.knobs import settings
from ..runtime.layer import can_stash
from ..runtime.schedule import Placement, group_sizes
from .calibration import ATTN_BLOCK, HOST_HEADROOM, NEAR_FASTEST, REUSE_FROM, SEQ_TILE
from .memory import Over, gpu_needed, gpu_peak, host_memory
from .profile import GiB, Profile
from .timing import step_time
from .workload import PLACEMENT_KEYS, Workload

FREE_ALL = frozenset(PLACEMENT_KEYS)
CHECKPOINT_INTERVALS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
GROUP_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def describe(pl: Placement, groups: int) -> str:
    """A placement in config keys, with the wave groups that run (the keys shown: runtime/knobs.Knob.shown)."""
    return settings(replace(pl, wave_groups=groups))


def attn_block_for(adapter, w: Workload) -> int:
    """The planner's attention backward block for this workload: ATTN_BLOCK when its rows are causal ones (plain, or
    packed on the variable-length kernel, on a family whose attention splits and whose layers, some at least, run
    the flash kernel at this length) of more than ATTN_BLOCK tokens, else 0 (nothing to block)."""
    if w.seq_len <= ATTN_BLOCK or not can_stash(adapter):
        return 0
    if w.device == "cuda" and w.precision != "bf16":
        return 0  # the fused kernels take bf16 on CUDA: fp32 runs keep SDPA's own path
    if all(adapter.cuda_attention(k, w.seq_len, w.packed)[0] not in ("flash", "varlen")
           for k in set(adapter.layer_kinds)):
        return 0  # (layers on FlexAttention keep it: its backward has no row-sized fp32 buffer)
    return ATTN_BLOCK


def seq_tile_for(w: Workload) -> int:
    """The planner's MLP tile for this workload: SEQ_TILE tokens when its largest micro-batch makes at least two
    tiles of them, else 0 (runtime/layer.token_tiles would run it whole)."""
    return SEQ_TILE if max(w.micro_batches) * w.seq_len >= 2 * SEQ_TILE else 0


_WITH: dict[tuple, Placement] = {}  # (placement, changes) -> the placement changed: the search asks for the same many times


def _with(pl: Placement, **kw) -> Placement:
    """dataclasses.replace(pl, **kw), made once (Placement is immutable; its validation is what replace costs)."""
    key = (pl, *kw.items())
    got = _WITH.get(key)
    if got is None:
        if len(_WITH) >= 1 << 16:
            _WITH.clear()
        got = _WITH[key] = replace(pl, **kw)
    return got


class _Search:
    def __init__(self, adapter, units, w: Workload, prof: Profile, host_limit, gpu_limit, free):
        self.adapter, self.units, self.w, self.prof = adapter, units, w, prof
        self.host_limit, self.gpu_limit, self.free = host_limit, gpu_limit, free
        self._mem: dict[Placement, tuple[float, float]] = {}
        self._host: dict[Placement, float] = {}
        self._work: dict[Placement, Workload] = {}
        self._over: set[Placement] = set()  # placements whose GPU need was found above the limit, no more
        self.tried = 0
        self._ahead: set[Placement] = set()  # placements walked ahead of the search, not yet counted (_none_fit)
        self.host_refused = False  # whether the last settle() refused its structure for host RAM before any walk
        self.short: tuple[float, Placement] | None = None  # the least host RAM of a structure refused for it

    def _refused(self, pl: Placement, host: float) -> None:
        if self.short is None or host < self.short[0]:
            self.short = (host, pl)

    def placement(self, **kw) -> Placement:
        """The workload's placement with the free keys among `kw` changed (set keys stay as the config has them)."""
        return _with(self.w.placement, **{k: v for k, v in kw.items() if k in self.free})

    def work(self, pl: Placement) -> Workload:
        """The workload with this placement (made once: the search asks for host, GPU and time of each)."""
        got = self._work.get(pl)
        if got is None:
            got = self._work[pl] = replace(self.w, placement=pl)
        return got

    def memory(self, pl: Placement) -> tuple[float, float]:
        """(host bytes, GPU bytes needed) of this placement."""
        if pl not in self._mem:
            w = self.work(pl)
            host = self._host_bytes(pl)
            peak = gpu_peak(self.adapter, self.units, w, self.prof)
            self._mem[pl] = (host, gpu_needed(peak, w))
            self.tried += pl not in self._over
        elif pl in self._ahead:
            self._ahead.discard(pl)
            self.tried += 1
        return self._mem[pl]

    def host(self, pl: Placement) -> float:
        """Host bytes of this placement alone (no GPU simulation: milliseconds where `memory` takes up to a second)."""
        return self._host_bytes(pl)

    def _host_bytes(self, pl: Placement) -> float:
        if pl not in self._host:
            self._host[pl] = sum(host_memory(self.units, self.work(pl), self.adapter.tied).values())
        return self._host[pl]

    def gpu_ok(self, pl: Placement) -> bool:
        """Whether `pl`'s GPU need fits: its walk stops at the first phase that does not (gpu_needed grows with the
        peak, so that phase decides), counted as planned as `memory` counts it."""
        if self.gpu_limit is None or pl in self._mem:
            if pl in self._ahead:  # walked ahead of the search (_none_fit): counted now, as the search walks it
                self._ahead.discard(pl)
                self.tried += 1
            return self.gpu_limit is None or self._mem[pl][1] <= self.gpu_limit
        if pl in self._over:
            return False
        w = self.work(pl)
        try:
            peak = gpu_peak(self.adapter, self.units, w, self.prof,
                            over=lambda p: gpu_needed(p, w) > self.gpu_limit)
        except Over:
            self._over.add(pl)
            self.tried += 1
            return False
        self._mem[pl] = (self._host_bytes(pl), gpu_needed(peak, w))
        self.tried += 1
        return self._mem[pl][1] <= self.gpu_limit

    def host_ok(self, pl: Placement) -> bool:
        return self.host_limit is None or self.memory(pl)[0] <= self.host_limit

    def smallest(self, pl: Placement, key: str, top: int) -> Placement | None:
        """`pl` with the smallest value of `key` (from its current one up to `top`) whose GPU need fits."""
        if key not in self.free:
            return pl if self.gpu_ok(pl) else None
        lo = getattr(pl, key)
        if self.gpu_ok(pl):
            return pl
        if not self.gpu_ok(_with(pl, **{key: top})):
            return None
        hi = top  # fits at hi, not at lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.gpu_ok(_with(pl, **{key: mid})):
                hi = mid
            else:
                lo = mid
        return _with(pl, **{key: hi})

    def most_kept(self, pl: Placement) -> Placement | None:
        """`pl` (K > 1, settled) with the most top layers keeping their inputs that still settles: the memory of
        more kept inputs grows with their number, so the last that fits is found by bisection."""
        if "keep_top_layers" not in self.free:
            return None
        lo, hi = pl.keep_top_layers, len(self.units) - 2  # settles at lo; all layers kept is K = 1, tried first
        best = pl
        while hi - lo > 1:
            mid = (lo + hi) // 2
            got = self.settle(_with(pl, keep_top_layers=mid, grads_to_host=self.w.placement.grads_to_host,
                                      spill_layers=self.w.placement.spill_layers))
            if got is None:
                hi = mid
            else:
                lo, best = mid, got
        return best if best is not pl else None

    def _none_fit(self, pl: Placement, n: int, L: int) -> bool:
        """Whether `pl`'s structure fits with no gradients sent and spilled inputs, from its placement with all of
        both (spilling shrinks the GPU need: when that does not fit, neither does any with all gradients sent), asked
        before the search below walks the one with all gradients sent and none spilled. Counted as that search counts
        its walks: the one with all gradients sent as walked and refused; the one with all of both, when it fits, when
        the search comes to it (`_ahead`)."""
        sent = _with(pl, grads_to_host=n)
        full = _with(sent, spill_layers=L)
        if sent in self._mem or sent in self._over or full in self._mem or full in self._over:
            return False  # walked before: the search below costs no more than this
        tried = self.tried
        if self.gpu_ok(full):
            self.tried = tried
            self._ahead.add(full)
            return False
        self._over.add(sent)
        self.tried += 1
        return True

    def settle(self, pl: Placement) -> Placement | None:
        """The fewest gradients to host, then the fewest spilled inputs, that bring `pl`'s structure (K, G, where
        accumulators wait) under the GPU budget; None when nothing does, or the host cannot hold the result."""
        n, L = len(self.units), len(self.units) - 2
        free_n = "grads_to_host" in self.free
        parks = len(group_sizes(len(self.w.micro_batches), pl.wave_groups)) > 1 and pl.group_grads == "host"
        if parks and free_n:
            pl = _with(pl, grads_to_host=n)  # costs no host RAM: the accumulators wait there anyway
        self.host_refused = self.host_limit is not None and self.host(pl) > self.host_limit
        if self.host_refused:
            self._refused(pl, self.host(pl))
            return None  # gradients and inputs sent to the host only add to it: no search below can fit
        if free_n and "spill_layers" in self.free and not self.gpu_ok(pl) and self._none_fit(pl, n, L):
            return None
        got = self.smallest(pl, "grads_to_host", n)
        if got is None:  # gradients alone are not enough: spill inputs too, then take back what gradients can
            got = self.smallest(_with(pl, grads_to_host=n) if free_n else pl, "spill_layers", L)
            if got is not None and free_n and not parks:
                got = self.smallest(_with(got, grads_to_host=pl.grads_to_host), "grads_to_host", n)
        if got is not None and not self.host_ok(got):
            self._refused(got, self.memory(got)[0])
            return None
        return got


def _step_s(adapter, units, w: Workload, prof: Profile) -> float:
    """The predicted step of a placement the search weighs (without the other clipping mode's, which only the report
    shows)."""
    return step_time(adapter, units, w, prof, other_mode=False)["step_s"]


def _candidates(s: _Search, w: Workload) -> list[tuple[float, int, float, Placement]]:
    """(step s, groups, host bytes, placement) of every placement the search finds that fits, from `w`'s."""
    adapter, units, prof = s.adapter, s.units, s.prof
    num_micro = len(w.micro_batches)
    candidates: list[tuple[float, int, float, Placement]] = []  # (step s, groups, host bytes, placement)

    def consider(pl: Placement | None) -> bool:
        if pl is None:
            return False
        ww = s.work(pl)
        candidates.append((_step_s(adapter, units, ww, prof), len(ww.groups), s.memory(pl)[0], pl))
        return True

    # the same structure, gradients and then inputs to host: with no rebuild and one wave nothing is faster
    if not (consider(s.settle(w.placement)) and w.placement.checkpoint_every == 1 and len(w.groups) == 1):
        L = len(units) - 2
        Ks = [k for k in CHECKPOINT_INTERVALS if k <= L] if "checkpoint_every" in s.free else \
            [w.placement.checkpoint_every]
        Gs = [g for g in GROUP_COUNTS if g <= num_micro] if "wave_groups" in s.free else [w.placement.wave_groups]
        wheres = ("gpu", "host") if "group_grads" in s.free else (w.placement.group_grads,)
        for G in Gs:
            for where in (wheres if G > 1 else (w.placement.group_grads,)):
                for K in Ks:  # the smallest K that fits this (G, where): more K only adds rebuilds
                    pl = s.settle(s.placement(checkpoint_every=K, wave_groups=G, group_grads=where))
                    if consider(pl):
                        if K > 1:  # and the fewest layers in blocks: rebuilds only where memory needs them
                            consider(s.most_kept(pl))
                        break
                    if s.host_refused and not w.placement.spill_layers:
                        break  # K moves no host RAM when no input is spilled: every K is refused the same
            if any(c[3].checkpoint_every == 1 and c[3].spill_layers == 0 for c in candidates):
                break  # more groups would only add weight crossings
    return candidates


def with_reuse(adapter, units, w: Workload, prof: Profile, host_limit: float | None, gpu_limit: float | None,
               free: frozenset = frozenset({"reuse_attention"})) -> tuple[Workload, str]:
    """`w` with the most top layers keeping their attention for the backward that still fit (the GPU need grows
    with their number: bisection), when its rows are of REUSE_FROM tokens or more, the model's attention splits
    (runtime/layer.can_stash), the placement fits, and the step is predicted shorter; when seq_tile is free and
    unset, also with the layer over SEQ_TILE tiles (a smaller working set: room for more), the faster of the two.
    Returns it and what it says of it."""
    L = len(units) - 2
    if w.seq_len < REUSE_FROM or not can_stash(adapter) or w.placement.reuse_attention:
        return w, ""
    tries = [w]
    if "seq_tile" in free and not w.placement.seq_tile and seq_tile_for(w):
        tries.append(replace(w, placement=replace(w.placement, seq_tile=seq_tile_for(w))))
    before = _step_s(adapter, units, w, prof)
    best = None  # (step s, GPU need, workload)
    for base in tries:
        s = _Search(adapter, units, base, prof, host_limit, gpu_limit, frozenset({"reuse_attention"}))
        if not (s.gpu_ok(base.placement) and s.host_ok(base.placement)):
            continue
        lo, hi = 0, L + 1  # fits at lo; not at hi (L + 1: past every layer)
        if s.gpu_ok(replace(base.placement, reuse_attention=L)):
            lo = L
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if s.gpu_ok(replace(base.placement, reuse_attention=mid)):
                lo = mid
            else:
                hi = mid
        if lo == 0:
            continue
        got = replace(base, placement=replace(base.placement, reuse_attention=lo))
        cand = (_step_s(adapter, units, got, prof), s.memory(got.placement)[1], got)
        best = cand if best is None or cand[:2] < best[:2] else best
    if best is None or best[0] >= before:
        return w, ""
    got = best[2]
    tiled = f", the layer over tiles of {got.placement.seq_tile} tokens" if got.placement.seq_tile != \
        w.placement.seq_tile else ""
    return got, (f"; the top {got.placement.reuse_attention} layers keep their attention for the backward "
                 f"(memory.reuse_attention={got.placement.reuse_attention}{tiled}: {before:.1f} -> {best[0]:.1f} "
                 f"s/step predicted)")


def _least_host(units, adapter, used: list) -> str:
    """When nothing fits: the structure the search refused for host RAM that needs the least of it, with its three
    largest parts (what a larger host budget, or less of those parts, would have to cover); '' when none was."""
    refused = [(sb.short[0], base, sb.short[1]) for base, sb in used if sb.short is not None]
    if not refused:
        return ""
    host, base, pl = min(refused, key=lambda r: r[0])
    wl = replace(base, placement=pl)
    parts = sorted(host_memory(units, wl, adapter.tied).items(), key=lambda kv: -kv[1])[:3]
    return (f"; the least host RAM the search met is {host / GiB:.1f} GiB ({describe(pl, len(wl.groups))}), "
            f"largest parts: " + ", ".join(f"{k} {v / GiB:.1f} GiB" for k, v in parts))


def host_total(adapter, units, w: Workload, prof: Profile) -> float:
    """Host RAM of a workload as planned as is (a CPU run's device work included: the device is the host)."""
    host = sum(host_memory(units, w, adapter.tied).values())
    if w.device != "cuda":
        host += gpu_peak(adapter, units, w, prof)
    return host


def search(adapter, units, w: Workload, prof: Profile, host_limit: float | None, gpu_limit: float | None,
           free: frozenset) -> tuple[Workload, str, bool]:
    """The placement of the keys in `free` (the others as given) with the workload's states where they are
    (choice.choose moves them to the SSD tier): (workload, why, whether it fits)."""
    if w.device != "cuda" or not free:
        ok = host_limit is None or host_total(adapter, units, w, prof) <= host_limit
        return w, ("as the config sets it" if not free else "a CPU run: the default placement (the device is the "
                   "host)"), ok
    w = replace(w, placement=replace(w.placement, **{k: getattr(Placement(), k) for k in free}))
    s = _Search(adapter, units, w, prof, host_limit, gpu_limit, free)
    if s.gpu_ok(w.placement) and s.host_ok(w.placement):
        unset = free >= FREE_ALL - {"reuse_attention"}  # (that knob is tried after: `with_reuse`)
        return w, "the default placement fits" if unset else "the placement the config sets fits", True
    default_gpu, tiled = s.memory(w.placement)[1], ""
    if "seq_tile" in free and seq_tile_for(w):  # the cheapest knob: tile the MLP, then search the others
        w = replace(w, placement=replace(w.placement, seq_tile=seq_tile_for(w)))
        free = free - {"seq_tile"}
        s = _Search(adapter, units, w, prof, host_limit, gpu_limit, free)
        tiled = (f"; with the layer over tiles of {w.placement.seq_tile} tokens it needs "
                 f"{s.memory(w.placement)[1] / GiB:.1f} GiB")
        if s.gpu_ok(w.placement) and s.host_ok(w.placement):
            return w, f"the default placement needs {default_gpu / GiB:.1f} GiB of GPU memory{tiled} and fits", True
    searches = [(w, s)]  # the attention's fused backward, and (profile.BLOCKED_ATTENTION_SLOWDOWN, less
    if "attn_block" in free and attn_block_for(adapter, w):  # memory) its backward over blocks, both searched
        wb = replace(w, placement=replace(w.placement, attn_block=attn_block_for(adapter, w)))
        searches.append((wb, _Search(adapter, units, wb, prof, host_limit, gpu_limit, free - {"attn_block"})))
        need = searches[1][1].memory(wb.placement)[1]
        tiled += f"; with the attention's backward over blocks of {wb.placement.attn_block} tokens {need / GiB:.1f} GiB"
    free = free - {"attn_block"}
    candidates, tried, used = [], 0, []
    for base, sb in searches:
        candidates += _candidates(sb, base)
        tried += sb.tried
        used.append((base, sb))
        if "stream_dtype" in free and base.precision == "bf16" and "master" not in base.disk_states:
            # also without the bf16 copy (12 B/param): more room for checkpoints and gradients
            w32 = replace(base, placement=replace(base.placement, stream_dtype="fp32"))
            s32 = _Search(adapter, units, w32, prof, host_limit, gpu_limit, free)
            candidates += _candidates(s32, w32)
            tried += s32.tried
            used.append((w32, s32))
    if not candidates:
        return w, (f"no placement fits (tried {tried}): the default needs {default_gpu / GiB:.1f} GiB of GPU "
                   f"memory{tiled}, and {s.memory(w.placement)[0] / GiB:.1f} GiB of host RAM" +
                   _least_host(units, adapter, used)), False
    fastest = min(c[0] for c in candidates)  # host RAM is the scarce resource (docs/design.md, rule 11): of the
    #   placements within NEAR_FASTEST of the fastest, the one using least; but the bf16 copy is kept when that is
    #   as fast (fp32 streaming doubles the bus traffic for 2 B/param) and leaves HOST_HEADROOM of the host free
    near = [c for c in candidates if c[0] <= fastest * (1 + NEAR_FASTEST)]
    step, groups, host, pl = min(near, key=lambda c: _preference(c, host_limit))
    tight_copy = pl.stream_dtype == "fp32" and any(_tight(c[2], host_limit) and c[3].stream_dtype == "bf16"
                                                   for c in near)
    saved = host - min(c[2] for c in near)  # what streaming the fp32 master would save, when the copy is kept
    why = (f"the default placement needs {default_gpu / GiB:.1f} GiB of GPU memory{tiled}; {len(candidates)} "
           f"placements fit (of {tried} planned); this one is predicted within {NEAR_FASTEST:.0%} of the fastest "
           f"({fastest:.1f} s/step) with the least host RAM of those" +
           (", the fp32 master streamed" if pl.stream_dtype == "fp32" else
            f" that keep the bf16 copy (streaming the fp32 master instead: {saved / GiB:.1f} GiB less)" if saved > 0
            else "") +
           (f" (with the bf16 copy less than {HOST_HEADROOM:.0%} of the host RAM would stay free)" if tight_copy
            else "") +
           (", the attention's backward over blocks" if pl.attn_block else ""))
    return replace(w, placement=pl), why, True


def _tight(host: float, host_limit: float | None) -> bool:
    """Whether a placement's host RAM leaves less than HOST_HEADROOM of the limit free."""
    return host_limit is not None and host > host_limit * (1 - HOST_HEADROOM)


def _preference(c: tuple[float, int, float, Placement], host_limit: float | None) -> tuple:
    """Sort key of a near-fastest candidate (step s, groups, host bytes, placement): those that leave room on the
    host first; among them the bf16 copy kept, then the least host RAM; among those that do not, the least host RAM
    (whatever is streamed); then the fewest groups, the shortest step."""
    step, groups, host, pl = c
    tight = _tight(host, host_limit)
    return tight, (pl.stream_dtype != "bf16") and not tight, host, groups, step
