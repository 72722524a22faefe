"""The GPU expert cache's residency bookkeeping (``freetoken_sglang.residency.decide``) against
a plain-Python LRU model, over random routing sequences, plus its invariants."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import needs_interpreter

from freetoken_sglang.residency import (
    ResidencyState,
    decide,
    max_unique_experts,
    used_experts,
)


class ReferenceLRU:
    """One LRU over S slots shared by all layers, written for clarity, not speed."""

    def __init__(self, num_layers, num_experts, num_slots):
        self.E, self.S = num_experts, num_slots
        self.owner = [-1] * num_slots
        self.stamp = [-1] * num_slots
        self.slot_of = {}
        self.clock = 0
        self.counts = [[0] * num_layers for _ in range(4)]

    def call(self, layer, ids, num_valid):
        used = sorted({int(e) for row in ids[:num_valid] for e in row})
        self.clock += 1
        flat = [layer * self.E + e for e in used]
        hits = [f for f in flat if f in self.slot_of]
        misses = [f for f in flat if f not in self.slot_of]
        for f in hits:
            self.stamp[self.slot_of[f]] = self.clock
        order = sorted(range(self.S), key=lambda s: (self.stamp[s], s))
        fills, evictions = [], 0
        for f, victim in zip(misses, order):
            assert self.stamp[victim] < self.clock, "a slot of the current call was chosen"
            old = self.owner[victim]
            if old >= 0:
                del self.slot_of[old]
                evictions += 1
            self.owner[victim] = f
            self.slot_of[f] = victim
            self.stamp[victim] = self.clock
            fills.append((f, victim))
        for i, n in enumerate((len(used), len(hits), len(misses), evictions)):
            self.counts[i][layer] += n
        return fills


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


@pytest.mark.parametrize("seed", range(6))
def test_decide_matches_reference_lru(seed):
    rng = random.Random(seed)
    L, E, k = rng.choice([(3, 8, 2), (4, 16, 4), (2, 12, 3)])
    S = rng.randint(E, L * E + 3)  # from one layer's worth to more than the pool
    state = ResidencyState(L * E, S, "cpu")
    counters = torch.zeros(4, L, dtype=torch.int64)
    ref = ReferenceLRU(L, E, S)
    for step in range(60):
        T = rng.choice([1, 1, 2, 3, 8, 40])
        num_valid = rng.randint(1, T)
        # Locality: each layer re-uses a few favourite experts most of the time.
        for layer in range(L):
            fav = [(layer * 5 + j) % E for j in range(k + 1)]
            ids = torch.tensor(
                [
                    rng.sample(fav if rng.random() < 0.6 else range(E), k)
                    for _ in range(T)
                ],
                dtype=torch.int32,
            )
            plan, routed = decide(state, counters, layer, E, ids, torch.tensor([num_valid]))
            want = ref.call(layer, ids.tolist(), num_valid)
            n = int(plan.count)
            got = list(zip(plan.src[:n].tolist(), plan.dst[:n].tolist()))
            assert got == want, f"step {step} layer {layer}"
            assert plan.src.numel() == max_unique_experts(T, k, E)
            assert torch.equal(routed[:num_valid], ids[:num_valid])
            assert (routed[num_valid:] == ids[0]).all()
            check_invariants(state, L * E)
            # every routed expert of a real row is resident after the call
            slots = state.layer_slots(layer, E)
            for e in ids[:num_valid].flatten().tolist():
                assert slots[e] >= 0
            assert state.owner[:S].tolist() == ref.owner
            assert state.stamp.tolist() == ref.stamp
    assert counters.tolist() == ref.counts
    reads, hits, fills, evictions = counters.sum(1).tolist()
    assert hits + fills == reads
    assert evictions <= fills
    assert hits > 0 and fills > 0


def test_lru_order_and_current_step_protection():
    # Two layers of 4 experts, 4 slots: the cache holds exactly one layer.
    E, S = 4, 4
    state = ResidencyState(2 * E, S, "cpu")
    counters = torch.zeros(4, 2, dtype=torch.int64)
    one = torch.tensor([1], dtype=torch.int32)
    decide(state, counters, 0, E, torch.tensor([[0, 1]], dtype=torch.int32), one)
    decide(state, counters, 0, E, torch.tensor([[2, 3]], dtype=torch.int32), one)
    # Slots 0,1 hold experts 0,1 (older), slots 2,3 hold 2,3.
    assert state.owner[:S].tolist() == [0, 1, 2, 3]
    # Use expert 1 again: it becomes the most recent.
    decide(state, counters, 0, E, torch.tensor([[1, 2]], dtype=torch.int32), one)
    # Layer 1 needs two experts: the two least recently used are experts 0 (slot 0) and
    # 3 (slot 3).
    plan, _ = decide(state, counters, 1, E, torch.tensor([[0, 1]], dtype=torch.int32), one)
    assert int(plan.count) == 2
    assert plan.dst[:2].tolist() == [0, 3]
    assert state.owner[:S].tolist() == [4, 1, 2, 5]
    # A call that needs every slot evicts everything but never its own hits.
    plan, _ = decide(
        state, counters, 0, E, torch.tensor([[1, 2], [0, 3]], dtype=torch.int32),
        torch.tensor([2]),
    )
    assert sorted(plan.dst[: int(plan.count)].tolist()) == [0, 3]
    assert sorted(state.owner[:S].tolist()) == [0, 1, 2, 3]
    # layer 1 read 2, filled 2 and evicted 2 (layer 0's experts 0 and 3)
    assert counters[:, 1].tolist() == [2, 0, 2, 2]


def test_padded_rows_are_ignored():
    E, S = 8, 8
    state = ResidencyState(E, S, "cpu")
    counters = torch.zeros(4, 1, dtype=torch.int64)
    ids = torch.tensor([[0, 1], [6, 7], [6, 7]], dtype=torch.int32)
    assert used_experts(ids, torch.tensor([1]), E).nonzero().flatten().tolist() == [0, 1]
    plan, routed = decide(state, counters, 0, E, ids, torch.tensor([1]))
    assert int(plan.count) == 2
    assert routed.tolist() == [[0, 1], [0, 1], [0, 1]]
    assert state.layer_slots(0, E)[6:].tolist() == [-1, -1]
    assert counters[:, 0].tolist() == [2, 0, 2, 0]


def test_make_all_resident_and_reset():
    state = ResidencyState(6, 8, "cpu")
    state.make_all_resident()
    assert state.residency[:6].tolist() == list(range(6))
    counters = torch.zeros(4, 2, dtype=torch.int64)
    plan, _ = decide(
        state, counters, 1, 3, torch.tensor([[0, 2]], dtype=torch.int32), torch.tensor([1])
    )
    assert int(plan.count) == 0 and counters[:, 1].tolist() == [2, 2, 0, 0]
    state.reset()
    assert (state.residency == -1).all() and (state.owner == -1).all()


@pytest.mark.parametrize("seed", range(3))
@needs_interpreter
def test_triton_kernels_match_the_torch_reference(seed):
    """The CUDA path's kernels (run by Triton's interpreter here) give the reference's
    plans, state and counters."""
    from freetoken_sglang.kernels.residency import decide_triton
    from freetoken_sglang.residency import decide_reference

    rng = random.Random(100 + seed)
    L, E, k = rng.choice([(3, 8, 2), (2, 12, 3), (2, 64, 4)])
    S = rng.randint(E, E + E // 2)  # at most 1.5 layers' worth: evictions happen
    a, b = ResidencyState(L * E, S, "cpu"), ResidencyState(L * E, S, "cpu")
    ca = torch.zeros(4, L, dtype=torch.int64)
    cb = torch.zeros(4, L, dtype=torch.int64)
    for step in range(16):
        T = rng.choice([1, 2, 5, 30])
        nv = torch.tensor([rng.randint(1, T)], dtype=torch.int32)
        layer = rng.randrange(L)
        ids = torch.tensor([rng.sample(range(E), k) for _ in range(T)], dtype=torch.int32)
        pa, ra = decide_reference(a, ca, layer, E, ids, nv)
        pb, rb = decide_triton(b, cb, layer, E, ids, nv)
        assert torch.equal(ra, rb)
        n = int(pa.count)
        assert int(pb.count) == n
        assert pb.src[:n].tolist() == pa.src[:n].tolist()
        assert pb.dst[:n].tolist() == pa.dst[:n].tolist()
        for name in ("residency", "owner", "key", "clock"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
    assert ca[3].sum() > 0, "the sequence should evict"
    assert torch.equal(ca, cb)
