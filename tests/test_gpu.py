"""GPU-only checks (skipped without CUDA): the device-side decision kernels against the torch
reference, UVA fills from a pinned pool, and the MoE over slots against SGLang's own fused
MoE on the same weights, bit for bit (FP4 slots run in several passes: within rounding)."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_q_table_is_the_double_precision_split():
    """The kernel reads q from ``q_table`` (exactly ``fill_count``): B_P/B_H = 0.7 at m = 5 is
    3.5 in double (q = 4) but 3.4999999 in fp32 (q = 3)."""
    from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide
    from freetoken_sglang.kernels.residency import q_table

    split = MissSplit(0.7, 1)
    assert q_table(split, 16, "cuda")[5].item() == 4
    state = ResidencyState(16, 16, "cuda")
    counters = torch.zeros(5, 1, dtype=torch.int64, device="cuda")
    ids = torch.arange(5, dtype=torch.int32, device="cuda").reshape(1, 5)
    d = decide(state, counters, 0, 16, ids, torch.ones(1, 5, device="cuda"),
               torch.tensor([1], dtype=torch.int32, device="cuda"), split)
    assert int(d.plan.count) == 4 and int(d.cpu.count) == 1


def test_decide_on_cuda_matches_reference():
    from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide, decide_reference

    rng = random.Random(0)
    L, E, k, S = 6, 128, 8, 300
    a, b = ResidencyState(L * E, S, "cpu"), ResidencyState(L * E, S, "cuda")
    ca = torch.zeros(5, L, dtype=torch.int64)
    cb = torch.zeros(5, L, dtype=torch.int64, device="cuda")
    for step in range(200):
        T = rng.choice([1, 1, 4, 16, 300])
        layer = rng.randrange(L)
        # small calls: q* alone, or with the lone-miss rule's cost check (fixed 10/500 us), the
        # admission rule, the re-miss rule
        costed = MissSplit(0.6, 1, 200.0, 100.0, 10.0, 500.0)
        admit = MissSplit(0.6, 1, admit_reuse=True)
        refill = MissSplit(0.4, 1, 200.0, 100.0, 10.0, 500.0, fill_reused=True)
        both = MissSplit(0.6, 1, admit_reuse=True, fill_reused=True)
        # the return rule (fp32 arithmetic: the kernel must round as torch does)
        ret = MissSplit(0.4, 1, 145.51, 182.67, 33.1, 4.0, return_rule=True)
        # the late fill (a call q* fills none of fills its misses after the call)
        late = MissSplit(0.3, 0, 200.0, 100.0, 10.0, 50.0, late_fill=True)
        late_admit = MissSplit(0.3, 0, admit_reuse=True, late_fill=True)
        # ... of every CPU run (all), alone and with admission
        late_all = MissSplit(0.4, 0, late_fill=True, late_all=True)
        late_all_admit = MissSplit(0.4, 0, admit_reuse=True, late_fill=True, late_all=True)
        # the useful admission, alone and with the re-miss rule
        useful = MissSplit(0.6, 1, admit_reuse=True, admit_useful=True)
        useful_refill = MissSplit(0.6, 1, admit_reuse=True, fill_reused=True, admit_useful=True)
        # the valued re-miss rule (B_H/B_P - 1 = 7/3 in fp32), alone and with the useful form
        valued = MissSplit(0.3, 1, fill_reused=True, fill_reused_valued=True)
        useful_valued = MissSplit(0.4, 1, admit_reuse=True, fill_reused=True, admit_useful=True,
                                  fill_reused_valued=True)
        split = (rng.choice([MissSplit(0.6, 1), MissSplit(0.7, 1), costed, admit, refill, both,
                             ret, ret, late, late_admit, late_all, late_all_admit, useful,
                             useful_refill, valued, useful_valued])
                 if T <= 16 else MissSplit(1.0, 0))
        ids = torch.tensor([rng.sample(range(E), k) for _ in range(T)], dtype=torch.int32)
        w = torch.rand(T, k)
        nv = torch.tensor([rng.randint(1, T)], dtype=torch.int32)
        da = decide_reference(a, ca, layer, E, ids, w, nv, split, 2.5)
        db = decide(b, cb, layer, E, ids.cuda(), w.cuda(), nv.cuda(), split, 2.5)
        assert torch.equal(da.routed_ids, db.routed_ids.cpu())
        n = int(da.plan.count)
        assert int(db.plan.count) == n
        assert db.plan.src[:n].tolist() == da.plan.src[:n].tolist()
        assert db.plan.dst[:n].tolist() == da.plan.dst[:n].tolist()
        c = int(da.cpu.count)
        assert db.cpu.experts[:c].tolist() == da.cpu.experts[:c].tolist()
        assert db.cpu.rows[:c].tolist() == da.cpu.rows[:c].tolist()
        if split.late_fill:
            nl = int(da.late.count)
            assert int(db.late.count) == nl
            assert db.late.src[:nl].tolist() == da.late.src[:nl].tolist()
            assert db.late.dst[:nl].tolist() == da.late.dst[:nl].tolist()
    assert a.late.item() > 0
    for name in ("residency", "owner", "key", "clock", "last_use", "missed", "returns",
                 "late", "filled_at"):
        assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
    assert torch.equal(ca, cb.cpu())


def test_uva_fill_from_pinned_pool():
    from freetoken_sglang.cache.fills import Filler
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.cache.residency import FillPlan

    with torch.device("cuda"):  # as SGLang builds models: the pool stays on the host
        pool = HostExpertPool([0, 1], 16, bank_specs_for_layer(256, 96, torch.bfloat16))
    for bank in pool.banks.values():
        bank.copy_(torch.randn(bank.shape).to(bank.dtype))
    assert pool.pin() and pool.pinned
    slots = {n: torch.zeros(8, *s.shape, dtype=s.dtype, device="cuda") for n, s in pool.specs.items()}
    assert all(b.device.type == "cpu" for b in pool.banks.values())
    torch.full((1,), 1, device="cuda")  # no stale CUDA error after the registration
    f = Filler(pool.banks, pool.device_banks, slots)
    assert f.mode == "uva"
    plan = FillPlan(
        torch.tensor([31, 2, 17, 0], dtype=torch.int32, device="cuda"),
        torch.tensor([7, 0, 3, 5], dtype=torch.int32, device="cuda"),
        torch.tensor([3], dtype=torch.int32, device="cuda"),
    )
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f.run(plan)
    g.replay()
    torch.cuda.synchronize()
    for n, bank in pool.banks.items():
        assert torch.equal(slots[n][7].cpu(), bank[31])
        assert torch.equal(slots[n][0].cpu(), bank[2])
        assert torch.equal(slots[n][3].cpu(), bank[17])
        assert (slots[n][5] == 0).all()
    pool.unpin()


def test_late_fills_fork_and_join_inside_a_captured_graph():
    """LateFills under CUDA graph capture: each launch forks a side stream, ``join`` brings it
    back before the capture ends, and a replay copies the planned rows (the late fill)."""
    from freetoken_sglang.cache.fills import Filler, LateFills
    from freetoken_sglang.cache.residency import FillPlan
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer

    with torch.device("cuda"):
        pool = HostExpertPool([0, 1], 16, bank_specs_for_layer(256, 96, torch.bfloat16))
    for bank in pool.banks.values():
        bank.copy_(torch.randn(bank.shape).to(bank.dtype))
    assert pool.pin()
    slots = {n: torch.zeros(8, *s.shape, dtype=s.dtype, device="cuda")
             for n, s in pool.specs.items()}
    late = LateFills(Filler(pool.banks, pool.device_banks, slots))
    i32 = dict(dtype=torch.int32, device="cuda")
    plans = [FillPlan(torch.tensor([5, 9], **i32), torch.tensor([1, 6], **i32),
                      torch.tensor([2], **i32)),
             FillPlan(torch.tensor([30], **i32), torch.tensor([4], **i32),
                      torch.tensor([1], **i32))]
    x = torch.ones(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for p in plans:
            late.launch(p)
            x.mul_(2)  # the main stream's work goes on beside the copies
        late.join()
    g.replay()
    torch.cuda.synchronize()
    for n, bank in pool.banks.items():
        for src, dst in ((5, 1), (9, 6), (30, 4)):
            assert torch.equal(slots[n][dst].cpu(), bank[src])
        assert (slots[n][0] == 0).all()
    pool.unpin()


@pytest.mark.parametrize("late_all", [False, True])
def test_late_fill_steps_in_a_graph_keep_each_slot_its_owners_row(late_all):
    """Decode steps captured in a CUDA graph with the late fill, over a cache so small that a
    step stamps every slot (a slot late-filled early in the step is a victim again later in
    it, as ``DecodeExecutor`` then makes the in-time fill wait): after every replay each
    owned slot holds exactly its owner's pool row."""
    from freetoken_sglang.cache.fills import Filler, LateFills
    from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.kernels.residency import q_table

    L, E, k, S = 4, 16, 2, 6  # a step stamps up to L * k = 8 slots > S - 1
    with torch.device("cuda"):
        pool = HostExpertPool(list(range(L)), E, bank_specs_for_layer(256, 96, torch.bfloat16))
    for bank in pool.banks.values():
        bank.copy_(torch.randn(bank.shape).to(bank.dtype))
    assert pool.pin()
    slots = {n: torch.zeros(S, *s.shape, dtype=s.dtype, device="cuda")
             for n, s in pool.specs.items()}
    filler = Filler(pool.banks, pool.device_banks, slots)
    late = LateFills(filler)
    state = ResidencyState(L * E, S, "cuda")
    counters = torch.zeros(5, L, dtype=torch.int64, device="cuda")
    # one miss: late; two: one fill in time (and with late_all the other one late)
    split = MissSplit(0.3, 0, late_fill=True, late_all=late_all)
    q_table(split, E, "cuda")
    ids = torch.zeros(L, 1, k, dtype=torch.int32, device="cuda")
    w = torch.ones(1, k, device="cuda")
    nv = torch.ones(1, dtype=torch.int32, device="cuda")

    def step():
        for layer in range(L):
            d = decide(state, counters, layer, E, ids[layer], w, nv, split)
            if late.pending:
                late.wait()
            filler.run(d.plan)
            late.launch(d.late)
        late.join()

    rng = random.Random(3)
    step()  # eager first: the kernels compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    state.reset()
    counters.zero_()
    for _ in range(30):
        ids.copy_(torch.tensor([[rng.sample(range(E), k)] for _ in range(L)]))
        g.replay()
        torch.cuda.synchronize()
        for s, o in enumerate(state.owner[:S].tolist()):
            if o >= 0:
                for n in pool.banks:
                    assert torch.equal(slots[n][s].cpu(), pool.banks[n][o]), (s, o)
    assert state.late.item() > 0 and counters[2].sum().item() > 0  # late and in-time fills
    pool.unpin()


def test_stream_copy_runs_are_async_on_the_copy_engine():
    """copy_row_runs from a cudaHostRegister'ed pool with non_blocking: the host call returns
    before the copy ends (a cudaMemcpyAsync, not a staged pageable copy), the bytes land
    where the runs say, and the achieved rate is printed (pytest -s)."""
    import time

    from freetoken_sglang.cache.fills import copy_row_runs
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer

    pool = HostExpertPool([0, 1], 64, bank_specs_for_layer(2048, 768, torch.bfloat16))
    for bank in pool.banks.values():
        bank.view(torch.int16).random_(-1000, 1000)
    assert pool.pin()
    slots = {n: torch.zeros(80, *s.shape, dtype=s.dtype, device="cuda") for n, s in pool.specs.items()}
    stream = torch.cuda.Stream()
    runs = [(64, 0, 64)]  # layer 1 whole: 64 experts, 600 MiB
    torch.cuda.synchronize()
    done = torch.cuda.Event(enable_timing=True)
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        t0 = time.perf_counter()
        copy_row_runs(pool.banks, slots, runs, non_blocking=True)
        issue_s = time.perf_counter() - t0
        done.record(stream)
    pending = not done.query()
    done.synchronize()
    gbps = 64 * pool.expert_bytes / (start.elapsed_time(done) / 1e3) / 1e9
    print(f"stream copy: {gbps:.1f} GB/s, host issue {issue_s * 1e3:.2f} ms")
    assert pending, "the copy finished before the host call returned: not asynchronous"
    copy_row_runs(pool.banks, slots, [(3, 70, 2)], non_blocking=True)
    torch.cuda.synchronize()
    bits = lambda t: t.view(torch.int16)  # noqa: E731 - random bits hold NaNs
    for n, bank in pool.banks.items():
        assert torch.equal(bits(slots[n][:64].cpu()), bits(bank[64:128]))
        assert torch.equal(bits(slots[n][70:72].cpu()), bits(bank[3:5]))
    pool.unpin()


def test_align_stand_in_matches_the_kernel():
    """``test_fp4_slots_interpreter.py``'s torch stand-in for SGLang's token alignment gives the
    CUDA kernel's blocks: the same padded total, block expert ids, and token rows per block
    (the kernel orders a block's rows by its atomics)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size import (
        moe_align_block_size,
    )

    from test_fp4_slots_interpreter import align_block_size

    g = torch.Generator().manual_seed(0)
    for t, k, E, bs in ((1, 4, 16, 16), (3, 4, 16, 16), (64, 8, 128, 64), (5, 2, 8, 32)):
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)]).int()
        ids[0, 0] = -1  # an entry served elsewhere
        want_rows, want_experts, want_n = moe_align_block_size(ids.cuda(), bs, E)
        rows, experts = torch.empty_like(want_rows).cpu(), torch.empty_like(want_experts).cpu()
        n = torch.empty(1, dtype=torch.int32)
        align_block_size(ids, E + 1, bs, rows, experts, n, torch.empty(E + 2, dtype=torch.int32),
                         True)
        assert int(n) == int(want_n)
        blocks = int(n) // bs
        assert experts[:blocks].tolist() == want_experts[:blocks].tolist()
        got = rows[:int(n)].view(blocks, bs).sort(1).values
        assert torch.equal(got, want_rows[:int(n)].cpu().view(blocks, bs).sort(1).values)


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 700])
def test_moe_on_slots_is_bit_identical_to_stock(num_tokens, published_server_args):
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from freetoken_sglang.execute.slot_moe import run_on_slots_triton

    torch.manual_seed(num_tokens)
    E, H, I, k, S = 16, 512, 256, 4, 40
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(num_tokens, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, E, device="cuda")
    weights, ids = torch.topk(logits.softmax(-1), k)
    ids = ids.to(torch.int32)
    cfg = MoeRunnerConfig(
        num_experts=E, num_local_experts=E, hidden_size=H,
        intermediate_size_per_partition=I, top_k=k, params_dtype=torch.bfloat16,
        activation="silu", inplace=False, routed_scaling_factor=1.5,
    )
    want = fused_experts(x.clone(), w13, w2, StandardTopKOutput(weights, ids, logits), cfg)
    # Scatter the experts into random slots of a larger slot bank.
    perm = torch.randperm(S, device="cuda")[:E].to(torch.int32)
    slot_w13 = torch.zeros(S, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    slot_w2 = torch.zeros(S, H, I, device="cuda", dtype=torch.bfloat16)
    slot_w13[perm.long()] = w13
    slot_w2[perm.long()] = w2
    layer = SimpleNamespace(moe_runner_config=cfg, w13_weight=w13.cpu(), w2_weight=w2.cpu())
    got = run_on_slots_triton(
        layer, x.clone(), weights, ids, perm, {"w13_weight": slot_w13, "w2_weight": slot_w2}
    )
    assert torch.equal(got, want)
    # The decode executor's order: empty slots filled by a fill launched after the token
    # alignment, whose launch also remaps the block ids (kernels/fill.py).
    from freetoken_sglang.kernels.fill import copy_rows_banks

    empty = {"w13_weight": torch.zeros_like(slot_w13), "w2_weight": torch.zeros_like(slot_w2)}
    pool = {"w13_weight": w13, "w2_weight": w2}
    rows = torch.arange(E, dtype=torch.int32, device="cuda")
    count = torch.tensor([E], dtype=torch.int32, device="cuda")
    launched = []

    def fill(remap):
        launched.append(remap is not None)
        copy_rows_banks([pool[n] for n in empty], [empty[n] for n in empty], rows, perm,
                        count, remap=remap)

    got = run_on_slots_triton(layer, x.clone(), weights, ids, perm, empty, fill=fill)
    assert launched == [True] and torch.equal(got, want)
    # Every expert resident (execute/resident.py): the layer's own rows of a larger bank,
    # with no remap.
    big = {n: torch.zeros(3 * E, *w.shape[1:], device="cuda", dtype=w.dtype)
           for n, w in (("w13_weight", w13), ("w2_weight", w2))}
    big["w13_weight"][E:2 * E] = w13
    big["w2_weight"][E:2 * E] = w2
    got = run_on_slots_triton(layer, x.clone(), weights, ids, None,
                              {n: b[E:2 * E] for n, b in big.items()})
    assert torch.equal(got, want)
    # Entries at -1 (served on the CPU) contribute nothing; the rest is unchanged.
    drop = torch.zeros_like(ids, dtype=torch.bool)
    drop[:, 0] = True
    partial = run_on_slots_triton(
        layer, x.clone(), weights, ids.masked_fill(drop, -1), perm,
        {"w13_weight": slot_w13, "w2_weight": slot_w2}, skip_negative_ids=True,
    )
    want_partial = fused_experts(
        x.clone(), w13, w2, StandardTopKOutput(weights.masked_fill(drop, 0), ids, logits), cfg
    )
    torch.testing.assert_close(partial, want_partial, rtol=2e-2, atol=2e-3)


def _pinned_random_pool(L, E, H, I):
    """A pinned bf16 host pool of L layers x E experts (hidden H, expert I), random weights
    of scale 0.05."""
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer

    with torch.device("cuda"):
        pool = HostExpertPool(list(range(L)), E, bank_specs_for_layer(H, I, torch.bfloat16))
    gen = torch.Generator().manual_seed(5)
    for bank in pool.banks.values():
        bank.copy_((torch.randn(bank.shape, generator=gen) * 0.05).to(bank.dtype))
    assert pool.pin()
    return pool


def _stand_in_runtime(state, num_experts, slots, filler, split, counters, num_valid,
                      cpu_branch, with_null=None):
    """What ``DecodeExecutor`` reads of a ``FreeTokenRuntime``: the cache (residency, experts
    per layer, slot banks, filler, late fills; with ``with_null``, the banks with one zero
    row after ``slots``, its null slot), one split for every call, the counters,
    ``num_valid`` and the CPU branch."""
    from types import SimpleNamespace

    from freetoken_sglang.cache.fills import LateFills

    return SimpleNamespace(
        cache=SimpleNamespace(residency=state, num_experts=num_experts, slot_banks=slots,
                              late=LateFills(filler), filler=filler,
                              banks_with_null_slots=with_null,
                              null_slot=None if with_null is None else
                              next(iter(slots.values())).shape[0]),
        split_for=lambda rows: split, is_decode_sized=lambda rows: True,
        counters=SimpleNamespace(of_phase=lambda phase: counters), num_valid=num_valid,
        cpu_branch=cpu_branch)


def _replayed_steps(executor, calls, route, resets, n):
    """Capture one decode step (``executor.run`` of every layer call) in a CUDA graph, run
    ``resets``, then for each of ``n`` steps ``route()`` and replay: yields ``(step, outs)``
    after each replay has finished."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [executor.run(c) for c in calls]
    for reset in resets:
        reset()
    for step in range(n):
        route()
        g.replay()
        torch.cuda.synchronize()
        yield step, outs


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_executor_fill_steps_in_a_graph_equal_stock(overlap, monkeypatch,
                                                           published_server_args):
    """Decode steps of the fill policy through ``DecodeExecutor`` captured in a CUDA graph,
    over a cache smaller than the layers' experts (misses, fills and evictions every step),
    with the decision on a side stream beside the alignment (``OVERLAP_DECISION``) or before
    it: each replay's valid rows equal SGLang's ``fused_experts`` on the layer's own weights
    bit for bit (a padded row routes anywhere), and every owned slot holds its owner's row;
    two eager steps first, the same."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from freetoken_sglang.cache.fills import Filler
    from freetoken_sglang.cache.residency import FILL_ALL, ResidencyState
    from freetoken_sglang.execute import decode
    from freetoken_sglang.execute.contract import LayerCall

    monkeypatch.setattr(decode, "OVERLAP_DECISION", overlap)
    L, E, H, I, T, k, S, bf16 = 3, 16, 512, 256, 4, 4, 20, torch.bfloat16
    pool = _pinned_random_pool(L, E, H, I)
    gen = torch.Generator().manual_seed(6)
    slots = {n: torch.zeros(S, *sp.shape, dtype=sp.dtype, device="cuda")
             for n, sp in pool.specs.items()}
    filler = Filler(pool.banks, pool.device_banks, slots)
    state = ResidencyState(L * E, S, "cuda")
    counters = torch.zeros(5, L, dtype=torch.int64, device="cuda")
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k, params_dtype=bf16,
                          activation="silu", inplace=False)
    x = torch.zeros(T, H, device="cuda", dtype=bf16)
    ids = torch.zeros(L, T, k, device="cuda", dtype=torch.int32)
    w = torch.zeros(L, T, k, device="cuda")
    nv = torch.tensor([T - 1], dtype=torch.int32, device="cuda")  # row T-1 is padding
    layers = [SimpleNamespace(moe_runner_config=cfg, w13_weight=pool.layer_rows("w13_weight", l),
                              w2_weight=pool.layer_rows("w2_weight", l)) for l in range(L)]
    calls = [LayerCall(layer=layers[l], ordinal=l, x=x, topk_weights=w[l], topk_ids=ids[l],
                       topk_output=None) for l in range(L)]
    executor = decode.DecodeExecutor(_stand_in_runtime(state, E, slots, filler, FILL_ALL,
                                                       counters, nv, None))
    rng = random.Random(7)

    def route():
        ids.copy_(torch.tensor([[rng.sample(range(E), k) for _ in range(T)] for _ in range(L)]))
        w.copy_(torch.rand(L, T, k, generator=gen))
        x.copy_(torch.randn(T, H, generator=gen).to(bf16))

    slots_w = {n: b.cuda() for n, b in pool.banks.items()}
    logits = torch.zeros(T, E, device="cuda")

    def check(outs, step):
        for l in range(L):
            want = fused_experts(x.clone(), slots_w["w13_weight"][l * E:(l + 1) * E],
                                 slots_w["w2_weight"][l * E:(l + 1) * E],
                                 StandardTopKOutput(w[l], ids[l], logits), cfg)
            assert torch.equal(outs[l][: T - 1], want[: T - 1]), (step, l)
        for s, o in enumerate(state.owner[:S].tolist()):
            if o >= 0:
                for n in pool.banks:
                    assert torch.equal(slots[n][s].cpu(), pool.banks[n][o]), (step, s, o)

    for step in range(2):  # eager first (the kernels compile outside the capture)
        route()
        outs = [executor.run(c) for c in calls]
        torch.cuda.synchronize()
        check(outs, -1 - step)
    assert (executor._side is not None) == overlap
    for step, outs in _replayed_steps(executor, calls, route, (state.reset, counters.zero_), 8):
        check(outs, step)
    assert counters[2].sum().item() > 0 and counters[3].sum().item() > 0  # fills, evictions
    pool.unpin()


@pytest.mark.parametrize("rule", ["admit_reuse", "fill_reused", "return_rule"])
def test_qstar_decision_beside_the_alignment_changes_no_output(rule, monkeypatch,
                                                               published_server_args):
    """q* steps through ``DecodeExecutor`` with the doorbell, captured in a CUDA graph over a
    cache smaller than the layers' experts (fills, evictions and CPU experts every step, a
    padded row): with the decision beside the alignment of the router's ids
    (``OVERLAP_CPU_POLICIES``), with the CPU entries computed against the null slot
    (``CPU_ENTRIES_READ_NULL_SLOT``) and with both, every replay's valid rows, the counters
    and the CPU calls served equal those with the decision first and the CPU entries skipped
    by ``filter_expert``, bit for bit (a CPU expert's blocks zeroed, not computed from slot
    0)."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    from freetoken_sglang.cache.fills import Filler
    from freetoken_sglang.cache.residency import MissSplit, ResidencyState
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute import decode
    from freetoken_sglang.execute.contract import LayerCall

    L, E, H, I, T, k, S, bf16 = 3, 16, 2048, 128, 4, 4, 20, torch.bfloat16
    pool = _pinned_random_pool(L, E, H, I)
    extra = dict(fill_us=200.0, cpu_us=100.0) if rule == "return_rule" else {}
    split = MissSplit(0.5, 1, **{rule: True}, **extra)
    assert split.may_run_cpu and not split.late_fill
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k, params_dtype=bf16,
                          activation="silu", inplace=False)
    layers = [SimpleNamespace(moe_runner_config=cfg, w13_weight=pool.layer_rows("w13_weight", l),
                              w2_weight=pool.layer_rows("w2_weight", l)) for l in range(L)]

    def steps(overlap, null):
        monkeypatch.setattr(decode, "OVERLAP_CPU_POLICIES", overlap)
        monkeypatch.setattr(decode, "CPU_ENTRIES_READ_NULL_SLOT", null)
        with_null = {n: torch.zeros(S + 1, *sp.shape, dtype=sp.dtype, device="cuda")
                     for n, sp in pool.specs.items()}
        slots = {n: b[:S] for n, b in with_null.items()}
        filler = Filler(pool.banks, pool.device_banks, slots)
        state = ResidencyState(L * E, S, "cuda")
        counters = torch.zeros(5, L, dtype=torch.int64, device="cuda")
        x = torch.zeros(T, H, device="cuda", dtype=bf16)
        ids = torch.zeros(L, T, k, device="cuda", dtype=torch.int32)
        w = torch.zeros(L, T, k, device="cuda")
        nv = torch.tensor([T - 1], dtype=torch.int32, device="cuda")  # row T-1 is padding
        calls = [LayerCall(layer=layers[l], ordinal=l, x=x, topk_weights=w[l],
                           topk_ids=ids[l], topk_output=None) for l in range(L)]
        rng, gen = random.Random(7), torch.Generator().manual_seed(9)

        def route():
            ids.copy_(torch.tensor([[rng.sample(range(E), k) for _ in range(T)]
                                    for _ in range(L)]))
            w.copy_(torch.rand(L, T, k, generator=gen))
            x.copy_(torch.randn(T, H, generator=gen).to(bf16))

        got = []
        with CpuExpertExecutor(pool.banks, num_threads=4) as ex:
            branch = CpuBranch(ex, torch.device("cuda"), H, k, bf16, max_rows=T)
            assert branch.mode == "doorbell" and branch.fold
            executor = decode.DecodeExecutor(_stand_in_runtime(state, E, slots, filler, split,
                                                               counters, nv, branch, with_null))
            try:
                route()
                for c in calls:  # eager first: the kernels compile outside the capture
                    executor.run(c)
                torch.cuda.synchronize()
                for _, outs in _replayed_steps(executor, calls, route,
                                               (state.reset, counters.zero_), 6):
                    got.append([o[: T - 1].cpu() for o in outs])
                branch.check()
                assert (executor._side is not None) == overlap
                served = branch.doorbell.served
            finally:
                branch.close()
        assert all(b[S].eq(0).all() for b in with_null.values())  # the null slot stays zero
        return got, counters.cpu(), served

    want, want_counters, want_served = steps(False, False)
    for overlap, null in ((True, False), (False, True), (True, True)):
        got, got_counters, got_served = steps(overlap, null)
        for step, (a, b) in enumerate(zip(got, want)):
            for l in range(L):
                assert torch.equal(a[l], b[l]), (overlap, null, step, l)
        assert torch.equal(got_counters, want_counters) and got_served == want_served
    assert want_counters[2].sum() > 0 and want_counters[3].sum() > 0  # fills, evictions
    assert want_counters[4].sum() > 0  # CPU experts
    pool.unpin()


@pytest.mark.parametrize("label", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_fp4_slots_match_sglang_over_the_dequantized_experts(label, num_tokens, monkeypatch,
                                                             published_server_args):
    """FP4 slots (execute/slot_moe.py's dequantized path): the call's distinct experts are
    dequantized from random slots and SGLang's unquantized Triton sequence runs over them.
    One pass: bit-identical to SGLang's ``fused_experts`` over the dequantized layer; several
    passes (a small pass budget): equal within bf16 rounding of the summed partials. The
    direct kernels (``kernels/fp4_moe.py``) on the same calls: within 2 bf16 ulps of it.
    ``test_fp4_slots_interpreter.py`` runs one case in Triton's interpreter."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts

    check_fp4_slots(label, num_tokens, "cuda", fused_experts, monkeypatch)


def check_fp4_slots(label, num_tokens, device, fused_experts, monkeypatch):
    """The body of ``test_fp4_slots_match_sglang_over_the_dequantized_experts`` on ``device``,
    against ``fused_experts(x, w13, w2, topk_output, config, b1=, b2=)``."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from freetoken_sglang.execute import slot_moe
    from freetoken_sglang.experts.formats import FORMATS

    monkeypatch.setattr(slot_moe, "DIRECT_FP4_MAX_PAIRS", 0)  # the dequantized path only
    torch.manual_seed(num_tokens)
    fmt = FORMATS[label]
    E, H, I, k, S = 16, 256, 128, 4, 40
    u8 = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
    e8m0 = lambda *shape: torch.randint(118, 124, shape, dtype=torch.uint8, device=device)
    if label == "mxfp4":  # GPT-OSS: biases, clamped SwiGLU, interleaved gate/up
        banks = {"w13_weight": u8(E, 2 * I, H // 2),
                 "w13_weight_scale": e8m0(E, 2 * I, H // 32),
                 "w13_weight_bias": torch.randn(E, 2 * I, device=device).to(torch.bfloat16),
                 "w2_weight": u8(E, H, I // 2),
                 "w2_weight_scale": e8m0(E, H, I // 32),
                 "w2_weight_bias": torch.randn(E, H, device=device).to(torch.bfloat16)}
        extra = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    else:
        e4m3 = lambda *shape: (torch.rand(*shape, device=device) * 0.5 + 0.05).to(
            torch.float8_e4m3fn)
        banks = {"w13_weight": u8(E, 2 * I, H // 2), "w2_weight": u8(E, H, I // 2),
                 "w13_weight_scale": e4m3(E, 2 * I, H // 16),
                 "w2_weight_scale": e4m3(E, H, I // 16),
                 "w13_weight_scale_2": torch.rand(E, 2, device=device) * 0.1 + 0.01,
                 "w2_weight_scale_2": torch.rand(E, device=device) * 0.1 + 0.01}
        extra = dict(routed_scaling_factor=1.5)
    w13, w2 = fmt.dequantize(None, banks, torch.bfloat16)
    cfg = MoeRunnerConfig(
        num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
        top_k=k, params_dtype=torch.bfloat16, activation="silu", inplace=False, **extra)
    x = torch.randn(num_tokens, H, device=device, dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, E, device=device)
    weights, ids = torch.topk(logits.softmax(-1), k)
    ids = ids.to(torch.int32)
    want = fused_experts(x.clone(), w13, w2, StandardTopKOutput(weights, ids, logits), cfg,
                         b1=banks.get("w13_weight_bias"), b2=banks.get("w2_weight_bias"))
    perm = torch.randperm(S, device=device)[:E].to(torch.int32)
    slots = {}
    for name, b in banks.items():
        slots[name] = torch.zeros(S, *b.shape[1:], dtype=b.dtype, device=device)
        slots[name][perm.long()] = b
    method = SimpleNamespace(format=fmt, base_method=None, triton_quant=fmt.triton(None))
    layer = SimpleNamespace(moe_runner_config=cfg, quant_method=method,
                            w13_weight=banks["w13_weight"], w2_weight=banks["w2_weight"])
    got = slot_moe.run_on_slots_triton(layer, x.clone(), weights, ids, perm, slots)
    assert torch.equal(got, want)
    xi = x.clone()  # in place: the result is written into the activations
    got = slot_moe.run_on_slots_triton(layer, xi, weights, ids, perm, slots, inplace=True)
    assert got.data_ptr() == xi.data_ptr() and torch.equal(got, want)
    monkeypatch.setattr(slot_moe, "DEQUANTIZED_PASS_BYTES", 3 * 3 * I * H * 2)  # 3 experts
    got = slot_moe.run_on_slots_triton(layer, x.clone(), weights, ids, perm, slots)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    xi = x.clone()
    got = slot_moe.run_on_slots_triton(layer, xi, weights, ids, perm, slots, inplace=True)
    assert got.data_ptr() == xi.data_ptr()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    # Entries at -1 (served on the CPU) contribute nothing.
    drop = torch.zeros_like(ids, dtype=torch.bool)
    drop[:, 0] = True
    partial = slot_moe.run_on_slots_triton(layer, x.clone(), weights, ids.masked_fill(drop, -1),
                                           perm, slots, skip_negative_ids=True)
    want_partial = fused_experts(
        x.clone(), w13, w2, StandardTopKOutput(weights.masked_fill(drop, 0), ids, logits), cfg,
        b1=banks.get("w13_weight_bias"), b2=banks.get("w2_weight_bias"))
    torch.testing.assert_close(partial, want_partial, rtol=2e-2, atol=2e-2)
    # The direct kernels (kernels/fp4_moe.py, any T*k here): SGLang's rounding points over
    # the same dequantized weights, another fp32 accumulation order (and on the GPU, other
    # approximations of exp in the activation)
    ulps = 3 if device == "cuda" else 1
    monkeypatch.setattr(slot_moe, "DIRECT_FP4_MAX_PAIRS", 1 << 30)
    monkeypatch.setattr(slot_moe, "_run_dequantized", None)  # fails if dispatched there
    got = slot_moe.run_on_slots_triton(layer, x.clone(), weights, ids, perm, slots)
    assert_within_bf16_ulps(got, want, ulps, "the direct kernels' accumulation order")
    partial = slot_moe.run_on_slots_triton(layer, x.clone(), weights, ids.masked_fill(drop, -1),
                                           perm, slots, skip_negative_ids=True)
    assert_within_bf16_ulps(partial, want_partial, ulps, "the direct kernels, -1 entries")


def fp4_case(label, num_tokens, device, k=4, seed=0, dtype=torch.bfloat16, **config):
    """A small FP4 MoE call over slots, for the direct kernels' checks: ``label`` "mxfp4"
    (GPT-OSS: biases, SwiGLU with alpha 1.702 and limit 7, interleaved gate/up) or "nvfp4"
    (silu, routed_scaling_factor 1.5), ``config`` overriding ``MoeRunnerConfig`` fields;
    odd-ish H and I, experts in random slots of a larger bank, entry [0, 1] at -1 (served
    elsewhere). Returns a namespace: ``layer``, ``x`` (``dtype``), ``weights``, ``ids``,
    ``layer_slots``, ``slots`` (the banks), ``fmt``."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    from freetoken_sglang.experts.formats import FORMATS

    g = torch.Generator().manual_seed(seed * 100 + num_tokens)
    E, S, (H, I) = 8, 11, ((160, 96) if label == "mxfp4" else (144, 80))
    u8 = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    rand = lambda *shape: torch.rand(*shape, generator=g)
    slots = {"w13_weight": u8(S, 2 * I, H // 2), "w2_weight": u8(S, H, I // 2)}
    if label == "mxfp4":
        for p, (r, c) in (("w13", (2 * I, H)), ("w2", (H, I))):
            slots[f"{p}_weight_scale"] = torch.randint(118, 124, (S, r, c // 32),
                                                       dtype=torch.uint8, generator=g)
            slots[f"{p}_weight_bias"] = torch.randn(S, r, generator=g).to(torch.bfloat16)
        extra = dict(gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    else:
        for p, (r, c) in (("w13", (2 * I, H)), ("w2", (H, I))):
            slots[f"{p}_weight_scale"] = (rand(S, r, c // 16) * 0.5 + 0.05).to(
                torch.float8_e4m3fn)
        slots["w13_weight_scale_2"] = rand(S, 2) * 0.1 + 0.01
        slots["w2_weight_scale_2"] = rand(S) * 0.1 + 0.01
        extra = dict(routed_scaling_factor=1.5)
    fmt = FORMATS[label]
    cfg = MoeRunnerConfig(
        num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
        top_k=k, params_dtype=dtype, activation="silu", inplace=False, **{**extra, **config})
    layer = SimpleNamespace(
        moe_runner_config=cfg, w13_weight=torch.empty(E, 2 * I, H // 2, dtype=torch.uint8),
        w2_weight=torch.empty(E, H, I // 2, dtype=torch.uint8),
        quant_method=SimpleNamespace(format=fmt, base_method=None, triton_quant=fmt.triton(None)))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(num_tokens)]).int()
    ids[0, 1] = -1
    case = SimpleNamespace(
        fmt=fmt, layer=layer, x=torch.randn(num_tokens, H, generator=g).to(dtype),
        weights=rand(num_tokens, k), ids=ids,
        layer_slots=torch.randperm(S, generator=g)[:E].int(), slots=slots)
    for name in ("x", "weights", "ids", "layer_slots"):
        setattr(case, name, getattr(case, name).to(device))
    case.slots = {n: b.to(device) for n, b in slots.items()}
    return case


def fp4_reference(case):
    """float64 reference of the call, from the definitions: the experts dequantized by the
    format's own ``dequantize`` (to the activation dtype, as the GPU path reads them), GEMM1
    + bias (times the router weight if on input) rounded to the dtype, the activation (GPT-OSS
    SwiGLU, silu * up, or silu clamped * up) rounded, each expert's GEMM2 + bias times its
    router weight rounded, their sum times routed_scaling_factor rounded: SGLang's rounding
    points. -1 entries contribute nothing."""
    cfg = case.layer.moe_runner_config
    dtype = case.x.dtype
    banks = {n: b.cpu() for n, b in case.slots.items()}
    w13, w2 = (w.double() for w in case.fmt.dequantize(None, banks, dtype))
    b13, b2 = (banks[n].double() if n in banks else None
               for n in ("w13_weight_bias", "w2_weight_bias"))
    rnd = lambda v: v.to(dtype).double()
    x, weights, ids = case.x.cpu().double(), case.weights.cpu().double(), case.ids.cpu()
    slot_of = case.layer_slots.cpu()
    I, limit = w2.shape[2], cfg.gemm1_clamp_limit
    on_input = cfg.apply_router_weight_on_input
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            if ids[t, j] < 0:
                continue
            s = int(slot_of[ids[t, j]])
            h = w13[s] @ x[t] + (b13[s] if b13 is not None else 0)
            h = rnd(h * weights[t, j] if on_input else h)
            interleaved = cfg.gemm1_alpha is not None and cfg.gate_up_interleaved
            gate, up = (h[0::2], h[1::2]) if interleaved else (h[:I], h[I:])
            if cfg.gemm1_alpha is not None:  # swiglu_gpt_oss_sigmoid_alpha (or not interleaved)
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                a = gate * torch.sigmoid(gate * cfg.gemm1_alpha) * (up + 1)
            elif limit is not None:  # _swiglu_silu_clamp_mul
                a = torch.nn.functional.silu(gate).clamp(max=limit) * up.clamp(-limit, limit)
            else:  # silu_and_mul
                a = torch.nn.functional.silu(gate) * up
            y = w2[s] @ rnd(a) + (b2[s] if b2 is not None else 0)
            out[t] += rnd(y if on_input else y * weights[t, j])
    return rnd(out * (cfg.routed_scaling_factor or 1.0))


def assert_within_bf16_ulps(got, want, ulps, why):
    """|got - want| <= ulps bf16 ulps of |want| elementwise, and of max |want| / 8 near zero
    (where the sum cancels, the rounding errors are those of the k expert outputs)."""
    got, want = got.double().cpu(), want.double().cpu()
    floor = want.abs().max() / 8
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp(min=floor))) - 7)
    worst = ((got - want).abs() / ulp).max().item()
    assert worst <= ulps, f"{worst:.2f} bf16 ulps apart (at most {ulps}: {why})"


@pytest.mark.parametrize("label", ["mxfp4", "nvfp4"])
def test_fp4_direct_kernels_match_the_dequantized_path(label, monkeypatch,
                                                      published_server_args):
    """The direct FP4 kernels (``kernels/fp4_moe.py``, what ``run_on_slots_triton`` runs for
    T*k <= ``DIRECT_FP4_MAX_PAIRS``) against the dequantized path (``_run_dequantized``:
    SGLang's kernels over the dequantized experts), eager (T = 1, 3, 8, a -1 entry) and
    replayed from a captured CUDA graph with other routing: within 3 bf16 ulps of it and 2 of
    the float64 reference of the definitions (the same rounding points; only the fp32
    accumulation order and exp's approximation differ; Triton's interpreter, where both
    paths compute exactly, finds them bit-identical: ``test_fp4_slots_interpreter.py``)."""
    from freetoken_sglang.execute import slot_moe

    def call(c, direct, x=None, inplace=None):
        monkeypatch.setattr(slot_moe, "DIRECT_FP4_MAX_PAIRS", 32 if direct else 0)
        return slot_moe.run_on_slots_triton(c.layer, c.x if x is None else x, c.weights,
                                            c.ids, c.layer_slots, c.slots,
                                            skip_negative_ids=True, inplace=inplace)

    for T in (1, 3, 8):
        c = fp4_case(label, T, "cuda")
        got, want = call(c, True), call(c, False)
        assert_within_bf16_ulps(got, want, 3, "the direct kernels' accumulation order")
        assert_within_bf16_ulps(got, fp4_reference(c), 2, "fp32 against float64 sums")
        xi = c.x.clone()  # in place: written into the activations
        out = call(c, True, x=xi, inplace=True)
        assert out.data_ptr() == xi.data_ptr() and torch.equal(out, got)
    for direct in (True, False):  # captured: other routed ids, weights and x per replay
        c = fp4_case(label, 3, "cuda")
        call(c, direct)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = call(c, direct)
        for seed in (1, 2):
            other = fp4_case(label, 3, "cuda", seed=seed)
            for name in ("x", "weights", "ids", "layer_slots"):
                getattr(c, name).copy_(getattr(other, name))
            graph.replay()
            assert torch.equal(out, call(c, direct))  # the replay is the eager call
            assert_within_bf16_ulps(out, fp4_reference(c), 2, "fp32 against float64 sums")


@pytest.mark.parametrize("direct", [True, False])
def test_fp4_slots_in_a_cuda_graph(direct, monkeypatch, published_server_args):
    """The FP4 paths (direct kernels, T*k within ``DIRECT_FP4_MAX_PAIRS``, and dequantized)
    captured in a CUDA graph (as decode graphs capture them) and replayed with other routed
    ids, -1 entries and unread experts whose slot is -1: equal to the eager call on the same
    inputs."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    from freetoken_sglang.execute import slot_moe
    from freetoken_sglang.experts.formats import FORMATS

    if not direct:
        monkeypatch.setattr(slot_moe, "DIRECT_FP4_MAX_PAIRS", 0)
    torch.manual_seed(0)
    fmt = FORMATS["nvfp4"]
    E, H, I, k, S, T = 16, 256, 128, 4, 24, 3
    u8 = lambda *shape: torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
    e4m3 = lambda *shape: (torch.rand(*shape, device="cuda") * 0.5 + 0.05).to(torch.float8_e4m3fn)
    slots = {"w13_weight": u8(S, 2 * I, H // 2), "w2_weight": u8(S, H, I // 2),
             "w13_weight_scale": e4m3(S, 2 * I, H // 16), "w2_weight_scale": e4m3(S, H, I // 16),
             "w13_weight_scale_2": torch.rand(S, 2, device="cuda") * 0.1 + 0.01,
             "w2_weight_scale_2": torch.rand(S, device="cuda") * 0.1 + 0.01}
    cfg = MoeRunnerConfig(
        num_experts=E, num_local_experts=E, hidden_size=H, intermediate_size_per_partition=I,
        top_k=k, params_dtype=torch.bfloat16, activation="silu", inplace=False)
    layer = SimpleNamespace(
        moe_runner_config=cfg, w13_weight=torch.empty(E, 2 * I, H // 2, dtype=torch.uint8),
        w2_weight=torch.empty(E, H, I // 2, dtype=torch.uint8),
        quant_method=SimpleNamespace(format=fmt, base_method=None, triton_quant=fmt.triton(None)))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    weights = torch.rand(T, k, device="cuda")
    ids = torch.zeros(T, k, dtype=torch.int32, device="cuda")
    layer_slots = torch.full((E,), -1, dtype=torch.int32, device="cuda")

    def route(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        ids.copy_(torch.randperm(E, generator=g, device="cuda")[:T * k].view(T, k))
        ids[0, 0] = -1  # served elsewhere
        layer_slots.fill_(-1)
        used = ids[ids >= 0].long()
        layer_slots[used] = torch.randperm(S, generator=g, device="cuda")[:used.numel()].int()

    def call():
        return slot_moe.run_on_slots_triton(layer, x, weights, ids, layer_slots, slots,
                                            skip_negative_ids=True, inplace=False)

    route(1)
    call()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (2, 3, 4):
        route(seed)
        graph.replay()
        assert torch.equal(out, call())


def test_cpu_branch_host_function_in_a_cuda_graph():
    """The host-node CPU branch runs the C executor from a host-function node: eagerly and replayed
    from a captured graph, with the same result as a direct call."""
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.cache.residency import CpuWork

    H, I, k = 256, 128, 2
    pool = HostExpertPool([0], 8, bank_specs_for_layer(H, I, torch.bfloat16))
    for bank in pool.banks.values():
        bank.copy_((torch.randn(bank.shape) * 0.05).to(bank.dtype))
    with CpuExpertExecutor(pool.banks, num_threads=4) as ex:
        branch = CpuBranch(ex, torch.device("cuda"), H, k, torch.bfloat16, max_rows=4,
                           mode="host-node")
        x = torch.randn(3, H, device="cuda", dtype=torch.bfloat16)
        work = CpuWork(
            rows=torch.tensor([0, 2, 2, 0, 0, 0], dtype=torch.int32, device="cuda"),
            experts=torch.tensor([5, 1, 7, 0, 0, 0], dtype=torch.int32, device="cuda"),
            weights=torch.tensor([0.5, 0.25, 1.0, 0, 0, 0], device="cuda"),
            count=torch.tensor([3], dtype=torch.int32, device="cuda"),
        )
        want = torch.zeros(3, H, dtype=torch.float32)
        ex.run(x.cpu(), work.rows[:3].cpu(), work.experts[:3].cpu(), work.weights[:3].cpu(), want)
        gpu_out = torch.zeros(3, H, device="cuda", dtype=torch.float32)
        branch.launch(x, work)
        got = branch.merge(gpu_out.clone())
        torch.cuda.synchronize()
        torch.testing.assert_close(got.cpu(), want)
        g = torch.cuda.CUDAGraph()
        static_out = torch.zeros(3, H, device="cuda", dtype=torch.float32)
        with torch.cuda.graph(g):
            branch.launch(x, work)
            res = branch.merge(static_out)
        x.copy_(torch.randn(3, H, device="cuda", dtype=torch.bfloat16))
        static_out.zero_()
        g.replay()
        torch.cuda.synchronize()
        want2 = torch.zeros(3, H, dtype=torch.float32)
        ex.run(x.cpu(), work.rows[:3].cpu(), work.experts[:3].cpu(), work.weights[:3].cpu(), want2)
        torch.testing.assert_close(res.cpu(), want2)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("top_k", [4, 2])
def test_cpu_branch_doorbell_runs_only_with_cpu_items(top_k, overlap, monkeypatch,
                                                      published_server_args):
    """The doorbell branch through the decode executor (one layer, experts 0-3 resident, every
    miss on the CPU): eagerly and replayed from a captured graph, calls with and without CPU
    items alternating, the decision kernel posts (the thread serves, the ring moves) only on
    calls with items, and the output is exact. With items: at top-4 SGLang's own expert
    outputs (its ``intermediate_cache3``, captured) summed in fp32, plus the executor's fp32
    partial, rounded once (the merge folded into our sum, ``CpuBranch.merging_reduce``); at
    top-2 (where, at scale 1, SGLang adds the two outputs itself) SGLang's output plus the
    partial (the separate merge kernel); with ``fold`` off (the separate kernels) the latter
    form too. Without items: exactly SGLang's own output (at top-4 our sum against
    SGLang's, fp32 in another order: equal unless a sum is inexact in fp32 and that changes
    its bf16 rounding). With ``overlap`` (``OVERLAP_CPU_POLICIES``) the folded calls run the
    decision beside the alignment of the router's ids: the same outputs."""
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    from freetoken_sglang.cache.residency import MissSplit, ResidencyState
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute.contract import LayerCall
    from freetoken_sglang.execute import decode
    from freetoken_sglang.execute.decode import DecodeExecutor
    from freetoken_sglang.execute.slot_moe import run_on_slots_triton
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.kernels.fill import copy_rows_banks
    from freetoken_sglang.patches.fused_moe import sum_reduce_replaced

    monkeypatch.setattr(decode, "OVERLAP_CPU_POLICIES", overlap)

    E, H, I, T, k, bf16 = 8, 2048, 128, 3, top_k, torch.bfloat16
    torch.manual_seed(k)
    pool = HostExpertPool([0], E, bank_specs_for_layer(H, I, bf16))
    for bank in pool.banks.values():
        bank.copy_((torch.randn(bank.shape) * 0.05).to(bank.dtype))
    slots = {n: b.cuda() for n, b in pool.banks.items()}  # slot e holds expert e
    state = ResidencyState(E, E, "cuda")
    state.make_all_resident()
    state.residency[4:E] = -1  # experts 4-7 miss (no fill under MissSplit(0, 0))
    state.owner[4:E] = -1
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k, params_dtype=bf16,
                          activation="silu", inplace=False)
    layer = SimpleNamespace(moe_runner_config=cfg, w13_weight=pool.layer_rows("w13_weight", 0),
                            w2_weight=pool.layer_rows("w2_weight", 0))
    x = torch.zeros(T, H, device="cuda", dtype=bf16)
    ids = torch.zeros(T, k, device="cuda", dtype=torch.int32)
    w = torch.zeros(T, k, device="cuda")
    call = LayerCall(layer=layer, ordinal=0, x=x, topk_weights=w, topk_ids=ids, topk_output=None)
    counters = torch.zeros(5, 1, dtype=torch.int64, device="cuda")

    def route(with_items, seed):
        g = torch.Generator().manual_seed(seed)
        while True:
            r = torch.stack([torch.randperm(E if with_items else 4, generator=g)[:k]
                             for _ in range(T)])
            if bool((r >= 4).any()) == with_items:
                break
        ids.copy_(r)
        w.copy_(torch.rand(T, k, generator=g))
        x.copy_(torch.randn(T, H, generator=g).to(bf16))

    def fill_nothing(plan, remap=None):
        # the fill kernel itself (its plans are empty: MissSplit(0, 0)), remap and all
        copy_rows_banks([slots[n] for n in slots], [slots[n] for n in slots], plan.src,
                        plan.dst, plan.count, remap=remap)

    with CpuExpertExecutor(pool.banks, num_threads=4) as ex:
        branch = CpuBranch(ex, torch.device("cuda"), H, k, bf16, max_rows=4)
        assert branch.mode == "doorbell" and branch.fold
        rt = SimpleNamespace(
            cache=SimpleNamespace(residency=state, num_experts=E, slot_banks=slots,
                                  late=SimpleNamespace(pending=False),
                                  filler=SimpleNamespace(run=fill_nothing)),
            split_for=lambda rows: MissSplit(0.0, 0), is_decode_sized=lambda rows: True,
            counters=SimpleNamespace(of_phase=lambda phase: counters),
            num_valid=torch.tensor([T], dtype=torch.int32, device="cuda"), cpu_branch=branch)
        executor = DecodeExecutor(rt)

        def expected(folded):
            """What the executor must return for the current routing, and its item count."""
            seen = []

            def spy(original):
                def reduce(expert_out, out, scale):
                    seen.append((expert_out.clone(), scale))
                    return original(expert_out, out, scale)
                return reduce

            with sum_reduce_replaced(spy):  # SGLang's own MoE over the GPU entries
                own = run_on_slots_triton(layer, x, w, torch.where(ids >= 4, -1, ids),
                                          state.layer_slots(0, E), slots,
                                          skip_negative_ids=True)
            assert len(seen) == (1 if k > 2 else 0)  # top-2 at scale 1: SGLang's own add
            r, c = (ids >= 4).cpu().nonzero(as_tuple=True)  # row-major, as the kernel emits
            partial = torch.zeros(T, H)
            if r.numel():
                ex.run(x.cpu(), r.int(), ids.cpu()[r, c], w.cpu()[r, c], partial)
            else:
                return own.cpu(), 0
            if folded and seen:
                expert_out, scale = seen[0]
                acc = expert_out[:, 0].float()
                for j in range(1, k):
                    acc = acc + expert_out[:, j].float()
                return (acc * scale).cpu().add_(partial).to(bf16), r.numel()
            return own.float().cpu().add_(partial).to(bf16), r.numel()

        ring = lambda: int(branch.hdr_host[0])  # noqa: E731
        try:
            served = 0
            for step, (with_items, fold) in enumerate([(True, True), (False, True),
                                                       (True, False), (False, False)]):
                branch.fold = fold
                route(with_items, step)
                got = executor.run(call)
                torch.cuda.synchronize()
                want, n = expected(fold)
                assert (n > 0) == with_items
                assert torch.equal(got.cpu(), want), (step, with_items, fold)
                served += with_items
                assert branch.doorbell.served == served and ring() == served == int(branch.seq_dev)
            branch.fold = True
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                static = executor.run(call)
            for i in range(12):
                with_items = i % 3 != 1
                route(with_items, 100 + i)
                g.replay()
                torch.cuda.synchronize()
                want, n = expected(True)
                assert (n > 0) == with_items
                assert torch.equal(static.cpu(), want), i
                served += with_items
                assert branch.doorbell.served == served and ring() == served, i
            assert int(counters[4].sum()) > 0 and int(counters[2].sum()) == 0
            assert (executor._side is not None) == overlap
            branch.check()
        finally:
            branch.close()


@pytest.mark.parametrize("chunk_states", [True, False])
def test_anchor_states_inside_a_forward_from_the_triton_kernels(monkeypatch, chunk_states):
    """``anchors.inside.replay`` over SGLang's Triton conv and chunked gated delta rule: the
    anchor states from the kernel's chunk-start states (BF16) and from the segment replay
    against the recurrence run to each anchor (``test_anchors.check_inside_states``)."""
    from test_anchors import check_inside_states

    check_inside_states(monkeypatch, chunk_states, "cuda", rtol=2e-2)
