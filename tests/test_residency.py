"""The GPU expert cache's residency bookkeeping (``freetoken_sglang.cache.residency.decide``) against
a plain-Python LRU model, over random routing sequences and every miss split, plus its
invariants."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from conftest import needs_interpreter
from freetoken_sglang.cache.residency import (
    FILL_ALL,
    MissSplit,
    ResidencyState,
    decide,
    reuse_need,
    max_unique_experts,
    used_experts,
)

# The last split has the lone-miss rule's cost check (fill 200 us, CPU 100 us per expert,
# fixed 10 / 500 us): 2 or 3 misses are all filled, 4 keep 3 on the CPU.
COSTED = MissSplit(0.25, 1, 200.0, 100.0, 10.0, 500.0)
# The admission rule: only misses used since the least recently used slot's last use fill.
ADMIT = MissSplit(0.6, 1, admit_reuse=True)
# The useful admission: every miss admitted while the least recently used slot was hit since
# its last fill, only the reused ones otherwise.
USEFUL = MissSplit(0.6, 1, admit_reuse=True, admit_useful=True)
# The re-miss rule (every miss used since that slot's last use fills, counted in q*; the other
# misses fill what is left of q*), alone, with the cost check, and with admission.
REFILL = MissSplit(0.25, 1, fill_reused=True)
# The return rule (fill 200 us, CPU 100 us per expert, fixed 10 / 50 us): 4 misses with one
# fill keep 3 on the CPU while the return rate r < 0.767; alone and with the re-miss rule.
RETURN = MissSplit(0.25, 1, 200.0, 100.0, 10.0, 50.0, return_rule=True)
# The late fill (q* without the at-least-one fill; a call q* fills none of fills them after
# the call): alone, with the cost check (fixed 10 / 50 us: a lone miss stays on the CPU), with
# admission and with the re-miss rule.
LATE = MissSplit(0.25, 0, late_fill=True)
SPLITS = [FILL_ALL, MissSplit(0.6, 1), MissSplit(0.25, 1), MissSplit(0.0, 0), COSTED, ADMIT,
          REFILL, MissSplit(0.25, 1, 200.0, 100.0, 10.0, 500.0, fill_reused=True),
          MissSplit(0.6, 1, admit_reuse=True, fill_reused=True), RETURN,
          MissSplit(0.6, 1, 200.0, 100.0, 10.0, 50.0, fill_reused=True, return_rule=True),
          LATE, MissSplit(0.25, 0, 200.0, 100.0, 10.0, 50.0, late_fill=True),
          MissSplit(0.25, 0, fill_reused=True, late_fill=True),
          MissSplit(0.25, 0, admit_reuse=True, late_fill=True),
          # every CPU run filled late (all), alone and with admission (the reused ones)
          MissSplit(0.25, 0, late_fill=True, late_all=True),
          MissSplit(0.6, 0, admit_reuse=True, late_fill=True, late_all=True),
          # the useful admission: alone, with the re-miss rule, and with the late fill (all)
          USEFUL, MissSplit(0.6, 1, admit_reuse=True, fill_reused=True, admit_useful=True),
          MissSplit(0.6, 0, admit_reuse=True, late_fill=True, late_all=True, admit_useful=True),
          # the valued re-miss rule (B_H/B_P - 1 = 7/3 and 3/2 later uses; at B_P/B_H >= 1/2
          # it would be the plain rule): alone and with the useful admission
          MissSplit(0.3, 1, fill_reused=True, fill_reused_valued=True),
          MissSplit(0.4, 1, admit_reuse=True, fill_reused=True, admit_useful=True,
                    fill_reused_valued=True)]


class ReferenceLRU:
    """One LRU over S slots shared by all layers, with the q* split of the misses, written
    for clarity, not speed."""

    def __init__(self, num_layers, num_experts, num_slots):
        self.E, self.S = num_experts, num_slots
        self.owner = [-1] * num_slots
        self.stamp = [-1] * num_slots
        self.slot_of = {}
        self.clock = 0
        self.last_use = [0] * (num_layers * num_experts)
        self.counts = [[0] * num_layers for _ in range(5)]
        self.forced = 0  # fills made by the re-miss rule while every slot is in use
        # the return rule: missed at the last use; decayed returns and misses (fp32)
        self.missed = [False] * (num_layers * num_experts)
        self.returns = np.zeros(2, dtype=np.float32)
        self.overruled = 0  # calls where the return rule filled the CPU experts
        self.late = 0  # late fills (the late fill)
        self.filled_at = [-2] * num_slots  # the clock of each slot's last fill
        self.useful = [0, 0]  # calls with misses where the LRU slot was / was not hit since

    def call(self, layer, ids, weights, num_valid, split, scale):
        used = sorted({int(e) for row in ids[:num_valid] for e in row})
        self.clock += 1
        flat = [layer * self.E + e for e in used]
        hits = [f for f in flat if f in self.slot_of]
        misses = [f for f in flat if f not in self.slot_of]
        for f in hits:
            self.stamp[self.slot_of[f]] = self.clock
        oldest = min(self.stamp) if self.S else 0  # -1 while a slot is empty
        reused = [f for f in misses if self.last_use[f] > oldest]
        admitted = reused
        calm = True  # the re-miss rule's gate under the useful admission
        if split.admit_reuse and split.admit_useful and self.S and misses:
            lru = min(range(self.S), key=lambda s: (self.stamp[s], s))
            calm = self.stamp[lru] > self.filled_at[lru]  # the LRU slot hit since its fill
            self.useful[0 if calm else 1] += 1
            admitted = misses if calm else reused
        forced = reused if split.fill_reused and calm else []
        if split.fill_reused_valued and misses and self.S:
            # expected uses before eviction: LRU age over the time since the last use (fp32)
            need = np.float32(reuse_need(split))
            forced = [f for f in forced if np.float32(self.clock - oldest)
                      >= need * np.float32(max(self.clock - self.last_use[f], 1))]
        self.forced += len(forced) if oldest >= 0 else 0
        rest = [f for f in misses if f not in forced]
        m = len(misses)
        # q* over every miss; the forced fills count against it
        q = max(len(forced), min(m, max(split.min_fill, int(m * split.fill_ratio + 0.5))))
        c = m - q
        if split.cpu_us > 0 and c > 0 and (
            split.cpu_fixed_us + c * split.cpu_us >= split.fill_fixed_us + m * split.fill_us
        ):
            q = m  # the CPU branch would end after filling all m: fill them
        q -= len(forced)
        fillable = [f for f in rest if f in admitted] if split.admit_reuse else rest
        to_fill = sorted(forced + fillable[:q])
        if split.return_rule and self.S:
            # returns: experts missed at their last use, now a hit or a miss used since the
            # oldest slot's last use; decayed by 1 - 1/age on calls with misses
            f32 = np.float32
            back = [f for f in flat if self.missed[f] and (f in hits or self.last_use[f] > oldest)]
            if misses:
                self.returns *= f32(1) - f32(1) / f32(max(self.clock - oldest, 1))
            self.returns[0] += f32(len(back))
            r_cnt, n_cnt = self.returns
            rate = min(r_cnt / n_cnt, f32(1)) if n_cnt > 0 else f32(0)
            c, mm = f32(m - len(to_fill)), f32(m)
            fu = f32(split.fill_us)
            by_fill = c * fu + (f32(0) if to_fill else f32(split.fill_fixed_us))
            by_cpu = (f32(split.fill_fixed_us - split.cpu_fixed_us) + mm * fu
                      - c * f32(split.cpu_us))
            if c > 0 and not min(by_fill, by_cpu) > rate * c * fu:
                to_fill = sorted(misses)
                self.overruled += 1
            self.returns[1] += f32(m)
            for f in flat:
                self.missed[f] = f in misses
        to_cpu = [f for f in misses if f not in to_fill]
        q = len(to_fill)
        late = []
        if split.late_fill and self.S and misses and not to_fill:
            # Eq. 4 (and the cost check) over all m with no forced fill: none filled
            q0 = min(m, max(split.min_fill, int(m * split.fill_ratio + 0.5)))
            if split.cpu_us > 0 and m - q0 > 0 and (
                split.cpu_fixed_us + (m - q0) * split.cpu_us
                >= split.fill_fixed_us + m * split.fill_us
            ):
                q0 = m
            late = sorted(misses) if q0 == 0 else []
        if split.late_all and self.S:
            more = [f for f in to_cpu if f not in late
                    and (f in admitted or not split.admit_reuse)]
            late = sorted(late + more)
        self.late += len(late)
        order = sorted(range(self.S), key=lambda s: (self.stamp[s], s))
        fills, evictions = [], 0
        for f, victim in zip(to_fill + late, order):
            assert self.stamp[victim] < self.clock, "a slot of the current call was chosen"
            old = self.owner[victim]
            if old >= 0:
                del self.slot_of[old]
                evictions += 1
            self.owner[victim] = f
            self.slot_of[f] = victim
            self.stamp[victim] = self.clock
            self.filled_at[victim] = self.clock
            fills.append((f, victim))
        self.late_fills = fills[q:]
        fills = fills[:q]
        for f in flat:
            self.last_use[f] = self.clock
        for i, n in enumerate((len(used), len(hits), q, evictions, len(to_cpu))):
            self.counts[i][layer] += n
        cpu_set = {f - layer * self.E for f in to_cpu}
        items = [
            (t, layer * self.E + e, weights[t][j] * scale)
            for t in range(num_valid)
            for j, e in enumerate(ids[t])
            if e in cpu_set
        ]
        routed = [
            [-1 if e in cpu_set else e for e in (ids[t] if t < num_valid else ids[0])]
            for t in range(len(ids))
        ]
        return fills, items, routed


def check_invariants(state: ResidencyState, num_rows: int):
    res = state.residency[:num_rows].tolist()
    owner = state.owner[: state.num_slots].tolist()
    held = [o for o in owner if o >= 0]
    assert len(held) == len(set(held)), "a flat expert is held by two slots"
    for flat, slot in enumerate(res):
        if slot >= 0:
            assert owner[slot] == flat, "residency table and slot owner disagree"
    for slot, flat in enumerate(owner):
        if flat >= 0:
            assert res[flat] == slot, "slot owner and residency table disagree"
    assert state.residency[num_rows].item() == -1 and state.owner[-1].item() == -1


def random_call(rng, layer, E, k, T):
    fav = [(layer * 5 + j) % E for j in range(k + 1)]
    ids = torch.tensor(
        [rng.sample(fav if rng.random() < 0.6 else range(E), k) for _ in range(T)],
        dtype=torch.int32,
    )
    weights = torch.tensor([[rng.random() for _ in range(k)] for _ in range(T)])
    return ids, weights


@pytest.mark.parametrize("seed", range(len(SPLITS)))
def test_decide_matches_reference_lru(seed):
    rng = random.Random(seed)
    L, E, k = rng.choice([(3, 8, 2), (4, 16, 4), (2, 12, 3)])
    S = rng.randint(E, L * E + 3)  # from one layer's worth to more than the pool
    split = SPLITS[seed % len(SPLITS)]
    scale = rng.choice([1.0, 2.5])
    state = ResidencyState(L * E, S, "cpu")
    counters = torch.zeros(5, L, dtype=torch.int64)
    ref = ReferenceLRU(L, E, S)
    for step in range(60):
        T = rng.choice([1, 1, 2, 3, 8, 40])
        num_valid = rng.randint(1, T)
        for layer in range(L):
            ids, weights = random_call(rng, layer, E, k, T)
            d = decide(
                state, counters, layer, E, ids, weights, torch.tensor([num_valid]), split, scale
            )
            want_fills, want_items, want_routed = ref.call(
                layer, ids.tolist(), weights.tolist(), num_valid, split, scale
            )
            n = int(d.plan.count)
            assert list(zip(d.plan.src[:n].tolist(), d.plan.dst[:n].tolist())) == want_fills
            assert d.plan.src.numel() == max_unique_experts(T, k, E)
            assert (d.late is not None) == split.late_fill
            if d.late is not None:  # a call has fills and late fills only with late_all
                nl = int(d.late.count)
                assert nl == 0 or n == 0 or split.late_all
                assert list(zip(d.late.src[:nl].tolist(),
                                d.late.dst[:nl].tolist())) == ref.late_fills
            c = int(d.cpu.count)
            got_items = list(
                zip(d.cpu.rows[:c].tolist(), d.cpu.experts[:c].tolist(), d.cpu.weights[:c].tolist())
            )
            assert [(r, e) for r, e, _ in got_items] == [(r, e) for r, e, _ in want_items]
            for (_, _, w), (_, _, v) in zip(got_items, want_items):
                assert w == pytest.approx(v, rel=1e-6)
            assert d.routed_ids.tolist() == want_routed
            check_invariants(state, L * E)
            # every routed expert of a real row is resident or on the CPU after the call
            slots = state.layer_slots(layer, E)
            cpu_experts = {e - layer * E for _, e, _ in want_items}
            for e in ids[:num_valid].flatten().tolist():
                assert slots[e] >= 0 or e in cpu_experts
            assert state.owner[:S].tolist() == ref.owner
            assert state.stamp.tolist() == ref.stamp
            assert state.last_use.tolist() == ref.last_use
    assert counters.tolist() == ref.counts
    reads, hits, fills, evictions, cpu = counters.sum(1).tolist()
    assert hits + fills + cpu == reads
    assert evictions <= fills + ref.late
    assert state.late.item() == ref.late
    # late fills happened under the late fill only (beside the re-miss rule a sequence may
    # fill every lone miss it has)
    assert ref.late == 0 if not split.late_fill else ref.late > 0 or split.fill_reused
    if split is FILL_ALL:
        assert cpu == 0 and hits > 0
    if split.fill_ratio == 0:
        assert fills == 0 and cpu > 0
    if 0 < split.fill_ratio < 1:
        assert fills > 0 and cpu > 0
    # the re-miss rule filled misses beyond the split in a full cache (the kernel runs these
    # splits against the torch reference in test_triton_kernel_matches_the_torch_reference)
    assert (ref.forced > 0) == split.fill_reused
    # the return rule filled every miss of some calls and left others on the CPU
    assert (ref.overruled > 0) == split.return_rule
    assert state.missed.tolist() == [int(x) for x in ref.missed]
    assert state.returns.tolist() == ref.returns.tolist()
    assert state.filled_at[:S].tolist() == ref.filled_at
    # the useful admission admitted every miss in some calls and only the reused in others
    # (where the cache cannot hold every expert)
    assert (min(ref.useful) > 0) == (split.admit_useful and S < L * E), ref.useful


def test_qstar_split_counts():
    # 6 misses, B_P/B_H = 0.6: q* = round(3.6) = 4 fills, 2 on the CPU.
    E = 8
    state = ResidencyState(E, E, "cpu")
    counters = torch.zeros(5, 1, dtype=torch.int64)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    d = decide(state, counters, 0, E, ids, torch.ones(2, 3), torch.tensor([2]), MissSplit(0.6, 1))
    assert int(d.plan.count) == 4 and int(d.cpu.count) == 2
    assert d.plan.src[:4].tolist() == [0, 1, 2, 3]
    assert d.cpu.experts[:2].tolist() == [4, 5] and d.cpu.rows[:2].tolist() == [1, 1]
    assert d.routed_ids.tolist() == [[0, 1, 2], [3, -1, -1]]
    # one miss and a tiny ratio still fills one expert (the cache keeps warming)
    d = decide(state, counters, 0, E, torch.tensor([[6]], dtype=torch.int32), torch.ones(1, 1),
               torch.tensor([1]), MissSplit(0.1, 1))
    assert int(d.plan.count) == 1 and int(d.cpu.count) == 0
    assert counters[:, 0].tolist() == [7, 0, 5, 0, 2]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_lone_miss_rule_fills_when_the_cpu_branch_would_end_later(use_kernel):
    from freetoken_sglang.cache.residency import decide_reference

    E = 16
    counters = torch.zeros(5, 1, dtype=torch.int64)
    one = torch.tensor([1], dtype=torch.int32)
    if use_kernel:
        from freetoken_sglang.kernels.residency import decide_triton as run
    else:
        run = decide_reference
    for m, want_cpu in ((1, 0), (2, 0), (3, 0), (4, 3), (8, 6)):
        state = ResidencyState(E, E, "cpu")
        ids = torch.arange(m, dtype=torch.int32).reshape(1, m)
        d = run(state, counters, 0, E, ids, torch.ones(1, m), one, COSTED)
        assert int(d.cpu.count) == want_cpu, m
        assert int(d.plan.count) == m - want_cpu
        # without the cost check the same ratio sends m - round(m/4) misses to the CPU
        state = ResidencyState(E, E, "cpu")
        d = run(state, counters, 0, E, ids, torch.ones(1, m), one, MissSplit(0.25, 1))
        assert int(d.cpu.count) == m - max(1, int(m * 0.25 + 0.5))


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_admission_keeps_the_cache_under_a_cyclic_scan(use_kernel):
    # One expert per call, cycling over 5 experts with 4 slots: plain LRU misses every read
    # (each fill evicts the expert needed next); with admission the fifth expert, last used
    # before the oldest slot's last use, runs on the CPU and the other four stay resident.
    from freetoken_sglang.cache.residency import decide_reference

    if use_kernel:
        from freetoken_sglang.kernels.residency import decide_triton as run
    else:
        run = decide_reference
    E, S = 5, 4
    one = torch.tensor([1], dtype=torch.int32)
    for split, want in ((MissSplit(1.0, 0), [20, 0, 20, 16, 0]),
                        (MissSplit(1.0, 0, admit_reuse=True), [20, 12, 4, 0, 4])):
        state = ResidencyState(E, S, "cpu")
        counters = torch.zeros(5, 1, dtype=torch.int64)
        for step in range(20):
            ids = torch.tensor([[step % E]], dtype=torch.int32)
            run(state, counters, 0, E, ids, torch.ones(1, 1), one, split)
            check_invariants(state, E)
        assert counters[:, 0].tolist() == want, split  # reads, hits, fills, evictions, cpu
        assert state.last_use.tolist() == [16, 17, 18, 19, 20]


def one_row_calls(use_kernel, split, num_experts, num_slots, calls):
    """One layer's one-row calls routed to ``calls`` (lists of expert ids), through the kernel
    or the torch reference, from an empty cache. Returns the state, the counters, each call's
    (fill sources, fill slots) and its CPU experts."""
    from freetoken_sglang.cache.residency import decide_reference

    run = decide_reference
    if use_kernel:
        from freetoken_sglang.kernels.residency import decide_triton as run
    state = ResidencyState(num_experts, num_slots, "cpu")
    counters = torch.zeros(5, 1, dtype=torch.int64)
    plans, cpu = [], []
    for ids in calls:
        d = run(state, counters, 0, num_experts, torch.tensor([ids], dtype=torch.int32),
                torch.ones(1, len(ids)), torch.tensor([1], dtype=torch.int32), split)
        n, c = int(d.plan.count), int(d.cpu.count)
        plans.append((d.plan.src[:n].tolist(), d.plan.dst[:n].tolist()))
        cpu.append(d.cpu.experts[:c].tolist())
        check_invariants(state, num_experts)
    return state, counters, plans, cpu


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("fill_reused", [False, True])
def test_remiss_rule_fills_an_expert_the_cpu_served(use_kernel, fill_reused):
    # One layer, 2 slots, a split that sends every other miss to the CPU. Call 1 fills both
    # empty slots with the rule (every miss is reused while a slot is empty); call 2's misses
    # were never used: the CPU. Call 3 misses expert 2 again, used since the oldest slot's last
    # use: the rule fills it (evicting expert 0, the least recently used); expert 4 stays on
    # the CPU. Without the rule nothing is ever filled.
    split = MissSplit(0.0, 0, fill_reused=fill_reused)
    state, counters, plans, cpu = one_row_calls(use_kernel, split, 8, 2, ([0, 1], [2, 3], [4, 2]))
    fills = [list(zip(src, dst)) for src, dst in plans]
    if fill_reused:
        assert fills == [[(0, 0), (1, 1)], [], [(2, 0)]]
        assert cpu == [[], [2, 3], [4]]
        assert state.residency[:8].tolist() == [-1, 1, 0, -1, -1, -1, -1, -1]
    else:
        assert fills == [[], [], []]
        assert cpu == [[0, 1], [2, 3], [4, 2]]
    assert counters[:, 0].tolist() == ([6, 0, 3, 1, 3] if fill_reused else [6, 0, 0, 0, 6])


def test_valued_reuse_compares_in_fp32():
    # B_H/B_P - 1 at B_P/B_H = 0.3 is 7/3; 27 x 7/3 rounds to 63 in fp32 (the kernel's
    # arithmetic) but is 63.00000000000001 in fp64: an age of 63 reaches it in fp32 only.
    from freetoken_sglang.cache.residency import valued_reuse

    split = MissSplit(0.3, 1, fill_reused=True, fill_reused_valued=True)
    age, gap = torch.tensor([63, 62]), torch.tensor([27, 27])
    assert valued_reuse(age, gap, split).tolist() == [True, False]
    assert 63 < reuse_need(split) * 27  # (fp64)
    # a gap under 1 counts as 1; no fill ratio: never
    assert valued_reuse(torch.tensor([3]), torch.tensor([0]), MissSplit(0.25, 0)).tolist() == [True]
    assert not valued_reuse(torch.tensor([10**6]), torch.tensor([1]), MissSplit(0.0, 0)).item()


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("valued", [False, True])
def test_valued_remiss_rule_fills_a_reused_miss_expected_back_often_enough(use_kernel, valued):
    # One layer, 2 slots, q* = round(m / 4) (B_H/B_P - 1 = 3 later uses needed), no minimum
    # fill. 1 (clock 1): 0 and 1 miss with a slot empty (the LRU stamp -1: every miss is
    # reused); the re-miss rule fills both; valued, each has an LRU age of 2 against 3 x 1
    # since its last use (clock 0): neither is forced, q* = 1 fills 0 and 1 runs on the CPU.
    # Slot 1 then stays empty under the valued form. 8: 2 misses, last used at 5: age 9 (the
    # stamp -1 still) against 3 x 3: filled under both (the bound is inclusive).
    split = MissSplit(0.25, 0, fill_reused=True, fill_reused_valued=valued)
    calls = ([0, 1], [2], [0], [1], [2], [3], [0], [2], [1], [3])
    _, _, plans, cpu = one_row_calls(use_kernel, split, 8, 2, calls)
    fills = [list(zip(src, dst)) for src, dst in plans]
    if valued:
        assert fills == [[(0, 0)], [], [], [], [], [], [], [(2, 1)], [], []]
        assert cpu == [[1], [2], [], [1], [2], [3], [], [], [1], [3]]
    else:
        assert fills == [[(0, 0), (1, 1)], [], [], [], [], [], [], [(2, 1)], [], []]
        assert cpu == [[], [2], [], [], [2], [3], [], [], [1], [3]]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("useful", [False, True])
def test_useful_admission_admits_while_the_lru_slot_was_hit_since_its_fill(use_kernel, useful):
    # One layer, 2 slots, every admitted miss filled. 1: 0 and 1 fill the empty slots (clock
    # 1). 2: 0 hits. 3: 2 misses, never used: the LRU slot (1's) went unused since its fill,
    # so both forms send it to the CPU. 4: 1 hits. 5: 3 misses, never used; the LRU slot (0's)
    # was hit since its fill: the useful form fills 3 there, reuse runs it on the CPU. 6: 4
    # likewise (the LRU slot is 1's, hit at 4). 7: 5 misses; the LRU slot holds 3, filled at
    # 5 and unused since: the CPU under both.
    split = MissSplit(1.0, 0, admit_reuse=True, admit_useful=useful)
    state, _, plans, cpu = one_row_calls(use_kernel, split, 8, 2,
                                         ([0, 1], [0], [2], [1], [3], [4], [5]))
    fills = [list(zip(src, dst)) for src, dst in plans]
    if useful:
        assert fills == [[(0, 0), (1, 1)], [], [], [], [(3, 0)], [(4, 1)], []]
        assert cpu == [[], [], [2], [], [], [], [5]]
        assert state.filled_at.tolist() == [5, 6, -2]
    else:
        assert fills == [[(0, 0), (1, 1)], [], [], [], [], [], []]
        assert cpu == [[], [], [2], [], [3], [4], [5]]
        assert state.filled_at.tolist() == [1, 1, -2]
    state.reset()
    assert state.filled_at.tolist() == [-2, -2, -2]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("useful", [False, True])
def test_useful_admission_fills_reused_misses_only_while_calm(use_kernel, useful):
    # One layer, 2 slots, the admission and re-miss rules, q* = 0 for the other misses.
    # 1: 0 and 1 fill the empty slots (clock 1). 2: 2 misses, never used: the CPU. 3: 2 misses
    # again, reused (used at 2, after the oldest slot's stamp 1); the LRU slot (0's) went
    # unused since its fill (thrash): the useful form runs 2 on the CPU, reuse fills it (slot
    # 0). From there the useful form: 4: 0 and 1 hit (the LRU slot, 0's, now hit since its
    # fill: calm). 5: 2 misses, not reused (last use 3, before the stamps of 4): admitted, but
    # q* = 0: the CPU. 6: 2 reused and calm: filled (slot 0).
    split = MissSplit(0.0, 0, admit_reuse=True, fill_reused=True, admit_useful=useful)
    calls = ([0, 1], [2], [2], [0, 1], [2], [2])
    state, _, plans, cpu = one_row_calls(use_kernel, split, 8, 2, calls[:3] if not useful
                                         else calls)
    fills = [list(zip(src, dst)) for src, dst in plans]
    if useful:
        assert fills == [[(0, 0), (1, 1)], [], [], [], [], [(2, 0)]]
        assert cpu == [[], [2], [2], [], [2], []]
        assert state.filled_at.tolist() == [6, 1, -2]
    else:
        assert fills == [[(0, 0), (1, 1)], [], [(2, 0)]]
        assert cpu == [[], [2], []]
    # Under thrash the reused miss is admitted, so a q* that fills every admitted miss fills it
    # at call 3 (the useful form), while the non-reused one at call 2 still runs on the CPU.
    split = MissSplit(1.0, 0, admit_reuse=True, fill_reused=True, admit_useful=useful)
    _, _, plans, cpu = one_row_calls(use_kernel, split, 8, 2, calls[:3])
    assert [list(zip(src, dst)) for src, dst in plans] == [[(0, 0), (1, 1)], [], [(2, 0)]]
    assert cpu == [[], [2], []]


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_remiss_rule_counts_its_fills_in_q(use_kernel):
    # One layer of 16 experts, 6 slots, q*/m = 0.5 with the re-miss rule.
    # 1: six misses into empty slots, all reused (a slot is empty): 0-5 fill.
    # 2: four misses never used before: q*(4) = 2 fill (6, 7), 8 and 9 run on the CPU.
    # 3: six misses, 8 and 9 reused (used at 2, after the oldest slot's last use at 1):
    #    q*(6) = 3 fills, the two forced ones among them, so one other (10) fills; counted
    #    apart, the rule would fill 2 + q*(4) = 4.
    # 4: four misses, 11-13 reused: more forced fills than q*(4) = 2, so exactly those three
    #    fill and 14 runs on the CPU (counted apart: 3 + q*(1) = 4, every miss).
    split = MissSplit(0.5, 1, fill_reused=True)
    calls = ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9], [8, 9, 10, 11, 12, 13], [11, 12, 13, 14])
    _, _, plans, cpu = one_row_calls(use_kernel, split, 16, 6, calls)
    fills = [src for src, _ in plans]
    assert fills == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13]]
    assert cpu == [[], [8, 9], [11, 12, 13], [14]]


def late_calls(use_kernel, split, num_slots, calls):
    """``one_row_calls`` over 8 experts with the late fill: each call's (fills, late fills,
    CPU experts), the fills as (pool row, slot) pairs."""
    from freetoken_sglang.cache.residency import decide_reference

    run = decide_reference
    if use_kernel:
        from freetoken_sglang.kernels.residency import decide_triton as run
    state = ResidencyState(8, num_slots, "cpu")
    counters = torch.zeros(5, 1, dtype=torch.int64)
    got = []
    for ids in calls:
        d = run(state, counters, 0, 8, torch.tensor([ids], dtype=torch.int32),
                torch.ones(1, len(ids)), torch.tensor([1], dtype=torch.int32), split)
        n, nl, c = int(d.plan.count), int(d.late.count), int(d.cpu.count)
        got.append((list(zip(d.plan.src[:n].tolist(), d.plan.dst[:n].tolist())),
                    list(zip(d.late.src[:nl].tolist(), d.late.dst[:nl].tolist())),
                    d.cpu.experts[:c].tolist()))
        check_invariants(state, 8)
    return state, counters, got


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_late_fill_runs_a_lone_miss_on_the_cpu_and_keeps_it(use_kernel):
    # LATE: q*/m = 0.25 without the at-least-one fill. One layer of 8 experts, 3 slots.
    # 1: expert 0 misses alone: q* = 0, so it runs on the CPU and is filled late (slot 0).
    # 2: 0 hits; 1 misses alone: the CPU, and a late fill (slot 1).
    # 3: 1 hits; 2, 3, 4 miss: q*(3) = 1 fill (2, slot 2) that the call waits for, 3 and 4 on
    #    the CPU, nothing late (the call fills one).
    # 4: 3 misses alone: the CPU and a late fill into the least recently used slot (0,
    #    evicting expert 0).
    state, counters, got = late_calls(use_kernel, LATE, 3, ([0], [0, 1], [1, 2, 3, 4], [3]))
    assert got == [([], [(0, 0)], [0]), ([], [(1, 1)], [1]), ([(2, 2)], [], [3, 4]),
                   ([], [(3, 0)], [3])]
    assert state.residency[:8].tolist() == [-1, 1, 2, 0, -1, -1, -1, -1]
    # reads, hits, fills the calls waited for, evictions, CPU runs; 3 late fills
    assert counters[:, 0].tolist() == [8, 2, 1, 1, 5]
    assert state.late.item() == 3


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
@pytest.mark.parametrize("late_all", [False, True])
def test_late_fill_all_fills_the_cpu_runs_of_calls_that_fill(use_kernel, late_all):
    # q*/m = 0.5, one layer of 8 experts, 4 slots. 1: experts 0-2 miss: q*(3) = 2 fills (0, 1)
    # the call waits for; 2 runs on the CPU, and with "all" is filled late (the next victim,
    # slot 2). 2: expert 2 again: a hit with "all", else a lone miss (q*(1) = round(0.5) = 1
    # in-time fill).
    split = MissSplit(0.5, 0, late_fill=True, late_all=late_all)
    state, counters, got = late_calls(use_kernel, split, 4, ([0, 1, 2], [2]))
    if late_all:
        assert got == [([(0, 0), (1, 1)], [(2, 2)], [2]), ([], [], [])]
        assert counters[:, 0].tolist() == [4, 1, 2, 0, 1] and state.late.item() == 1
    else:
        assert got == [([(0, 0), (1, 1)], [], [2]), ([(2, 2)], [], [])]
        assert counters[:, 0].tolist() == [4, 0, 3, 0, 1] and state.late.item() == 0


@pytest.mark.parametrize("use_kernel", [False, pytest.param(True, marks=needs_interpreter)])
def test_return_rule_fills_what_returns_and_keeps_the_cpu_for_what_does_not(use_kernel):
    # RETURN: fill 200 us, CPU 100 us per expert, F_P 10, F_H 50; q*/m = 0.25. One layer of 16
    # experts, 8 slots. 1: four misses, r = 0 (no miss yet): q* = 1 fill (0), 1-3 on the CPU.
    # 2: the same four: 0 hits and 1-3 miss again within the LRU age (slots still empty), all
    #    four return: r = 4 / (4 x 2/3) -> 1; 3 misses with q* = 1 would save min(400, 360) us
    #    now against 1 x 2 x 200 later: every miss is filled.
    # 3: four experts never used: no return, r = 3 / 4.25 = 0.71 (both decayed by 3/4):
    #    saving min(600, 460) > 0.71 x 3 x 200 = 424: q* = 1 fill, 3 on the CPU.
    # Without the rule call 2 fills one miss and runs two on the CPU.
    for split, want in ((RETURN, [[0], [1, 2, 3], [4]]),
                        (MissSplit(0.25, 1, 200.0, 100.0, 10.0, 50.0), [[0], [1], [4]])):
        state, counters, plans, cpu = one_row_calls(
            use_kernel, split, 16, 8, ([0, 1, 2, 3], [0, 1, 2, 3], [4, 5, 6, 7]))
        assert [src for src, _ in plans] == want, split
        if split.return_rule:
            assert cpu == [[1, 2, 3], [], [5, 6, 7]]
            r, n = state.returns.tolist()
            assert r == pytest.approx(4 * 0.75, rel=1e-6)  # decayed at call 3 (age 4)
            assert n == pytest.approx((4 * 2 / 3 + 3) * 0.75 + 4, rel=1e-6)
            assert state.return_rate == pytest.approx(r / n)
            assert state.missed.tolist() == [0, 1, 1, 1, 1, 1, 1, 1] + [0] * 8  # missed last
        else:
            assert cpu == [[1, 2, 3], [2, 3], [5, 6, 7]]
            assert state.returns.tolist() == [0.0, 0.0]


def test_q_table_entries_are_the_split():
    from freetoken_sglang.cache.residency import fill_count, fill_count_after
    from freetoken_sglang.kernels.residency import q_table

    t = torch.tensor
    for split in SPLITS + [MissSplit(0.7, 1)]:
        table = q_table(split, 16, "cpu")
        assert table.dtype == torch.int32
        assert table[:17].tolist() == [int(fill_count(t(m), split)) for m in range(17)]
        if not split.fill_reused:
            assert table.shape == (17,)
            continue
        assert table.shape == (17 * 17,)
        for f in range(17):
            for r in range(17 - f):
                q = int(table[f * 17 + r])
                assert q == int(fill_count_after(t(f), t(r), split))
                # forced fills count in q*: never more fills than max(f, q*) unless the
                # cost check fills every miss
                assert q == r or f + q == max(f, int(fill_count(t(f + r), MissSplit(
                    split.fill_ratio, split.min_fill))))
    assert q_table(MissSplit(0.7, 1), 16, "cpu")[5] == 4  # 3.5 rounds half up in double


def test_lru_order_and_current_step_protection():
    # Two layers of 4 experts, 4 slots: the cache holds exactly one layer.
    E, S = 4, 4
    state = ResidencyState(2 * E, S, "cpu")
    counters = torch.zeros(5, 2, dtype=torch.int64)
    one = torch.tensor([1], dtype=torch.int32)

    def call(layer, ids, nv=one):
        ids = torch.tensor(ids, dtype=torch.int32)
        return decide(state, counters, layer, E, ids, torch.ones(ids.shape), nv)

    call(0, [[0, 1]])
    call(0, [[2, 3]])
    # Slots 0,1 hold experts 0,1 (older), slots 2,3 hold 2,3.
    assert state.owner[:S].tolist() == [0, 1, 2, 3]
    # Use expert 1 again: it becomes the most recent.
    call(0, [[1, 2]])
    # Layer 1 needs two experts: the two least recently used are experts 0 (slot 0) and
    # 3 (slot 3).
    d = call(1, [[0, 1]])
    assert int(d.plan.count) == 2
    assert d.plan.dst[:2].tolist() == [0, 3]
    assert state.owner[:S].tolist() == [4, 1, 2, 5]
    # A call that needs every slot evicts everything but never its own hits.
    d = call(0, [[1, 2], [0, 3]], torch.tensor([2]))
    assert sorted(d.plan.dst[: int(d.plan.count)].tolist()) == [0, 3]
    assert sorted(state.owner[:S].tolist()) == [0, 1, 2, 3]
    # layer 1 read 2, filled 2 and evicted 2 (layer 0's experts 0 and 3)
    assert counters[:, 1].tolist() == [2, 0, 2, 2, 0]


def test_padded_rows_are_ignored():
    E, S = 8, 8
    state = ResidencyState(E, S, "cpu")
    counters = torch.zeros(5, 1, dtype=torch.int64)
    ids = torch.tensor([[0, 1], [6, 7], [6, 7]], dtype=torch.int32)
    assert used_experts(ids, torch.tensor([1]), E).nonzero().flatten().tolist() == [0, 1]
    d = decide(state, counters, 0, E, ids, torch.ones(3, 2), torch.tensor([1]))
    assert int(d.plan.count) == 2
    assert d.routed_ids.tolist() == [[0, 1], [0, 1], [0, 1]]
    assert state.layer_slots(0, E)[6:].tolist() == [-1, -1]
    assert counters[:, 0].tolist() == [2, 0, 2, 0, 0]


def test_make_all_resident_and_reset():
    state = ResidencyState(6, 8, "cpu")
    state.make_all_resident()
    assert state.residency[:6].tolist() == list(range(6))
    counters = torch.zeros(5, 2, dtype=torch.int64)
    d = decide(state, counters, 1, 3, torch.tensor([[0, 2]], dtype=torch.int32),
               torch.ones(1, 2), torch.tensor([1]), MissSplit(0.5, 1))
    assert int(d.plan.count) == 0 and counters[:, 1].tolist() == [2, 2, 0, 0, 0]
    state.reset()
    assert (state.residency == -1).all() and (state.owner == -1).all()


def test_no_slot_runs_every_expert_on_the_cpu():
    state = ResidencyState(8, 0, "cpu")
    counters = torch.zeros(5, 2, dtype=torch.int64)
    ids = torch.tensor([[1, 3], [3, 0]], dtype=torch.int32)
    d = decide(state, counters, 1, 4, ids, torch.full((2, 2), 0.5), torch.tensor([2]),
               MissSplit(0.0, 0), 2.0)
    assert int(d.plan.count) == 0
    assert int(d.cpu.count) == 4
    assert d.cpu.experts[:4].tolist() == [5, 7, 7, 4]
    assert d.cpu.weights[:4].tolist() == [1.0, 1.0, 1.0, 1.0]
    assert d.routed_ids.tolist() == [[-1, -1], [-1, -1]]


def _assert_same_decision(da, db, a, b, step):
    """Two decisions (and the states after them) are the same: plans, CPU items, routing,
    late fills and every state tensor."""
    assert torch.equal(da.routed_ids, db.routed_ids)
    n = int(da.plan.count)
    assert int(db.plan.count) == n
    assert db.plan.src[:n].tolist() == da.plan.src[:n].tolist()
    assert db.plan.dst[:n].tolist() == da.plan.dst[:n].tolist()
    c = int(da.cpu.count)
    assert int(db.cpu.count) == c
    for f in ("rows", "experts"):
        assert getattr(db.cpu, f)[:c].tolist() == getattr(da.cpu, f)[:c].tolist()
    assert torch.allclose(db.cpu.weights[:c], da.cpu.weights[:c])
    if da.late is not None:
        nl = int(da.late.count)
        assert int(db.late.count) == nl
        assert db.late.src[:nl].tolist() == da.late.src[:nl].tolist()
        assert db.late.dst[:nl].tolist() == da.late.dst[:nl].tolist()
    for name in ("residency", "owner", "key", "clock", "last_use", "missed", "returns",
                 "late", "filled_at"):
        assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)


@needs_interpreter
@pytest.mark.parametrize("split", [FILL_ALL, ADMIT, RETURN, LATE],
                         ids=["fill", "admit", "return", "late"])
def test_hit_path_is_the_reference_and_the_full_path(split, monkeypatch):
    """The decision kernel's hit path (``DECIDE_HIT_PATH``: a call without misses skips the q
    table, one without CPU items the CPU routing) on a sequence where most calls hit: the
    reference's decisions, and the same as the kernel with every call on the full path."""
    from freetoken_sglang.cache.residency import decide_reference
    from freetoken_sglang.kernels import residency as kern

    rng = random.Random(7)
    L, E, k, S = 2, 8, 2, 10
    states = [ResidencyState(L * E, S, "cpu") for _ in range(3)]
    counters = [torch.zeros(5, L, dtype=torch.int64) for _ in range(3)]
    all_hit = with_cpu = 0
    for step in range(24):
        T = rng.choice([1, 3])
        nv = torch.tensor([rng.randint(1, T)], dtype=torch.int32)
        layer = rng.randrange(L)
        hot = range(3) if rng.random() < 0.75 else range(E)  # mostly the same few experts
        ids = torch.tensor([rng.sample(hot, k) for _ in range(T)], dtype=torch.int32)
        w = torch.rand(T, k)
        before = counters[0][:2, layer].clone()
        want = decide_reference(states[0], counters[0], layer, E, ids, w, nv, split, 1.5)
        reads, hits = (counters[0][:2, layer] - before).tolist()
        all_hit += reads == hits
        with_cpu += int(want.cpu.count) > 0
        for hit_path, state, c in ((True, states[1], counters[1]),
                                   (False, states[2], counters[2])):
            monkeypatch.setattr(kern, "DECIDE_HIT_PATH", hit_path)
            got = kern.decide_triton(state, c, layer, E, ids, w, nv, split, 1.5)
            _assert_same_decision(want, got, states[0], state, step)
    assert all(torch.equal(counters[0], c) for c in counters[1:])
    assert all_hit >= 8 and all_hit < 24, all_hit  # both paths taken
    assert with_cpu > 0 or not split.may_run_cpu


@needs_interpreter
@pytest.mark.parametrize("seed", list(range(len(SPLITS))) + ["admit-small"])
def test_triton_kernel_matches_the_torch_reference(seed):
    """The CUDA path's kernel (run by Triton's interpreter here) gives the reference's plans,
    CPU items, routing, state and counters."""
    from freetoken_sglang.kernels.residency import decide_triton
    from freetoken_sglang.cache.residency import decide_reference

    if seed == "admit-small":
        # admission with every admitted miss filled: each CPU item is a miss it refused
        rng = random.Random(99)
        L, E, k, S, split = 3, 8, 2, 8, MissSplit(1.0, 0, admit_reuse=True)
    else:
        rng = random.Random(100 + seed)
        L, E, k = rng.choice([(3, 8, 2), (2, 12, 3), (2, 64, 4)])
        S = rng.randint(E, E + E // 2)  # at most 1.5 layers' worth: evictions happen
        split = SPLITS[seed]
    a, b = ResidencyState(L * E, S, "cpu"), ResidencyState(L * E, S, "cpu")
    ca = torch.zeros(5, L, dtype=torch.int64)
    cb = torch.zeros(5, L, dtype=torch.int64)
    for step in range(40 if seed == "admit-small" else 16):
        T = rng.choice([1, 2] if seed == "admit-small" else [1, 2, 5, 30])
        nv = torch.tensor([rng.randint(1, T)], dtype=torch.int32)
        layer = rng.randrange(L)
        ids = torch.tensor([rng.sample(range(E), k) for _ in range(T)], dtype=torch.int32)
        w = torch.rand(T, k)
        da = decide_reference(a, ca, layer, E, ids, w, nv, split, 1.5)
        db = decide_triton(b, cb, layer, E, ids, w, nv, split, 1.5)
        _assert_same_decision(da, db, a, b, step)
    assert torch.equal(ca, cb)
    assert ca[3].sum() + ca[4].sum() > 0, "the sequence should evict or use the CPU"
    if split.late_fill and not split.fill_reused:
        assert a.late.item() > 0, "the sequence should fill late"
    if seed == "admit-small":
        assert ca[4].sum() > 0 and ca[3].sum() > 0, "admission should refuse some misses"
