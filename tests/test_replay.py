"""Routing-trace files and the expert-cache replay (benchmarks/replay.py): hand-computed miss
counts, Belady bounds, agreement with the device LRU (residency.decide), file round trip."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import sys

import numpy as np
import pytest

from freetoken_sglang.observe.routing_trace import RoutingTrace, RoutingTraceWriter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


R = _load("ft_bench_replay", "benchmarks/replay.py")
SYN = R.synthetic_routing


def make_trace(steps, num_experts, meta=None):
    """steps: list of (phase, nested list [T][L][k])."""
    phase = [0 if p == "prefill" else 1 for p, _ in steps]
    ntok = [len(ids) for _, ids in steps]
    ids = np.concatenate([np.asarray(ids) for _, ids in steps])
    return RoutingTrace(phase, ntok, ids, num_experts, meta=meta)


# Tiny trace 1: L=2, E=4, k=2. Flat pair id = l*4 + e. Layer calls (de-duplicated reads):
#  c0 P l0 {0,1,2}   c1 P l1 {4,5,6}
#  c2 D l0 {0,3}     c3 D l1 {5,7}
#  c4 D l0 {0,1}     c5 D l1 {5,6}
#  c6 D l0 {2,3}     c7 D l1 {5,7}
#  c8 D l0 {0,3}     c9 D l1 {4,5}
# decode reads 16, prefill reads 6.
TRACE1 = [
    ("prefill", [[[0, 1], [0, 1]], [[0, 2], [1, 2]]]),
    ("decode", [[[0, 3], [1, 3]]]),
    ("decode", [[[0, 1], [1, 2]]]),
    ("decode", [[[3, 2], [3, 1]]]),
    ("decode", [[[0, 3], [0, 1]]]),
]

# Hand-computed at capacity 4 (50 % of the pool of 8): (decode misses, prefill misses).
#
# global-lru (slots s0..s3; victims: never-used slots first, then oldest stamp, lowest slot):
#  c0: 0,1,2 miss -> s0,s1,s2.  c1: 4,5,6 miss -> s3 (free), s0 (evict 0), s1 (evict 1).
#  c2: 0,3 miss -> s2 (evict 2, stamp 1), s0 (evict 5).          decode misses 2
#  c3: 5,7 miss -> s1 (evict 6), s3 (evict 4).                     2
#  c4: 0 hit; 1 miss -> s0 (evict 3).                              1
#  c5: 5 hit; 6 miss -> s3 (evict 7).                              1
#  c6: 2,3 miss -> s0 (evict 1), s2 (evict 0).                     2
#  c7: 5 hit; 7 miss -> s3 (evict 6).                              1
#  c8: 3 hit; 0 miss -> s0 (evict 2).                              1
#  c9: 5 hit; 4 miss -> s3 (evict 7).                              1   -> 11 decode, 6 prefill
#  fills 6 + 11 = 17, evictions 17 - 4 = 13.
#
# per-layer-lru (2 slots per layer; a call reading 3 experts admits the first 2):
#  l0: c0 0,1 in, 2 bypassed | c2 0 hit, 3 -> evict 1 | c4 0 hit, 1 -> evict 3 |
#      c6 2,3 miss (evict 0, 1) | c8 3 hit, 0 -> evict 2          decode 1+1+2+1 = 5
#  l1: c1 4,5 in, 6 bypassed | c3 5 hit, 7 -> evict 4 | c5 5 hit, 6 -> evict 7 |
#      c7 5 hit, 7 -> evict 6 | c9 5 hit, 4 -> evict 7            decode 1+1+1+1 = 4
#  -> 9 decode, 6 prefill; fills 7 + 6 = 13, evictions 5 + 4 = 9.
#
# static-frequent: decode read counts 5:4, 0:3, 3:3, 7:2, 1/2/4/6:1 -> places {5, 0, 3, 7}:
#  decode misses 16 - (4+3+3+2) = 4; prefill reads {0,1,2,4,5,6} hit 0 and 5 -> 4 misses.
#
# prefill-updated: nothing placed during the prefill (6 misses); prefill token counts
#  0:2, 5:2, 1:1, 2:1, 4:1, 6:1, 3:0, 7:0 -> places {0, 5, 1, 2};
#  decode misses: c2 3, c3 7, c5 6, c6 3, c7 7, c8 3, c9 4 -> 7.
#
# belady (evict the furthest next decode read; the call's own experts are protected):
#  c0: load 0 (next c2), 1 (c4), 2 (c6).  c1: evict 2 (c6) and 1 (c4); load 4 (c9), 5 (c3), 6 (c5)
#  c2: 0 hit; 3 miss, evict 4 (c9)                                     1
#  c3: 5 hit; 7 miss, evict 3 (c6)                                     1
#  c4: 0 hit; 1 miss, evict 7 (c7)                                     1
#  c5: 5, 6 hit                                                        0
#  c6: 2, 3 miss, evict 1 and 6 (never read again)                     2
#  c7: 5 hit; 7 miss, evict 2 (never again)                            1
#  c8: 0, 3 hit                                                        0
#  c9: 5 hit; 4 miss                                                   1  -> 7 decode, 6 prefill
EXPECT1_CAP4 = {
    "global-lru": (11, 6),
    "per-layer-lru": (9, 6),
    "static-frequent": (4, 4),
    "prefill-updated": (7, 6),
    "belady": (7, 6),
    "belady-total": (7, 6),
}
# At 100 % (8 slots): admit-all policies miss only first touches: 3 and 7 in decode, the
# six prefill pairs in prefill. Static placement holds everything; prefill-updated holds
# everything after the prefill.
EXPECT1_CAP8 = {
    "global-lru": (2, 6),
    "per-layer-lru": (2, 6),
    "static-frequent": (0, 0),
    "prefill-updated": (0, 6),
    "belady": (2, 6),
    "belady-total": (2, 6),
}


@pytest.mark.parametrize("cap,expect", [(4, EXPECT1_CAP4), (8, EXPECT1_CAP8)])
def test_tiny_trace_hand_counts(cap, expect):
    calls = R.build_calls(make_trace(TRACE1, 4))
    assert calls.num_calls == 10
    assert calls.items[calls.offsets[0] : calls.offsets[1]].tolist() == [0, 1, 2]
    for policy, (dec, pre) in expect.items():
        r = R.run_policy(calls, policy, cap)
        assert (r.decode_reads, r.prefill_reads) == (16, 6), policy
        assert (r.decode_misses, r.prefill_misses) == (dec, pre), policy
    g = R.run_policy(calls, "global-lru", cap)
    p = R.run_policy(calls, "per-layer-lru", cap)
    if cap == 4:
        assert (g.fills, g.evictions) == (17, 13)
        assert (p.fills, p.evictions) == (13, 9)
        assert g.decode_miss_rate == pytest.approx(11 / 16)
        assert g.per_layer["reads"].tolist() == [11, 11]
    else:
        assert (g.fills, g.evictions) == (8, 0)


# Tiny trace 2 (L=1, E=4, k=1): chunked prefill, two prefills, ties kept by prior placement.
TRACE2 = [
    ("prefill", [[[0]], [[1]], [[0]]]),
    ("prefill", [[[0]], [[2]]]),  # same prefill run: counts 0:3, 1:1, 2:1, 3:0
    ("decode", [[[1]]]),
    ("decode", [[[3]]]),
    ("prefill", [[[3]], [[3]], [[2]]]),  # counts 3:2, 2:1, 0:0, 1:0
    ("decode", [[[3]]]),
    ("decode", [[[0]]]),
]


def test_prefill_updated_runs_and_ties():
    calls = R.build_calls(make_trace(TRACE2, 4))
    # C=2: {0,1} after the first run (1 beats 2 on the id tie), {3,2} after the second.
    # decode: [1] hit, [3] miss, [3] hit, [0] miss; prefill: nothing placed for the first run
    # (reads {0,1} and {0,2}: 4 misses), second run {2,3} against {0,1}: 2 misses.
    r = R.run_policy(calls, "prefill-updated", 2)
    assert (r.decode_misses, r.decode_reads, r.prefill_misses, r.prefill_reads) == (2, 4, 6, 6)
    assert (r.fills, r.evictions) == (4, 2)
    # C=3: {0,1,2}, then counts 3:2, 2:1 and the 0/1 tie keeps the prior order -> {3,2,0}.
    # decode: [1] hit, [3] miss, [3] hit, [0] hit; prefill: 4 + (3 misses of {2,3} -> 1).
    r = R.run_policy(calls, "prefill-updated", 3)
    assert (r.decode_misses, r.prefill_misses) == (1, 5)
    assert (r.fills, r.evictions) == (4, 1)
    # global-lru at C=2: c0 {0,1} 2 miss; c1 0 hit, 2 miss (evict 1); c2 1 miss (evict 0,
    # tie on stamp, lower slot); c3 3 miss (evict 2); c4 3 hit, 2 miss (evict 1); c5 hit;
    # c6 0 miss (evict 2) -> decode 3, prefill 4.
    r = R.run_policy(calls, "global-lru", 2)
    assert (r.decode_misses, r.prefill_misses) == (3, 4)


def _opt_admit_all(calls, S, decode_only):
    """Exhaustive optimum over every admit-all eviction choice (tiny pools only)."""
    best = {frozenset(): 0}
    for c in range(calls.num_calls):
        U = frozenset(calls.items[calls.offsets[c] : calls.offsets[c + 1]].tolist())
        w = 1 if (calls.call_decode[c] or not decode_only) else 0
        nxt = {}
        for res, cost in best.items():
            cost += w * len(U - res)
            keep_from = sorted(res - U)
            room = S - len(U)
            for kept in itertools.combinations(keep_from, min(room, len(keep_from))):
                st = U | frozenset(kept)
                if cost < nxt.get(st, 1 << 30):
                    nxt[st] = cost
        best = nxt
    return min(best.values())


@pytest.mark.parametrize("seed", range(4))
def test_belady_matches_exhaustive_optimum(seed):
    p = SYN.SyntheticParams(num_layers=2, num_experts=4, top_k=2, sessions=1, turns=2,
                            prefill_len=(1, 3), decode_len=(3, 5), zipf=0.5, reuse=0.5,
                            window=2, seed=seed)
    calls = R.build_calls(SYN.generate(p))
    for S in (4, 5, 6):
        bel = R.run_policy(calls, "belady", S)
        tot = R.run_policy(calls, "belady-total", S)
        assert bel.decode_misses == _opt_admit_all(calls, S, decode_only=True)
        assert tot.decode_misses + tot.prefill_misses == _opt_admit_all(calls, S, False)


RANDOM = [  # the first has short prompts, so per-layer LRU admits everything from 25 %
    dict(num_layers=4, num_experts=16, top_k=2, sessions=2, turns=3, prefill_len=(1, 2),
         decode_len=(40, 80), seed=1),
    dict(num_layers=4, num_experts=16, top_k=2, sessions=2, turns=2, prefill_len=(8, 40),
         decode_len=(40, 80), seed=4),
    dict(num_layers=3, num_experts=12, top_k=3, sessions=2, turns=3, prefill_len=(2, 30),
         decode_len=(20, 60), prefill_chunk=8, zipf=0.6, reuse=0.8, window=3, seed=2),
    dict(num_layers=6, num_experts=8, top_k=1, sessions=1, turns=2, prefill_len=(1, 12),
         decode_len=(60, 90), zipf=1.2, reuse=0.3, window=6, seed=3),
]


@pytest.mark.parametrize("kw", RANDOM)
def test_random_traces_bounds_and_full_capacity(kw):
    trace = SYN.generate(SYN.SyntheticParams(**kw))
    calls = R.build_calls(trace)
    policies = [p for p in R.ALL_POLICIES if p not in R.STREAM_POLICIES]  # need >= 2E slots
    results = R.replay([calls], policies, R.DEFAULT_CAPACITIES)
    by = {(r.policy, r.requested_pct): r for r in results}
    max_reads = int(calls.reads_per_call().max())
    checked = 0
    for pct in R.DEFAULT_CAPACITIES:
        bel, tot = by["belady", pct], by["belady-total", pct]
        # The bound holds against policies that admit every miss. per-layer LRU cannot when
        # a call reads more experts than its share capacity // L: it serves the excess
        # without admission (a bypass, which Belady-admit-all is not allowed).
        admit_all = ["global-lru", "belady-total", "belady"]
        if bel.capacity // calls.num_layers >= max_reads:
            admit_all.append("per-layer-lru")
            checked += 1
        for p in admit_all:
            assert bel.decode_misses <= by[p, pct].decode_misses, (p, pct)
        for p in admit_all:
            other = by[p, pct]
            assert (tot.decode_misses + tot.prefill_misses
                    <= other.decode_misses + other.prefill_misses), (p, pct)
        for p in policies:
            r = by[p, pct]
            assert r.decode_reads == int(calls.reads_per_call()[calls.call_decode].sum())
            assert 0 <= r.decode_misses <= r.decode_reads

    if kw["prefill_len"][1] <= 2:
        assert checked == 16  # per-layer LRU compared from 25 % up

    # first touches: pairs whose first read is a decode / a prefill read
    first_call = {}
    for c in range(calls.num_calls):
        for x in calls.items[calls.offsets[c] : calls.offsets[c + 1]].tolist():
            first_call.setdefault(x, c)
    dec_first = sum(bool(calls.call_decode[c]) for c in first_call.values())
    pre_first = len(first_call) - dec_first
    for p in ("global-lru", "per-layer-lru", "belady", "belady-total"):
        r = by[p, 100]
        assert (r.decode_misses, r.prefill_misses) == (dec_first, pre_first), p
        assert r.evictions == 0 and r.fills == len(first_call), p
    assert by["static-frequent", 100].decode_misses == 0
    assert by["static-frequent", 100].prefill_misses == 0
    assert by["static-layers", 100].decode_misses == 0
    assert by["prefill-updated", 100].decode_misses == 0  # traces start with a prefill
    # misses never grow with capacity for the stack-like placements
    for p in ("static-frequent", "belady-total"):
        m = [by[p, pct].decode_misses + (p == "belady-total") * by[p, pct].prefill_misses
             for pct in R.DEFAULT_CAPACITIES]
        assert m == sorted(m, reverse=True), p


# Tiny trace 3 (L=4, E=2, k=1; pair l*2 + e; 2E = 4; last two layers = pairs 4..7):
#  D1 {0,2,4,6}   D2 {1,2,4,7}   P (all 8 pairs)   D3 {0,3,4,6}   D4 {1,2,4,7}
def _d(*experts):
    return ("decode", [[[e] for e in experts]])


TRACE3 = [_d(0, 0, 0, 0), _d(1, 0, 0, 1), ("prefill", [[[0], [1], [0], [1]], [[1], [0], [1], [0]]]),
          _d(0, 1, 0, 0), _d(1, 0, 0, 1)]


def test_stream_reserved_is_lru_without_prefill():
    calls = R.build_calls(make_trace(TRACE3, 2))
    no_pre = R.build_calls(make_trace(TRACE3[:2] + TRACE3[3:], 2))
    # reserved at 8 = an LRU of 8 - 2E = 4 slots that never sees the prefill:
    #  0,2,4,6 miss | 1 (evict 0), 2 hit, 4 hit, 7 (evict 6) | 0 (evict 1), 3 (evict 2), 4 hit,
    #  6 (evict 7) | 1 (evict 0), 2 (evict 3), 4 hit, 7 (evict 6) -> 12 misses, 8 evictions.
    for cap, lru in ((8, 4), (6, 2)):
        r = R.run_policy(calls, "stream-reserved", cap)
        m, _, _, _ = R._sim_lru(calls, cap, False, stream="reserved")
        ref, _, _, _ = R._sim_lru(no_pre, lru, False)
        assert m[calls.call_decode].tolist() == ref.tolist()  # every decode call, unchanged
        assert (r.prefill_reads, r.prefill_misses) == (0, 0) and np.isnan(r.prefill_miss_rate)
        assert r.decode_reads == 16
    r = R.run_policy(calls, "stream-reserved", 8)
    assert (r.decode_misses, r.fills, r.evictions) == (12, 12, 8)
    assert R.run_policy(calls, "stream-reserved", 6).decode_misses == 16  # 2 slots: all miss
    assert R.run_policy(calls, "stream-reserved", 5).decode_misses == 16
    with pytest.raises(ValueError, match=r"stream-reserved needs capacity >= 5"):
        R.run_policy(calls, "stream-reserved", 4)
    # today's path at 6 (prefill through the LRU): decode 4 + 2 + 1 + 3 = 10, prefill 4.
    g = R.run_policy(calls, "global-lru", 6)
    assert (g.decode_misses, g.prefill_misses, g.prefill_reads) == (10, 4, 8)


def test_stream_borrowed_evicts_tail_and_keeps_last_layers():
    calls = R.build_calls(make_trace(TRACE3, 2))
    # At 6 slots: D1 -> s0..s3 = 0,2,4,6; D2: 1 -> s4, 2 and 4 hit, 7 -> s5. LRU order
    # s0(0) s3(6) s4(1) s1(2) s2(4) s5(7). The prefill borrows the 4 oldest (0, 6, 1, 2 evicted)
    # and returns pairs 5, 6 (4 and 7 stay resident) to s0, s1; s3, s4 come back empty.
    upto_p = R.build_calls(make_trace(TRACE3[:3], 2))
    _, _, e, caches = R._sim_lru(upto_p, 6, False, stream="borrowed")
    assert caches[0].owner == [5, 6, 4, -1, -1, 7]
    assert list(caches[0].order) == [3, 4, 2, 5, 0, 1]
    assert e.tolist() == [0] * 8 + [4, 0, 0, 0]
    # D3: 0 -> s3, 3 -> s4 (empty, no eviction), 4 and 6 hit; D4: 1 (evict 7), 2 (evict 5),
    # 4 hit, 7 (evict 0) -> decode 4 + 2 + 2 + 3 = 11, evictions 4 + 3.
    r = R.run_policy(calls, "stream-borrowed", 6)
    assert (r.decode_misses, r.decode_reads, r.prefill_reads, r.prefill_misses) == (11, 16, 0, 0)
    assert (r.fills, r.evictions) == (11, 7)
    # At 8: the prefill takes the 2 never-used slots and evicts 0 and 6; 6 comes back (layer 3),
    # 0 and 3 then fill the 2 empty slots -> decode 4 + 2 + 2 + 0 = 8.
    r = R.run_policy(calls, "stream-borrowed", 8)
    assert (r.decode_misses, r.evictions) == (8, 2)
    # At 4: the prefill evicts all 4 and returns 4, 5, 6, 7 -> decode 4 + 2 + 4 + 3 = 13.
    assert R.run_policy(calls, "stream-borrowed", 4).decode_misses == 13
    with pytest.raises(ValueError, match=r"stream-borrowed needs capacity >= 4"):
        R.run_policy(calls, "stream-borrowed", 3)


@pytest.mark.parametrize("S", [8, 13, 24])
def test_global_lru_equals_device_decide(S):
    torch = pytest.importorskip("torch")
    from freetoken_sglang.cache.residency import ResidencyState, decide

    p = SYN.SyntheticParams(num_layers=3, num_experts=8, top_k=2, sessions=2, turns=2,
                            prefill_len=(3, 12), decode_len=(15, 30), prefill_chunk=5,
                            zipf=0.7, reuse=0.5, window=3, seed=7)
    trace = SYN.generate(p)
    L, E = trace.num_layers, trace.num_experts
    state = ResidencyState(L * E, S, "cpu")
    counters = torch.zeros(5, L, dtype=torch.int64)
    for _, ids in trace:
        num_valid = torch.tensor([ids.shape[0]], dtype=torch.int32)
        for l in range(L):
            layer_ids = torch.from_numpy(ids[:, l, :].astype(np.int64))
            decide(state, counters, l, E, layer_ids,
                   torch.ones(layer_ids.shape, dtype=torch.float32), num_valid)
    calls = R.build_calls(trace)
    r = R.run_policy(calls, "global-lru", S)
    dev = counters.numpy()
    assert r.per_layer["reads"].tolist() == dev[0].tolist()
    assert r.per_layer["hits"].tolist() == dev[1].tolist()
    assert r.per_layer["fills"].tolist() == dev[2].tolist()
    assert r.per_layer["evictions"].tolist() == dev[3].tolist()
    assert r.decode_misses + r.prefill_misses == int(dev[2].sum())
    _, _, _, caches = R._sim_lru(calls, S, per_layer=False)
    assert caches[0].owner == state.owner[:S].tolist()


def test_trace_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    L, E, k = 3, 10, 2
    steps = [("prefill", rng.integers(0, E, (5, L, k))), ("decode", rng.integers(0, E, (1, L, k))),
             ("decode", rng.integers(0, E, (2, L, k)))]
    path = tmp_path / "t.npz"
    with RoutingTraceWriter(path, L, E, k, meta={"model": "m/x", "synthetic": True,
                                                   "note": {"a": 1}}) as w:
        for ph, ids in steps:
            w.add_step(ph, ids)
    t = RoutingTrace.load(path)
    assert (t.num_layers, t.num_experts, t.top_k, t.num_steps) == (L, E, k, 3)
    assert t.ids.dtype == np.int16 and t.phase.dtype == np.uint8
    assert t.num_tokens.tolist() == [5, 1, 2]
    assert t.meta["model"] == "m/x" and t.synthetic and t.meta["note"] == {"a": 1}
    assert t.meta["format"] == "freetoken-routing-trace" and t.meta["version"] == 1
    got = list(t)
    assert [g[0] for g in got] == ["prefill", "decode", "decode"]
    for (ph, ids), (ph2, ids2) in zip(steps, got):
        assert np.array_equal(ids, ids2)
    with np.load(path) as z:  # plain numpy, no pickle
        assert json.loads(str(z["meta"]))["num_experts"] == E
    # big E -> int32 ids
    p2 = tmp_path / "big.npz"
    with RoutingTraceWriter(p2, 1, 40000, 2) as w:
        w.add_step("decode", np.array([[[39999, 5]]]))
    t2 = RoutingTrace.load(p2)
    assert t2.ids.dtype == np.int32 and t2.ids[0, 0].tolist() == [39999, 5]
    assert t2.meta["model"] is None and not t2.synthetic


def test_trace_errors(tmp_path):
    w = RoutingTraceWriter(tmp_path / "e.npz", 2, 4, 2)
    with pytest.raises(ValueError, match="phase"):
        w.add_step("extend", np.zeros((1, 2, 2), int))
    with pytest.raises(ValueError, match="shape"):
        w.add_step("decode", np.zeros((1, 3, 2), int))
    with pytest.raises(ValueError, match=r"\[0, E=4\)"):
        w.add_step("decode", np.full((1, 2, 2), 4))
    with pytest.raises(ValueError, match=r"\[0, E=4\)"):
        w.add_step("decode", np.full((1, 2, 2), -1))
    with pytest.raises(TypeError, match="integer"):
        w.add_step("decode", np.zeros((1, 2, 2), float))
    with pytest.raises(ValueError, match="T >= 1"):
        w.add_step("decode", np.zeros((0, 2, 2), int))
    with pytest.raises(ValueError, match="set by the writer"):
        RoutingTraceWriter(tmp_path / "x.npz", 2, 4, 2, meta={"top_k": 3})
    with pytest.raises(ValueError, match="top_k"):
        RoutingTraceWriter(tmp_path / "x.npz", 2, 4, 5)
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(ValueError, match="not a routing trace"):
        RoutingTrace.load(tmp_path / "other.npz")
    w.close()
    with pytest.raises(RuntimeError, match="after close"):
        w.add_step("decode", np.zeros((1, 2, 2), int))


def test_replay_errors():
    calls = R.build_calls(make_trace(TRACE1, 4))
    with pytest.raises(ValueError, match="unknown policy"):
        R.run_policy(calls, "lfu", 4)
    with pytest.raises(ValueError, match=r"\[0, L\*E=8\]"):
        R.run_policy(calls, "global-lru", 9)
    with pytest.raises(ValueError, match="percentages"):
        R.capacity_slots(120, 8)
    assert R.capacity_slots(37, 6144) == 2273
    plain = [p for p in R.ALL_POLICIES if p not in R.STREAM_POLICIES]
    assert [R.run_policy(calls, p, 0).decode_misses for p in plain] == [16] * len(plain)


def test_cli_synthetic_outputs_labelled(tmp_path):
    out = tmp_path / "out"
    rc = R.main(["--synthetic", "--synthetic-traces", "2", "--out-dir", str(out),
                 "--capacities", "10,50,100", "--jobs", "1",
                 "--syn-layers", "3", "--syn-experts", "8", "--syn-top-k", "2",
                 "--syn-sessions", "1", "--syn-turns", "2", "--syn-prefill-len", "4,8",
                 "--syn-decode-len", "10"])
    assert rc == 0
    doc = json.loads((out / "replay_synthetic.json").read_text())
    assert doc["synthetic"] is True and "SYNTHETIC" in doc["title"]
    assert all(t["meta"]["synthetic"] for t in doc["traces"])
    assert doc["traces"][1]["meta"]["generator"]["seed"] == 1
    assert len(doc["results"]) == 2 * len(R.POLICIES) * 3
    s = doc["summary_decode_miss_rate"]["static-frequent"]
    assert s[-1] == {"capacity_pct": 100, "mean": 0.0, "min": 0.0, "max": 0.0}
    md = (out / "replay_synthetic.md").read_text()
    assert md.startswith("# Decode expert miss rate") and "SYNTHETIC" in md.splitlines()[0]
    assert (out / "replay_synthetic.png").stat().st_size > 10_000
    assert (out / "synthetic_trace_seed0.npz").exists()
    with pytest.raises(SystemExit):
        R.main(["--out-dir", str(out)])  # neither traces nor --synthetic


def test_synthetic_generator_semantics():
    base = dict(num_layers=3, num_experts=10, top_k=3, sessions=2, turns=2,
                prefill_len=(4, 9), decode_len=(6, 12), prefill_chunk=3, seed=11)
    a = SYN.generate(SYN.SyntheticParams(**base))
    b = SYN.generate(SYN.SyntheticParams(**base))
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.phase, b.phase)  # seeded
    assert a.synthetic and a.meta["generator"]["seed"] == 11
    assert a.meta["generator"]["prefill_len"] == [4, 9]
    s = np.sort(a.ids.astype(int), axis=2)
    assert (s[:, :, 1:] != s[:, :, :-1]).all()  # k distinct experts per token and layer
    assert a.num_tokens[a.phase == 0].max() <= 3 and (a.num_tokens[a.phase == 1] == 1).all()

    def decode_pairs(t):  # (previous token, token) pairs of consecutive decode steps
        out = []
        for s in range(1, t.num_steps):
            if t.phase[s] == 1:
                out.append((t.ids[t.step_offsets[s] - 1], t.step(s)[1][0]))
        return out

    # reuse=1, window=1: every decode token re-picks exactly the previous token's experts
    t = SYN.generate(SYN.SyntheticParams(**{**base, "reuse": 1.0, "window": 1}))
    for prev, cur in decode_pairs(t):
        assert np.array_equal(np.sort(prev, axis=1), np.sort(cur, axis=1))
    # reuse=0, window=1: never one of the previous token's experts
    t = SYN.generate(SYN.SyntheticParams(**{**base, "reuse": 0.0, "window": 1}))
    for prev, cur in decode_pairs(t):
        for l in range(3):
            assert not set(prev[l].tolist()) & set(cur[l].tolist())
    with pytest.raises(ValueError, match="top_k"):
        SYN.generate(SYN.SyntheticParams(num_experts=2, top_k=3))


def test_admission_policy_is_the_servers_rule():
    """``global-lru-admit``'s cache makes the same choices as the server's decision with the
    admission rule (``decide_reference``, every fillable miss filled) on random decode calls:
    the same misses, fills and evictions per call, and the same residents."""
    import random

    import torch

    from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide_reference

    rng = random.Random(7)
    L, E, k, S = 3, 8, 2, 7
    cache = R.LRUCache(S, L * E)
    state = ResidencyState(L * E, S, "cpu")
    counters = torch.zeros(5, L, dtype=torch.int64)
    split = MissSplit(1.0, 0, admit_reuse=True)
    one = torch.tensor([1], dtype=torch.int32)
    for step in range(200):
        layer = step % L
        hot = [(layer * 3 + j) % E for j in range(3)]
        ids = rng.sample(hot if rng.random() < 0.5 else range(E), k)
        before = counters[:, layer].clone()
        decide_reference(state, counters, layer, E, torch.tensor([ids], dtype=torch.int32),
                         torch.ones(1, k), one, split)
        d = (counters[:, layer] - before).tolist()  # reads, hits, fills, evictions, cpu
        m, f, e = cache.call(sorted(layer * E + x for x in ids), admit=True)
        assert (m, f, e) == (d[0] - d[1], d[2], d[3]), step
        resident = {x for x in cache.owner if x >= 0}
        assert resident == {x for x in state.owner[:S].tolist() if x >= 0}
