"""Replay MoE routing traces against expert-cache placement policies and plot the decode
miss rate against cache capacity (the paper's §5.3 "Expert locality", Fig. 4b).

Setting. The GPU expert cache holds ``capacity`` (layer, expert) pairs out of the pool of
``L*E``. A trace (``freetoken_sglang.observe.routing_trace``) is replayed one *layer call* at a
time: step s, MoE layer l = 0..L-1, in that order. A call **reads** the de-duplicated set of
experts its tokens route to at that layer (an expert picked by several tokens of the call
is one read); a read is a **hit** when the pair is resident, else a **miss**. Prefill and
decode calls both go through the cache (prefill updates the residency of the admit-all
policies), but are counted separately:

    decode miss rate  = misses of decode calls  / reads of decode calls    (plotted)
    prefill miss rate = misses of prefill calls / reads of prefill calls   (reported)

Policies (``POLICIES``; ``EXTRA_POLICIES`` are available with ``--policies``):

* ``global-lru`` (FreeToken): one LRU over all layers, exactly ``freetoken_sglang.cache.residency``:
  a call's hits are stamped with the new clock first; each miss, in expert order, takes
  the next victim among the slots not used by the call, oldest first: never-used slots
  (lowest index first), then the smallest last-use stamp, ties by lowest slot.
* ``per-layer-lru``: layer l owns ``capacity // L`` slots with its own LRU of the same
  rules (SGLang's paged experts); leftover slots are unused.
* ``static-frequent``: the ``capacity`` (layer, expert) pairs read most often by decode
  calls over the WHOLE trace (ties: lowest layer*E + expert) are placed once and never
  change; misses are served without entering the cache (llama.cpp / KTransformers-style
  static placement). The counts come from the future, so this is an ORACLE, a best case
  for static placement of the decode metric.
* ``prefill-updated``: after every prefill (a maximal run of consecutive prefill steps,
  so chunked prefill counts once), the placement becomes the ``capacity`` pairs most
  routed by that prefill's tokens (token-level counts; ties keep the previous placement's
  order, initially lowest id first), held fixed until the next prefill; misses never
  enter the cache (KTransformers' prefill-updated placement). A prefill itself is served
  by the placement in force before it; before the first prefill nothing is placed.
* ``belady``: the optimal admit-all policy for the decode metric, the lower bound of
  admit-all policies (global-lru, per-layer-lru). Every miss is admitted, the call's whole
  de-duplicated set is resident at once (the call's experts are never victims), and the
  victim is the resident pair whose next *decode* read is furthest in the future. A pair
  whose next read is a prefill read counts as never read again: the prefill reloads it
  at no cost to the decode metric (ties: furthest next read of any phase). On a
  decode-only trace this is classic Belady (MIN).
* ``belady-total`` (extra): classic Belady on all reads (next read of any phase); it
  minimises decode + prefill misses.
* ``static-layers`` (extra): routing-blind whole-layer split: all experts of the last
  ``capacity // E`` layers (llama.cpp ``--n-cpu-moe``).
* ``stream-reserved``, ``stream-borrowed`` (extra): prefill layer calls are streamed through
  two full-layer buffers of E slots outside the LRU; decode calls are exactly ``global-lru``.
  A prefill call is served without reads or misses (its ``prefill_reads`` and
  ``prefill_misses`` are 0, so its miss rate is n/a) and otherwise leaves the LRU alone.
  ``reserved`` (``freetoken_sglang.cache.layout``): the LRU has ``capacity - 2E`` slots and
  never sees a prefill. ``borrowed`` (the FreeToken paper, and the server's default
  ``--freetoken-prefill-buffers borrowed``): the LRU has ``capacity`` slots;
  each prefill step first takes the LRU's next 2E victims as the buffers (never-used slots
  first, then oldest; their experts are evicted), and after the step gives them back
  holding the experts of MoE layers L-2 and L-1 that are not resident, as the most recent
  entries (in flat-id order to the slots in slot order); slots left over come back empty,
  first victims. Capacity must be >= 2E + k (reserved) or >= 2E (borrowed), else ValueError.
  ``fills`` are decode fills; ``evictions`` include the entries borrowed for the buffers.

* ``global-lru-admit`` (extra): ``global-lru`` with the server's admission rule
  (``--freetoken-admission reuse``, ``freetoken_sglang/policy/miss.py``) on decode calls: a
  miss is filled only if its last use (any call) is more recent than the least recently used
  slot's (after the call's hits are stamped; while a slot was never used, every miss); the
  other misses are served without entering the cache (on the CPU in the server). Every
  admitted miss is filled: the server's qstar with admission where B_P >= B_H (q* = m); with
  B_P < B_H the server fills at most q* of them. Prefill calls fill every miss (the server
  streams them). ``fills`` shows how many misses were admitted.

When a call reads more experts than an admit-all policy's cache (or per-layer share) can
hold, its hits stay, the misses fill every slot not used by the call (global/per-layer LRU:
in expert order; Belady: earliest next use first) and the rest are served without
admission. The lower-bound property of ``belady`` holds for capacities where this never
happens.

Output (``--out-dir``): ``NAME.json`` (all counts), ``NAME.md`` (tables) and ``NAME.png``
(decode miss rate vs capacity, mean over traces with a min-max band). Results of
synthetic traces are labelled SYNTHETIC in all three.

Usage:
    python benchmarks/replay.py TRACE.npz [TRACE2.npz ...] --out-dir DIR
    python benchmarks/replay.py --synthetic --synthetic-traces 3 --out-dir DIR
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import os
import sys
import textwrap
import time
from collections import OrderedDict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from freetoken_sglang.observe.routing_trace import RoutingTrace  # noqa: E402

import synthetic_routing  # noqa: E402

POLICIES = ("global-lru", "per-layer-lru", "static-frequent", "prefill-updated", "belady")
EXTRA_POLICIES = ("belady-total", "static-layers", "stream-reserved", "stream-borrowed",
                  "global-lru-admit")
STREAM_POLICIES = ("stream-reserved", "stream-borrowed")
ALL_POLICIES = POLICIES + EXTRA_POLICIES
ADMIT_ALL = ("global-lru", "per-layer-lru", "belady", "belady-total")
LABELS = {
    "global-lru": "global LRU (FreeToken)",
    "per-layer-lru": "per-layer LRU (capacity/L slots per layer)",
    "static-frequent": "static most-frequent (ORACLE whole-trace counts)",
    "prefill-updated": "prefill-updated placement (KTransformers-style)",
    "belady": "Belady, optimal admit-all (lower bound)",
    "belady-total": "Belady on all misses",
    "static-layers": "static whole layers (llama.cpp-style, routing-blind)",
    "stream-reserved": "global LRU of capacity-2E + reserved prefill buffers",
    "stream-borrowed": "global LRU + prefill buffers borrowed per prefill (paper)",
    "global-lru-admit": "global LRU + admission (misses reused within the LRU age)",
}
DEFAULT_CAPACITIES = tuple(range(5, 101, 5))


# --------------------------------------------------------------------------------------------
# Trace -> layer calls
# --------------------------------------------------------------------------------------------


@dataclass
class CallTable:
    """A trace as layer calls: call ``c`` is step ``c // L``, MoE layer ``c % L``.

    Attributes:
        num_layers, num_experts: L, E; ``pool`` = L*E.
        items: int32 [R] flat pair ids ``l*E + e``, the de-duplicated reads of each call,
            ascending within a call, calls concatenated in order.
        offsets: int64 [C + 1]; call c reads ``items[offsets[c]:offsets[c+1]]``.
        call_decode: bool [C], the call belongs to a decode step.
        placement_rank: int32 [R], for ``prefill-updated``: the rank of the read pair in the
            placement in force at that call (``pool`` when none is): the read hits at
            capacity C iff rank < C.
        run_ranks: int32 [runs, pool], the ranking chosen after each prefill run.
        synthetic, meta, label: from the trace.
    """

    num_layers: int
    num_experts: int
    items: np.ndarray
    offsets: np.ndarray
    call_decode: np.ndarray
    placement_rank: np.ndarray
    run_ranks: np.ndarray
    meta: dict = field(default_factory=dict)
    label: str = ""
    _next: dict = field(default_factory=dict, repr=False)

    @property
    def pool(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def num_calls(self) -> int:
        return int(self.call_decode.shape[0])

    @property
    def synthetic(self) -> bool:
        return bool(self.meta.get("synthetic", False))

    def reads_per_call(self) -> np.ndarray:
        return np.diff(self.offsets)

    def next_use_keys(self, decode_only: bool) -> np.ndarray:
        """int64 [R]: Belady's eviction key of each read, for after that read (larger =
        evict first): the call index of the pair's next read (``C`` if none); with
        ``decode_only`` the next *decode* read comes first (``C`` when the next read is a
        prefill read or none), ties broken by the next read of any phase."""
        if decode_only in self._next:
            return self._next[decode_only]
        C, R = self.num_calls, self.items.shape[0]
        call_of = np.repeat(np.arange(C, dtype=np.int64), self.reads_per_call())
        order = np.lexsort((call_of, self.items))  # by pair, then time
        nxt = np.full(R, C, dtype=np.int64)
        same = self.items[order[1:]] == self.items[order[:-1]]
        nxt[order[:-1][same]] = call_of[order[1:][same]]
        if decode_only:
            dec_next = np.full(R, C, dtype=np.int64)
            has = nxt < C
            dec_next[has] = np.where(self.call_decode[nxt[has]], nxt[has], C)
            key = dec_next * (C + 1) + nxt
        else:
            key = nxt
        self._next[decode_only] = key
        return key


def build_calls(trace: RoutingTrace, max_entries: int = 1 << 23) -> CallTable:
    """De-duplicate a trace into layer calls (see CallTable). Memory is bounded by
    processing ``max_entries`` routed ids at a time."""
    L, E = trace.num_layers, trace.num_experts
    LE = L * E
    steps = trace.num_steps
    offs = trace.step_offsets
    lay = (np.arange(L, dtype=np.int64) * E)[None, :, None]
    items_parts, calls_parts = [], []
    s = 0
    per_tok = L * trace.top_k
    while s < steps:
        # a chunk of whole steps with at most max_entries ids (at least one step)
        end = int(np.searchsorted(offs, offs[s] + max(1, max_entries // per_tok), side="right")) - 1
        end = min(max(end, s + 1), steps)
        ids = trace.ids[offs[s] : offs[end]].astype(np.int64)
        step_of = np.repeat(np.arange(s, end, dtype=np.int64), trace.num_tokens[s:end])
        call = step_of[:, None, None] * L + np.arange(L, dtype=np.int64)[None, :, None]
        key = np.sort((call * LE + lay + ids).ravel())  # sort+mask: faster than np.unique
        key = key[np.concatenate([[True], key[1:] != key[:-1]])]
        calls_parts.append(key // LE)
        items_parts.append((key % LE).astype(np.int32))
        s = end
    C = steps * L
    calls = np.concatenate(calls_parts) if calls_parts else np.zeros(0, np.int64)
    items = np.concatenate(items_parts) if items_parts else np.zeros(0, np.int32)
    offsets = np.searchsorted(calls, np.arange(C + 1, dtype=np.int64)).astype(np.int64)
    call_decode = np.repeat(trace.phase == 1, L)

    # prefill-updated: one ranking per maximal run of prefill steps
    is_pre = trace.phase == 0
    start = is_pre & np.concatenate([[True], ~is_pre[:-1]]) if steps else is_pre
    runs_upto = np.cumsum(start)
    in_force = np.where(is_pre, runs_upto - 2, runs_upto - 1)  # -1: nothing placed
    run_of_step = np.where(is_pre, runs_upto - 1, -1)
    n_runs = int(runs_upto[-1]) if steps else 0
    run_ranks = np.empty((n_runs + 1, LE), dtype=np.int32)  # last row: "none placed"
    run_ranks[-1] = LE
    prev = np.arange(LE, dtype=np.int64)
    tok_run = np.repeat(run_of_step, trace.num_tokens)
    pre_rows = np.nonzero(tok_run >= 0)[0]
    if n_runs:
        bounds = np.searchsorted(tok_run[pre_rows], np.arange(n_runs + 1))
    for r in range(n_runs):
        rows = pre_rows[bounds[r] : bounds[r + 1]]  # contiguous token rows of the run
        flat = trace.ids[rows[0] : rows[-1] + 1].astype(np.int64) + lay
        counts = np.bincount(flat.ravel(), minlength=LE)
        order = np.lexsort((prev, -counts))
        rank = np.empty(LE, dtype=np.int64)
        rank[order] = np.arange(LE)
        run_ranks[r] = rank
        prev = rank
    call_force = np.repeat(in_force, L)
    placement_rank = run_ranks[np.repeat(call_force, np.diff(offsets)), items]
    label = os.path.basename(trace.path) if trace.path else str(trace.meta.get("model"))
    return CallTable(L, E, items, offsets, call_decode, placement_rank.astype(np.int32),
                     run_ranks[:-1], meta=dict(trace.meta), label=label)


def _iter_calls(calls: CallTable, extra: np.ndarray | None = None, chunk: int = 1 << 15):
    """Yield (call index, items list[, extra list]) per call, converting in chunks."""
    offs = calls.offsets
    C = calls.num_calls
    for c0 in range(0, C, chunk):
        c1 = min(C, c0 + chunk)
        a, b = int(offs[c0]), int(offs[c1])
        it = calls.items[a:b].tolist()
        ex = extra[a:b].tolist() if extra is not None else None
        o = (offs[c0 : c1 + 1] - a).tolist()
        for i in range(c1 - c0):
            if ex is None:
                yield c0 + i, it[o[i] : o[i + 1]]
            else:
                yield c0 + i, it[o[i] : o[i + 1]], ex[o[i] : o[i + 1]]


# --------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------


class LRUCache:
    """One LRU slot cache with ``freetoken_sglang.cache.residency`` semantics (module docstring).

    Args:
        num_slots: S >= 0.
        num_items: size of the item id space (flat pair ids).

    Attributes:
        owner: list [S], item held by each slot or -1 (comparable to ResidencyState.owner).
    """

    __slots__ = ("S", "slot_of", "owner", "order", "next_free", "clock", "last", "stamp")

    def __init__(self, num_slots: int, num_items: int):
        self.S = num_slots
        self.slot_of = [-1] * num_items
        self.owner = [-1] * num_slots
        self.order: OrderedDict = OrderedDict()  # occupied slots, least recent first
        self.next_free = 0  # slots >= next_free were never used
        self.clock = 0  # layer calls seen
        self.last = [0] * num_items  # last use of each item (0: never)
        self.stamp = [-1] * num_slots  # last use of each slot

    def call(self, items: list, admit: bool = False) -> tuple[int, int, int]:
        """One layer call reading ``items`` (distinct, ascending); with ``admit``, only the
        misses used since the least recently used slot's last use are filled. Returns
        (misses, fills, evictions)."""
        self.clock += 1
        slot_of, order, owner = self.slot_of, self.order, self.owner
        used = []
        misses = []
        for x in items:
            s = slot_of[x]
            if s >= 0:
                used.append(s)
                del order[s]  # re-inserted below with the new stamp
            else:
                misses.append(x)
        m = len(misses)
        if admit and misses:
            oldest = self.stamp[next(iter(order))] if self.next_free == self.S and order else -1
            misses = [x for x in misses if self.last[x] > oldest]
        for x in items:
            self.last[x] = self.clock
        ev = 0
        if misses:
            victims = []
            n = len(misses)  # the misses to fill
            nf = min(n, self.S - self.next_free)
            if nf > 0:
                victims = list(range(self.next_free, self.next_free + nf))
                self.next_free += nf
            need = min(n - nf, len(order))
            popitem = order.popitem
            for _ in range(need):
                victims.append(popitem(last=False)[0])
            for x, s in zip(misses, victims):
                old = owner[s]
                if old >= 0:
                    slot_of[old] = -1
                    ev += 1
                owner[s] = x
                slot_of[x] = s
            used += victims
            fills = len(victims)
        else:
            fills = 0
        used.sort()  # same stamp: lower slot is older
        for s in used:
            order[s] = None
            self.stamp[s] = self.clock
        return m, fills, ev

    def borrow(self, n: int, refill: list) -> int:
        """Lend the next ``n`` victims out as buffers and take them back holding the items of
        ``refill`` (ascending) not resident, most recent; leftovers come back empty, first
        victims. Returns evictions. Needs n <= S."""
        slot_of, order, owner = self.slot_of, self.order, self.owner
        nf = min(n, self.S - self.next_free)
        slots = list(range(self.next_free, self.next_free + nf))
        self.next_free += nf
        ev = 0
        for _ in range(n - nf):
            s = order.popitem(last=False)[0]
            slots.append(s)
            if owner[s] >= 0:
                slot_of[owner[s]] = -1
                owner[s] = -1
                ev += 1
        slots.sort()
        new = [x for x in refill if slot_of[x] < 0]
        for x, s in zip(new, slots):
            owner[s] = x
            slot_of[x] = s
            order[s] = None
        for s in reversed(slots[len(new) :]):
            order[s] = None
            order.move_to_end(s, last=False)
        return ev


def _sim_lru(calls: CallTable, capacity: int, per_layer: bool, stream: str | None = None,
             admit: bool = False):
    """global/per-layer LRU; ``stream`` "reserved" / "borrowed": the stream-* policies;
    ``admit``: the admission rule on decode calls (``global-lru-admit``)."""
    C, L, E = calls.num_calls, calls.num_layers, calls.num_experts
    if per_layer:
        caches = [LRUCache(capacity // L, calls.pool) for _ in range(L)]
    else:
        caches = [LRUCache(capacity - 2 * E * (stream == "reserved"), calls.pool)]
    nc = len(caches)
    mis, fil, evi = (np.zeros(C, dtype=np.int32) for _ in range(3))
    out_m, out_f, out_e = [], [], []
    dec = calls.call_decode.tolist()
    last2 = list(range(max(0, L - 2) * E, L * E))
    for c, items in _iter_calls(calls):
        if stream and not dec[c]:
            m = f = 0
            e = caches[0].borrow(2 * E, last2) if stream == "borrowed" and c % L == 0 else 0
        else:
            m, f, e = caches[c % nc].call(items, admit and dec[c])
        out_m.append(m)
        out_f.append(f)
        out_e.append(e)
    mis[:] = out_m
    fil[:] = out_f
    evi[:] = out_e
    return mis, fil, evi, caches


def _sim_belady(calls: CallTable, capacity: int, decode_only: bool):
    C, LE, S = calls.num_calls, calls.pool, capacity
    keys = calls.next_use_keys(decode_only)
    resident = bytearray(LE)
    cur = [0] * LE
    mark = [-1] * LE
    heap: list = []
    size = 0
    compact_at = 2 * (LE + S) + 1024
    out_m, out_f, out_e = [], [], []
    push, pop = heapq.heappush, heapq.heappop
    for c, items, kk in _iter_calls(calls, keys):
        hits = []
        miss = []
        for x, k in zip(items, kk):
            mark[x] = c
            if resident[x]:
                hits.append((x, k))
            else:
                miss.append((x, k))
        m = len(miss)
        ev = 0
        if m:
            need = m - (S - size)
            if need > 0:
                avail = size - len(hits)
                if need > avail:  # overflow: keep the misses needed soonest
                    miss.sort(key=lambda t: t[1])
                    del miss[S - len(hits) :]
                    need = avail
                while need > 0:
                    k, x = divmod(-pop(heap), LE)
                    if not resident[x] or cur[x] != k or mark[x] == c:
                        continue  # stale, or read by this call (re-pushed below)
                    resident[x] = 0
                    size -= 1
                    ev += 1
                    need -= 1
            for x, k in miss:
                resident[x] = 1
                cur[x] = k
                push(heap, -(k * LE + x))
            size += len(miss)
        for x, k in hits:
            cur[x] = k
            push(heap, -(k * LE + x))
        if len(heap) > compact_at:
            heap = [-(cur[x] * LE + x) for x in range(LE) if resident[x]]
            heapq.heapify(heap)
        out_m.append(m)
        out_f.append(len(miss) if m else 0)
        out_e.append(ev)
    return (np.asarray(out_m, np.int32).reshape(C), np.asarray(out_f, np.int32).reshape(C),
            np.asarray(out_e, np.int32).reshape(C))


def _misses_from_hitmask(calls: CallTable, hit: np.ndarray) -> np.ndarray:
    miss = (~hit).astype(np.int32)
    if calls.items.shape[0] == 0:
        return np.zeros(calls.num_calls, np.int32)
    return np.add.reduceat(miss, calls.offsets[:-1]).astype(np.int32)


def _static_frequent_rank(calls: CallTable) -> np.ndarray:
    dec = np.repeat(calls.call_decode, calls.reads_per_call())
    freq = np.bincount(calls.items[dec], minlength=calls.pool)
    order = np.lexsort((np.arange(calls.pool), -freq))
    rank = np.empty(calls.pool, dtype=np.int64)
    rank[order] = np.arange(calls.pool)
    return rank


@dataclass
class ReplayCounts:
    """Counts of one policy at one capacity on one trace.

    Attributes:
        policy, trace (label), capacity (slots), pool (L*E), synthetic.
        decode_reads, decode_misses, prefill_reads, prefill_misses: reads are de-duplicated
            per layer call.
        fills: experts copied into the cache (admitted misses; for placement policies the
            pairs newly placed, the initial placement included).
        evictions: resident experts replaced.
        per_layer: for admit-all policies, int64 [L] arrays "reads", "hits", "fills",
            "evictions" over both phases (the layout of the device counters); else None.
    """

    policy: str
    trace: str
    capacity: int
    pool: int
    synthetic: bool
    decode_reads: int
    decode_misses: int
    prefill_reads: int
    prefill_misses: int
    fills: int
    evictions: int
    per_layer: dict | None = None
    requested_pct: float | None = None  # the capacity % asked for (set by ``replay``)

    @property
    def capacity_pct(self) -> float:
        return 100.0 * self.capacity / self.pool

    @property
    def decode_miss_rate(self) -> float:
        return self.decode_misses / self.decode_reads if self.decode_reads else float("nan")

    @property
    def prefill_miss_rate(self) -> float:
        return self.prefill_misses / self.prefill_reads if self.prefill_reads else float("nan")

    def to_json(self) -> dict:
        def num(v):
            return None if isinstance(v, float) and math.isnan(v) else v

        return {
            "policy": self.policy, "trace": self.trace, "synthetic": self.synthetic,
            "capacity_slots": self.capacity, "capacity_pct": round(self.capacity_pct, 4),
            "requested_pct": self.requested_pct,
            "pool": self.pool,
            "decode_reads": self.decode_reads, "decode_misses": self.decode_misses,
            "decode_miss_rate": num(self.decode_miss_rate),
            "prefill_reads": self.prefill_reads, "prefill_misses": self.prefill_misses,
            "prefill_miss_rate": num(self.prefill_miss_rate),
            "fills": self.fills, "evictions": self.evictions,
        }


def run_policy(calls: CallTable, policy: str, capacity: int) -> ReplayCounts:
    """Replay one policy at ``capacity`` slots.

    Raises:
        ValueError for an unknown policy, a capacity outside [0, L*E], or one below a
        stream-* policy's minimum.
    """
    if policy not in ALL_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {', '.join(ALL_POLICIES)}")
    if int(capacity) != capacity or not 0 <= capacity <= calls.pool:
        raise ValueError(f"capacity must be an integer number of slots in [0, L*E={calls.pool}], "
                         f"got {capacity!r}")
    capacity = int(capacity)
    L, LE = calls.num_layers, calls.pool
    per_layer = None
    fills = evictions = 0
    if policy in ("global-lru", "per-layer-lru"):
        mis, fil, evi, _ = _sim_lru(calls, capacity, per_layer=policy == "per-layer-lru")
    elif policy == "global-lru-admit":
        mis, fil, evi, _ = _sim_lru(calls, capacity, per_layer=False, admit=True)
        fills, evictions = int(fil.sum()), int(evi.sum())
    elif policy in STREAM_POLICIES:
        need = 2 * calls.num_experts + calls.meta["top_k"] * (policy == "stream-reserved")
        if capacity < need:
            raise ValueError(f"{policy} needs capacity >= {need} slots (2E buffers"
                             + (" + top_k LRU slots" if policy == "stream-reserved" else "")
                             + f"), got {capacity}")
        mis, fil, evi, _ = _sim_lru(calls, capacity, False, stream=policy[len("stream-"):])
        fills, evictions = int(fil.sum()), int(evi.sum())
    elif policy in ("belady", "belady-total"):
        mis, fil, evi = _sim_belady(calls, capacity, decode_only=policy == "belady")
    elif policy == "static-frequent":
        placed = _static_frequent_rank(calls) < capacity
        mis = _misses_from_hitmask(calls, placed[calls.items])
        fills = capacity
    elif policy == "static-layers":
        n = capacity // calls.num_experts
        placed = np.arange(LE) // calls.num_experts >= L - n
        mis = _misses_from_hitmask(calls, placed[calls.items])
        fills = n * calls.num_experts
    else:  # prefill-updated
        mis = _misses_from_hitmask(calls, calls.placement_rank < capacity)
        prev = np.zeros(LE, dtype=bool)
        for rank in calls.run_ranks:
            now = rank < capacity
            fills += int((now & ~prev).sum())
            evictions += int((prev & ~now).sum())
            prev = now
    if policy in ADMIT_ALL:
        fills, evictions = int(fil.sum()), int(evi.sum())
        reads = calls.reads_per_call().reshape(-1, L).sum(0)
        per_layer = {
            "reads": reads.astype(np.int64),
            "hits": reads - mis.reshape(-1, L).sum(0).astype(np.int64),
            "fills": fil.reshape(-1, L).sum(0).astype(np.int64),
            "evictions": evi.reshape(-1, L).sum(0).astype(np.int64),
        }
    reads = calls.reads_per_call()
    dec = calls.call_decode
    return ReplayCounts(
        policy=policy, trace=calls.label, capacity=capacity, pool=LE, synthetic=calls.synthetic,
        decode_reads=int(reads[dec].sum()), decode_misses=int(mis[dec].sum()),
        prefill_reads=0 if policy in STREAM_POLICIES else int(reads[~dec].sum()),
        prefill_misses=int(mis[~dec].sum()),
        fills=fills, evictions=evictions, per_layer=per_layer,
    )


def capacity_slots(pct: float, pool: int) -> int:
    """Slots for ``pct`` percent of a pool of ``pool`` pairs (rounded half up).

    Raises ValueError outside [0, 100]."""
    if not 0 <= pct <= 100:
        raise ValueError(f"capacity percentages must lie in [0, 100], got {pct}")
    return int(math.floor(pct * pool / 100 + 0.5))


_SHARED: list = []  # CallTables, inherited by forked workers


def _job(args):
    i, policy, cap = args
    return i, run_policy(_SHARED[i], policy, cap)


def replay(tables: list, policies=POLICIES, capacities_pct=DEFAULT_CAPACITIES,
           jobs: int = 1) -> list:
    """Run every policy at every capacity on every CallTable.

    Args:
        tables: CallTables (``build_calls``).
        policies: policy names.
        capacities_pct: percentages of each trace's pool L*E.
        jobs: worker processes (fork) for the simulated policies; 1 = in process.

    Returns:
        list of ReplayCounts, ordered by table, policy, capacity.
    """
    for p in policies:
        if p not in ALL_POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {', '.join(ALL_POLICIES)}")
    pcts = list(capacities_pct)
    work = [(i, p, capacity_slots(pct, t.pool)) for i, t in enumerate(tables)
            for p in policies for pct in pcts]
    if jobs <= 1:
        res = [run_policy(tables[i], p, c) for i, p, c in work]
    else:
        import multiprocessing as mp

        _SHARED[:] = tables
        for t in tables:  # compute the shared next-use keys once, before forking
            if "belady" in policies:
                t.next_use_keys(True)
            if "belady-total" in policies:
                t.next_use_keys(False)
        slow = [w for w in work if w[1] in ADMIT_ALL + STREAM_POLICIES]
        out = {}
        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as ex:
            futs = {w: ex.submit(_job, w) for w in sorted(slow, key=lambda w: w[1] != "belady")}
            for w in work:
                if w not in futs:
                    out[w] = run_policy(tables[w[0]], w[1], w[2])
            for w, f in futs.items():
                out[w] = f.result()[1]
        _SHARED.clear()
        res = [out[w] for w in work]
    for r, pct in zip(res, pcts * (len(tables) * len(policies))):
        r.requested_pct = pct
    return res


# --------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------


def _summary(results: list, policies, capacities_pct, metric: str) -> dict:
    """{policy: [(pct, mean, min, max), ...]} of ``metric`` (a ReplayCounts attribute)."""
    out = {}
    for p in policies:
        rows = []
        for pct in capacities_pct:
            vals = [getattr(r, metric) for r in results
                    if r.policy == p and r.requested_pct == pct]
            vals = [v for v in vals if not math.isnan(v)]
            if vals:
                rows.append((pct, float(np.mean(vals)), float(np.min(vals)), float(np.max(vals))))
            else:
                rows.append((pct, float("nan"), float("nan"), float("nan")))
        out[p] = rows
    return out


def _tag(tables) -> str:
    n_syn = sum(t.synthetic for t in tables)
    if n_syn == len(tables):
        return "SYNTHETIC routing trace" + ("s" if len(tables) > 1 else "")
    if n_syn:
        return f"includes {n_syn} SYNTHETIC of {len(tables)} routing traces"
    return "recorded routing trace" + ("s" if len(tables) > 1 else "")


def _describe(tables) -> str:
    shapes = sorted({(t.meta.get("model"), t.num_layers, t.num_experts, t.meta.get("top_k"))
                     for t in tables}, key=str)
    return "; ".join(f"{m}: L={L} E={E} k={k}" for m, L, E, k in shapes)


def write_reports(tables, results, policies, capacities_pct, out_dir, name="replay",
                  plot=True) -> dict:
    """Write NAME.json, NAME.md and NAME.png under out_dir; returns {kind: path}."""
    os.makedirs(out_dir, exist_ok=True)
    synthetic = any(t.synthetic for t in tables)
    tag = _tag(tables)
    dec = _summary(results, policies, capacities_pct, "decode_miss_rate")
    pre = _summary(results, policies, capacities_pct, "prefill_miss_rate")
    paths = {}

    def tr_info(t):
        reads = t.reads_per_call()
        return {
            "label": t.label, "synthetic": t.synthetic, "meta": t.meta,
            "num_layers": t.num_layers, "num_experts": t.num_experts, "pool": t.pool,
            "layer_calls": t.num_calls, "decode_calls": int(t.call_decode.sum()),
            "decode_reads": int(reads[t.call_decode].sum()),
            "prefill_reads": int(reads[~t.call_decode].sum()),
            "prefill_runs": int(t.run_ranks.shape[0]),
        }

    doc = {
        "title": f"Decode expert miss rate vs GPU expert-cache capacity ({tag})",
        "synthetic": synthetic,
        "metric": "decode miss rate = misses of decode layer calls / reads of decode layer "
                  "calls; reads = distinct (layer, expert) pairs of each (step, layer) call",
        "capacities_pct": list(capacities_pct),
        "policies": {p: LABELS[p] for p in policies},
        "notes": ("static-frequent uses the whole trace's decode counts (oracle, best case "
                  "for static placement); belady is the admit-all lower bound."),
        "traces": [tr_info(t) for t in tables],
        "summary_decode_miss_rate": {
            p: [{"capacity_pct": c, "mean": _nn(a), "min": _nn(b), "max": _nn(d)}
                for c, a, b, d in rows] for p, rows in dec.items()},
        "summary_prefill_miss_rate": {
            p: [{"capacity_pct": c, "mean": _nn(a), "min": _nn(b), "max": _nn(d)}
                for c, a, b, d in rows] for p, rows in pre.items()},
        "results": [r.to_json() for r in results],
    }
    paths["json"] = os.path.join(out_dir, name + ".json")
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=1)

    multi = len(tables) > 1

    def cell(v, lo, hi):
        if math.isnan(v):
            return "n/a"
        return f"{100 * v:.1f}" + (f" ({100 * lo:.1f}–{100 * hi:.1f})" if multi else "")

    lines = [f"# Decode expert miss rate (%) vs cache capacity — {tag}", "",
             f"{len(tables)} trace(s): {_describe(tables)}. Capacity in % of the expert pool "
             f"(L*E). Reads are de-duplicated per (step, layer) call."
             + (" Cells: mean (min–max) over traces." if multi else ""),
             "static-frequent is an ORACLE (whole-trace decode counts); belady is the lower "
             "bound of admit-all policies.", ""]
    for title, summ in (("Decode miss rate (%)", dec), ("Prefill miss rate (%)", pre)):
        lines += [f"## {title} — {tag}", "",
                  "| capacity % | " + " | ".join(policies) + " |",
                  "|---:|" + "---:|" * len(policies)]
        for j, pct in enumerate(capacities_pct):
            lines.append(f"| {pct:g} | " + " | ".join(
                cell(*summ[p][j][1:]) for p in policies) + " |")
        lines.append("")
    paths["md"] = os.path.join(out_dir, name + ".md")
    with open(paths["md"], "w") as f:
        f.write("\n".join(lines))

    if plot:
        paths["png"] = os.path.join(out_dir, name + ".png")
        _plot(dec, policies, tables, tag, paths["png"])
    return paths


def _nn(v):
    return None if math.isnan(v) else v


STYLE = {
    "global-lru": dict(color="tab:red", lw=2.2, marker="o", ms=3),
    "per-layer-lru": dict(color="tab:orange", marker="s", ms=3),
    "static-frequent": dict(color="tab:blue", marker="^", ms=3),
    "prefill-updated": dict(color="tab:green", marker="v", ms=3),
    "belady": dict(color="black", ls="--"),
    "belady-total": dict(color="gray", ls=":"),
    "static-layers": dict(color="tab:purple", marker="d", ms=3),
    "stream-reserved": dict(color="tab:brown", marker="x", ms=4),
    "stream-borrowed": dict(color="tab:pink", marker="+", ms=5),
    "global-lru-admit": dict(color="tab:olive", marker="*", ms=5),
}


def _plot(dec, policies, tables, tag, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.2, 4.6), dpi=120)
    for p in policies:
        rows = np.array(dec[p], dtype=float)
        x, mean, lo, hi = rows.T * np.array([[1], [100], [100], [100]])
        ax.plot(x, mean, label=LABELS[p], **STYLE.get(p, {}))
        if len(tables) > 1:
            ax.fill_between(x, lo, hi, color=STYLE.get(p, {}).get("color"), alpha=0.15, lw=0)
    ax.set_xlabel("GPU expert-cache capacity (% of the expert pool L×E)")
    ax.set_ylabel("decode expert miss rate (%)")
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    band = ", lines: mean, bands: min–max" if len(tables) > 1 else ""
    sub = textwrap.fill(f"{len(tables)} trace(s), {_describe(tables)}{band}", 110)
    ax.set_title(f"Decode miss rate vs cache capacity — {tag}\n{sub}", fontsize=8)
    ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def _parse_capacities(text: str) -> tuple:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--capacities takes comma-separated percentages like 5,10,50, got {text!r}") from None
    if not vals or any(not 0 <= v <= 100 for v in vals):
        raise argparse.ArgumentTypeError(
            f"--capacities must be percentages in [0, 100], got {text!r}")
    return tuple(int(v) if v == int(v) else v for v in vals)


def _parse_policies(text: str) -> tuple:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [p for p in vals if p not in ALL_POLICIES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown policies {bad}; choose from {', '.join(ALL_POLICIES)}")
    return vals


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="*", help="routing-trace .npz files")
    ap.add_argument("--capacities", type=_parse_capacities, default=DEFAULT_CAPACITIES,
                    help="capacities in %% of the pool L*E (default 5,10,...,100)")
    ap.add_argument("--policies", type=_parse_policies, default=POLICIES,
                    help=f"comma-separated, default {','.join(POLICIES)}; extra: "
                         f"{','.join(EXTRA_POLICIES)}")
    ap.add_argument("--out-dir", required=True, help="directory for NAME.json/.md/.png")
    ap.add_argument("--name", default=None, help="output file stem (default replay or "
                                                 "replay_synthetic)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes for the simulated policies")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--synthetic", action="store_true",
                    help="generate synthetic traces (saved under --out-dir) instead of reading")
    ap.add_argument("--synthetic-traces", type=int, default=1,
                    help="how many synthetic traces (seeds --syn-seed, +1, ...)")
    synthetic_routing.add_args(ap, prefix="syn-")
    args = ap.parse_args(argv)

    if args.synthetic == bool(args.traces):
        ap.error("pass trace files, or --synthetic (not both)")
    os.makedirs(args.out_dir, exist_ok=True)
    t0 = time.time()
    traces = []
    if args.synthetic:
        base = synthetic_routing.params_from_args(args, prefix="syn-")
        for i in range(args.synthetic_traces):
            p = synthetic_routing.SyntheticParams(**{**base.__dict__, "seed": base.seed + i})
            path = os.path.join(args.out_dir, f"synthetic_trace_seed{p.seed}.npz")
            synthetic_routing.write(p, path)
            traces.append(RoutingTrace.load(path))
    else:
        for path in args.traces:
            traces.append(RoutingTrace.load(path))
    tables = [build_calls(t) for t in traces]
    t1 = time.time()
    results = replay(tables, args.policies, args.capacities, jobs=args.jobs)
    name = args.name or ("replay_synthetic" if any(t.synthetic for t in tables) else "replay")
    paths = write_reports(tables, results, args.policies, args.capacities, args.out_dir, name,
                          plot=not args.no_plot)
    print(open(paths["md"]).read())
    print(f"traces {t1 - t0:.1f}s, replay {time.time() - t1:.1f}s; wrote "
          + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
