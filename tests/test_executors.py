"""The executors behind the contract (``execute/``), in process on the CPU: streamed prefill
and waves give SGLang's own native MoE output over the layer's weights, and leave the LRU
(residency, owners, recency keys, clock) exactly as it was; plus the rules that pick them:
the slot layout, the streaming crossover and the chunk size, with stated inputs and outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from freetoken_sglang.cache.layout import plan_layout
from freetoken_sglang.execute.choice import (
    STREAM_MIN_EXPERT_FRACTION,
    ExecutorChoice,
    choose_chunked_prefill_size,
    expected_distinct_experts,
    stream_min_rows,
)


def test_crossover_rule():
    # The fewest rows expected to route to 75% of the layer's experts (uniform routing).
    assert STREAM_MIN_EXPERT_FRACTION == 0.75
    assert stream_min_rows(128, 8) == 22  # Qwen3-30B-A3B
    assert stream_min_rows(8, 2) == 5
    assert stream_min_rows(16, 4) == 5
    assert stream_min_rows(256, 8) == 44
    assert stream_min_rows(4, 4) == 1
    assert stream_min_rows(128, 8, fraction=0.9) == 36
    for E, k in ((128, 8), (8, 2), (64, 6)):
        n = stream_min_rows(E, k)
        assert expected_distinct_experts(n, E, k) >= 0.75 * E
        assert expected_distinct_experts(n - 1, E, k) < 0.75 * E
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        stream_min_rows(8, 2, fraction=1.0)
    with pytest.raises(ValueError):
        stream_min_rows(8, 9)


def test_chunk_size_rule():
    # GPU MiB -> chunk: a quarter of the memory for SGLang's 512 MiB + 1.5 MiB/token reserve.
    assert choose_chunked_prefill_size(8192) == 2048  # floor
    assert choose_chunked_prefill_size(24576) == 2048  # 4090: 6144 MiB budget, 4096 needs 6656
    assert choose_chunked_prefill_size(32607) == 4096  # 5090
    assert choose_chunked_prefill_size(81920) == 8192  # H100 80 GB
    assert choose_chunked_prefill_size(143771) == 16384  # H200
    assert choose_chunked_prefill_size(10**7) == 32768  # ceiling
    assert choose_chunked_prefill_size(143771, context_len=4096) == 4096
    assert choose_chunked_prefill_size(143771, context_len=5000) == 8192


def test_slot_layout():
    E, k, rows = 16, 4, 160
    assert plan_layout(160, E, rows, k).kind == "resident"
    s = plan_layout(40, E, rows, k)  # 2E + k = 36 <= 40: double-buffered, borrowed
    assert (s.kind, s.lru_slots, s.buffer_rows, s.buffers, s.total, s.borrowed) == (
        "stream", 40, 0, 2, 40, True)
    with pytest.raises(ValueError):
        s.buffer_base(0, E)
    s = plan_layout(40, E, rows, k, borrow=False)  # reserved after the LRU
    assert (s.kind, s.lru_slots, s.buffer_rows, s.buffers, s.total, s.borrowed) == (
        "stream", 8, 32, 2, 40, False)
    assert s.buffer_base(1, E) == 24
    s = plan_layout(40, E, rows, k, buffers=1, borrow=False)
    assert (s.kind, s.lru_slots, s.buffer_rows) == ("stream", 24, 16)
    s = plan_layout(20, E, rows, k, buffers=1)
    assert (s.kind, s.lru_slots, s.buffers, s.borrowed) == ("stream", 20, 1, True)
    s = plan_layout(35, E, rows, k)  # one short of two layers + k: waves
    assert (s.kind, s.lru_slots, s.buffer_rows) == ("waves", 27, 8)
    s = plan_layout(6, E, rows, k)  # too few for an LRU of k beside a wave buffer
    assert (s.kind, s.lru_slots, s.buffer_rows) == ("waves", 0, 6)
    s = plan_layout(40, E, rows, k, buffers=0)
    assert (s.kind, s.lru_slots, s.buffer_rows) == ("lru", 40, 0)
    with pytest.raises(ValueError):
        plan_layout(3, E, rows, k)


def test_executor_choice():
    c = ExecutorChoice("gpu", "stream", lru_slots=1280, num_experts=128, top_k=8,
                       stream_min_rows=36)
    assert c.executor_for(36, "extend") == "stream"
    assert c.executor_for(35, "extend") == "decode"
    assert c.executor_for(256, "decode") == "decode"  # decode never streams
    tiny = ExecutorChoice("gpu", "stream", lru_slots=8, num_experts=128, top_k=8,
                          stream_min_rows=36)
    assert tiny.executor_for(4, "extend") == "stream"  # 32 distinct > 8 LRU slots
    assert tiny.executor_for(4, "decode") == "waves"  # graph-safe for decode graphs
    w = ExecutorChoice("gpu", "waves", lru_slots=12, num_experts=16, top_k=4,
                       stream_min_rows=9)
    assert w.executor_for(9, "extend") == "waves"
    assert w.executor_for(3, "decode") == "decode"  # 12 distinct at most: fits
    assert w.executor_for(4, "decode") == "waves"
    assert w.executor_for(4, "extend") == "waves"
    lru = ExecutorChoice("gpu", "lru", lru_slots=40, num_experts=16, top_k=4,
                         stream_min_rows=9, prefill="lru")
    assert lru.executor_for(500, "extend") == "decode"
    assert ExecutorChoice("cpu", "waves", 0, 16, 4, 9).executor_for(500, "extend") == "cpu"
    resident = ExecutorChoice("gpu", "resident", 160, 16, 4, 9)
    assert resident.executor_for(500, "extend") == resident.executor_for(1, "decode") == "resident"


# ---- executors over a real pool and cache ----------------------------------------------

L, E, K, H, I = 5, 8, 2, 32, 16


@pytest.fixture(scope="module")
def published(tiny_checkpoint):
    """SGLang's activation ops read config bags that a server publishes at start."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=tiny_checkpoint("qwen3_moe"), device="cpu"), role="test")


def _runtime(num_slots: int, buffers: int = 2, borrow: bool = False):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from freetoken_sglang.cache.slots import ExpertCache
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer

    g = torch.Generator().manual_seed(0)
    pool = HostExpertPool(list(range(L)), E, bank_specs_for_layer(H, I, torch.float32))
    for bank in pool.banks.values():
        bank.copy_(torch.randn(bank.shape, generator=g) * 0.3)
    layout = plan_layout(num_slots, E, pool.num_rows, K, buffers, borrow=borrow)
    cache = ExpertCache(pool, layout, "cpu", null_slots=K)
    rt = SimpleNamespace(cache=cache, num_valid=torch.tensor([0], dtype=torch.int32),
                         capturing=False)
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, top_k=K, activation="silu")
    layers = [
        SimpleNamespace(moe_runner_config=cfg, w13_weight=pool.layer_rows("w13_weight", l),
                        w2_weight=pool.layer_rows("w2_weight", l))
        for l in range(L)
    ]
    return rt, pool, layers


def _call(layer, ordinal, T, seed):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from freetoken_sglang.execute.contract import LayerCall

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=g)
    topk = StandardTopKOutput(w, ids, torch.zeros(T, E))
    return LayerCall(layer=layer, ordinal=ordinal, x=x, topk_weights=w, topk_ids=ids,
                     topk_output=topk)


def _stock(call):
    """SGLang's native MoE over the layer's own [E, ...] weights (what stock computes)."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    layer = SimpleNamespace(num_experts=E, w13_weight=call.layer.w13_weight,
                            w2_weight=call.layer.w2_weight)
    return moe_forward_native(layer, call.x, call.topk_output, call.layer.moe_runner_config)


def _warm_lru(rt, steps=12):
    """Decode-sized layer calls through the LRU (decision and fills), so that some experts
    are resident."""
    from freetoken_sglang.cache.residency import decide

    counters = torch.zeros(5, L, dtype=torch.int64)
    for s in range(steps):
        call = _call(None, s % L, 1, 1000 + s)
        rt.num_valid.fill_(1)
        d = decide(rt.cache.residency, counters, s % L, E, call.topk_ids, call.topk_weights,
                   rt.num_valid)
        rt.cache.filler.run(d.plan)


def _assert_slots_hold_their_owners(rt, pool):
    """Every LRU slot with an owner holds exactly that expert's rows, and the residency
    table points back at it."""
    st = rt.cache.residency
    for s in range(st.num_slots):
        o = int(st.owner[s])
        if o < 0:
            continue
        assert int(st.residency[o]) == s, (s, o)
        for name, bank in rt.cache.slot_banks.items():
            assert torch.equal(bank[s], pool.banks[name][o]), (name, s, o)


def _lru_state(rt):
    r = rt.cache.residency
    return [t.clone() for t in (r.residency, r.owner, r.key, r.clock, r.last_use)]


@pytest.mark.parametrize("buffers", [2, 1])
def test_streamed_prefill_matches_stock_and_leaves_the_lru_alone(buffers, published):
    from freetoken_sglang.execute.prefill_stream import PrefillStreamExecutor

    rt, pool, layers = _runtime(num_slots=2 * E + 6 if buffers == 2 else E + 6, buffers=buffers)
    assert (rt.cache.layout.kind, rt.cache.layout.borrowed) == ("stream", False)
    _warm_lru(rt)
    resident = int((rt.cache.residency.residency[: L * E] >= 0).sum())
    assert resident > 0
    before = _lru_state(rt)
    ex = PrefillStreamExecutor(rt)
    for forward in range(2):  # two forwards: buffers are reused across them
        ex.begin_forward(prefetch=forward == 0)  # the second starts lazily at layer 0
        for l in range(L):
            call = _call(layers[l], l, 40, 10 * forward + l)
            rt.num_valid.fill_(40)
            # (fp32 to rounding: a CPU's matmul kernels may block the two shapes differently)
            torch.testing.assert_close(ex.run(call), _stock(call), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, f=forward, l=l: f"forward {f} layer {l}: {m}")
        ex.end_forward()
    for a, b in zip(before, _lru_state(rt)):
        assert torch.equal(a, b)
    counts = ex.snapshot()
    assert counts["layer_calls"] == 2 * L
    assert counts["experts_reused"] == 2 * resident
    assert counts["experts_streamed"] == 2 * (L * E - resident)
    # While SGLang captures graphs (dummy batches) nothing is copied.
    rt.capturing = True
    ex.reset()
    ex.begin_forward(prefetch=True)
    for l in range(L):
        ex.run(_call(layers[l], l, 40, 99))
    assert ex.snapshot()["experts_streamed"] == 0


@pytest.mark.parametrize("buffers", [2, 1])
def test_borrowed_buffers_evict_the_oldest_and_seed_the_last_layers(buffers, published):
    """Borrowed buffers: a streamed forward matches stock to fp32 rounding, evicts only the LRU's
    ``buffers * E`` oldest entries, leaves every other entry and its recency as it was, and
    gives the buffers back holding the streamed experts of the last ``buffers`` layers as the
    most recent entries (the rest empty, first to be taken)."""
    from freetoken_sglang.execute.prefill_stream import PrefillStreamExecutor

    S = 2 * E + 6 if buffers == 2 else E + 6
    rt, pool, layers = _runtime(num_slots=S, buffers=buffers, borrow=True)
    assert (rt.cache.layout.kind, rt.cache.layout.lru_slots) == ("stream", S)
    _warm_lru(rt, steps=30)
    st = rt.cache.residency
    res0, owner0, key0, clock0, _ = _lru_state(rt)
    n = buffers * E
    lent = sorted(torch.topk(key0, n, largest=False).indices.tolist())
    kept = [s for s in range(S) if s not in lent]
    assert int((owner0[torch.tensor(lent)] >= 0).sum()) > 0  # some lent slots held experts
    ex = PrefillStreamExecutor(rt)
    for forward in range(2):
        ex.begin_forward(prefetch=True)
        if forward == 0:
            assert sorted(ex.buf_host[0] + (ex.buf_host[1] if buffers == 2 else [])) == lent
        for l in range(L):
            call = _call(layers[l], l, 40, 10 * forward + l)
            rt.num_valid.fill_(40)
            # (fp32 to rounding: a CPU's matmul kernels may block the two shapes differently)
            torch.testing.assert_close(ex.run(call), _stock(call), rtol=1e-5, atol=1e-5,
                                       msg=lambda m, f=forward, l=l: f"forward {f} layer {l}: {m}")
        ex.end_forward()
        if forward == 0:
            # Entries outside the lent slots: same expert, same key.
            for s in kept:
                assert int(st.owner[s]) == int(owner0[s]) and int(st.key[s]) == int(key0[s])
            # The lent slots: the streamed (then non-resident) experts of the last layers,
            # newest; the rest empty with never-used keys.
            evicted = {int(owner0[s]) for s in lent if int(owner0[s]) >= 0}
            seeded = 0
            for h in range(L - buffers, L):
                b = h % buffers
                for e in range(E):
                    flat, slot = h * E + e, ex.buf_host[b][e]
                    was = int(res0[flat])
                    if was >= 0 and was not in lent:  # resident: read in place, kept there
                        assert int(st.owner[slot]) == -1 and int(st.residency[flat]) == was
                    else:
                        seeded += 1
                        assert int(st.owner[slot]) == flat and int(st.residency[flat]) == slot
                        assert int(st.key[slot]) == (int(clock0) + 1) * S + slot
                        assert int(st.filled_at[slot]) == int(clock0) + 1  # filled now
            for s in lent:
                if int(st.owner[s]) < 0:
                    assert int(st.key[s]) == s - S and int(st.filled_at[s]) == -2
            # Evicted experts that were not seeded back are gone from the residency table.
            for flat in evicted:
                if int(st.residency[flat]) >= 0:
                    assert flat >= (L - buffers) * E
            counts = ex.snapshot()
            assert counts["lru_evicted"] == len(evicted)
            assert counts["lru_seeded"] == seeded > 0
        _assert_slots_hold_their_owners(rt, pool)
    # A forward that ends early (it raised, or ran only some layers): the buffers go back
    # holding what was last copied into them, never another layer's experts.
    for stop in (1, 2, 3):
        ex.begin_forward(prefetch=True)
        for l in range(stop):
            rt.num_valid.fill_(40)
            ex.run(_call(layers[l], l, 40, 50 + l))
        ex.end_forward()
        assert not ex.lent
        _assert_slots_hold_their_owners(rt, pool)
    # Decode after the prefill: the LRU keeps working over every slot.
    _warm_lru(rt, steps=10)
    _assert_slots_hold_their_owners(rt, pool)
    r = st.residency[: L * E]
    assert all(int(st.owner[int(r[f])]) == f for f in range(L * E) if int(r[f]) >= 0)


def test_prefill_cpu_rule():
    """The balance rule gives the CPU c = round(m * p / (p + h(t))) of m experts, fewer as
    the tokens per expert grow, none without residual host bandwidth; a share is exact."""
    from freetoken_sglang.execute.prefill_cpu_rule import PrefillCpuRule

    # S = 6 MB, B_P = 50, B_H = 150 GB/s: p = 120 us, h0 = 60 us; g = 2 us; k/E = 1/32
    rule = PrefillCpuRule.balanced(6_000_000, 50.0, 150.0, 2.0, 8, 256)
    assert (rule.p_us, rule.h0_us) == (120.0, 60.0)
    assert rule.cpu_count(192, 0) == 128  # 192 * 120 / 180
    assert rule.cpu_count(192, 960) == 96  # t = 30: h = 120
    assert rule.cpu_count(192, 32 * 1000) == 11  # t = 1000: 192 * 120 / 2180 = 10.6
    assert rule.cpu_count(0, 960) == 0
    assert PrefillCpuRule.balanced(6_000_000, 50.0, 50.0, 2.0, 8, 256).cpu_count(192, 1) == 0
    assert PrefillCpuRule(0.5).cpu_count(7, 10**6) == 4 and PrefillCpuRule(1.0).cpu_count(7, 1) == 7
    with pytest.raises(ValueError):
        PrefillCpuRule.balanced(6_000_000, 0.0, 150.0, 2.0, 8, 256)
    # Calibration: p moves half-way to the copies' 100 us per expert, g half-way to the runs'
    # (240 - 60) / 30 = 6 us per item; runs with t < 1 say nothing about g; a share stays.
    cal = rule.calibrated([(1000.0, 10)], [(240.0, 30.0, 4), (500.0, 0.5, 9)])
    assert (cal.p_us, cal.h0_us, cal.g_us) == (110.0, 60.0, 4.0)
    assert rule.calibrated([], []) == rule
    assert PrefillCpuRule(0.5).calibrated([(1.0, 1)], [(1.0, 2.0, 1)]) == PrefillCpuRule(0.5)


@pytest.mark.parametrize("borrow", [True, False])
def test_streamed_prefill_with_a_cpu_share_matches_stock(borrow, published):
    """Half of each layer's non-resident experts run on the C executor instead of streaming:
    the output matches stock, those experts are neither copied nor seeded into the LRU
    (every LRU slot still holds what its owner says), and the counts add up."""
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute.prefill_cpu import PrefillCpuPart
    from freetoken_sglang.execute.prefill_cpu_rule import PrefillCpuRule
    from freetoken_sglang.execute.prefill_stream import PrefillStreamExecutor

    rt, pool, layers = _runtime(num_slots=2 * E + 6, buffers=2, borrow=borrow)
    _warm_lru(rt, steps=30)
    resident = int((rt.cache.residency.residency[: L * E] >= 0).sum())
    with CpuExpertExecutor(pool.banks, num_threads=2) as cpu:
        rt.prefill_cpu_part = PrefillCpuPart(cpu, H, K, torch.float32, "cpu",
                                             PrefillCpuRule(0.5, top_k=K, num_experts=E))
        ex = PrefillStreamExecutor(rt)
        T = 40
        ex.begin_forward(prefetch=True, rows=T)
        for l in range(L):
            call = _call(layers[l], l, T, 70 + l)
            rt.num_valid.fill_(T)
            torch.testing.assert_close(ex.run(call), _stock(call), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, l=l: f"layer {l}: {m}")
        missing = [int((rt.cache.residency.residency[l * E:(l + 1) * E] < 0).sum())
                   for l in range(L)]
        ex.end_forward()
        _assert_slots_hold_their_owners(rt, pool)
        counts = ex.snapshot()
        assert rt.prefill_cpu_part.calls == L and rt.prefill_cpu_part.cpu_s > 0
        if not borrow:  # (borrowing evicts some residents first)
            assert counts["experts_cpu"] == sum(round(m * 0.5) for m in missing) > 0
            assert counts["experts_reused"] == resident
        assert counts["experts_cpu"] > 0
        assert (counts["experts_streamed"] + counts["experts_cpu"]
                + counts["experts_reused"]) == L * E


def test_executor_token_cost_is_measured_once_and_cached(tmp_path):
    """g (us per token-expert item, for the auto rule) is the slope of a call's time over its
    tokens per expert, positive on a real executor, and stored with the machine's profile."""
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.policy import rates

    pool = HostExpertPool(list(range(2)), 16, bank_specs_for_layer(256, 128, torch.bfloat16))
    for bank in pool.banks.values():
        bank.normal_()
    cache = str(tmp_path / "bw.json")
    with CpuExpertExecutor(pool.banks, num_threads=2) as cpu:
        g = rates.resolve_token_cost(pool, cpu, torch.device("cpu"), 256, torch.bfloat16,
                                     cache_path=cache)
        assert g > 0
        key = rates.machine_key(torch.device("cpu"), 2,
                                rates.expert_shape(pool.specs["w13_weight"]), cpu.isa)
        assert rates.load_cached(cache, key) == {"G_H_us": g}
        rates.store_cached(cache, key, {"G_H_us": 1.5, "B_P": 1.0})
        assert rates.resolve_token_cost(pool, cpu, torch.device("cpu"), 256,
                                        torch.bfloat16, cache_path=cache) == 1.5


def test_waves_match_stock_and_leave_the_lru_alone(published):
    from freetoken_sglang.execute.waves import WaveExecutor

    rt, pool, layers = _runtime(num_slots=9)  # < 2E + k: waves of max(k, 9 // 4) = 2 rows
    assert (rt.cache.layout.kind, rt.cache.layout.buffer_rows) == ("waves", 2)
    _warm_lru(rt)
    before = _lru_state(rt)
    ex = WaveExecutor(rt)
    for T, valid in ((40, 40), (3, 3), (6, 4)):  # (6, 4): two rows of graph padding
        for l in range(L):
            call = _call(layers[l], l, T, 100 * T + l)
            rt.num_valid.fill_(valid)
            got = ex.run(call)
            want = _stock(call)
            torch.testing.assert_close(got[:valid], want[:valid], rtol=1e-5, atol=1e-5)
    for a, b in zip(before, _lru_state(rt)):
        assert torch.equal(a, b)
    counts = ex.snapshot()
    assert counts["layer_calls"] == 3 * L
    assert counts["experts_streamed"] + counts["experts_reused"] > 0


def test_resident_runs_stock_over_the_slots_and_touches_no_state(published):
    from freetoken_sglang.execute.resident import ResidentExecutor

    rt, pool, layers = _runtime(num_slots=L * E)
    assert rt.cache.all_resident
    before = _lru_state(rt)
    ex = ResidentExecutor(rt)
    for T in (1, 3, 40):
        for l in range(L):
            call = _call(layers[l], l, T, 200 * T + l)
            torch.testing.assert_close(ex.run(call), _stock(call), rtol=1e-5, atol=1e-5)
    # its views are the layer's rows of the slot banks, which hold the pool's experts
    assert torch.equal(ex.layer_banks[2]["w2_weight"], pool.layer_rows("w2_weight", 2))
    for a, b in zip(before, _lru_state(rt)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="every expert resident"):
        ResidentExecutor(_runtime(num_slots=L * E - 1)[0])


def test_a_cpu_isa_this_cpu_lacks_is_refused_at_start_naming_the_flag():
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.errors import RefusedError
    from freetoken_sglang.runtime import FreeTokenRuntime

    missing = [i for i in ("amx", "avx512_bf16", "avx512", "avx2")
               if i not in CpuExpertExecutor.available_isas()]
    if not missing:
        pytest.skip("this CPU has every kernel path the flag names")
    _, pool, _ = _runtime(num_slots=12)
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, top_k=K, activation="silu")
    method = SimpleNamespace(moe_runner_config=cfg, base_method=None,
                             format=SimpleNamespace(executor_kwargs=lambda m: {}))
    rt = SimpleNamespace(backend="gpu", pool=pool, layers={0: method}, moe_layer_ids=[0],
                         config=SimpleNamespace(miss_policy="qstar", prefill_cpu="off",
                                                cpu_threads=1, cpu_isa=missing[0]))
    with pytest.raises(RefusedError, match=f"--freetoken-cpu-isa {missing[0]}: this CPU, its "
                                           "kernel or this build lacks"):
        FreeTokenRuntime._start_cpu_side(rt, 16)


def test_amx_on_a_pool_without_tiles_is_refused_at_start(monkeypatch):
    """--freetoken-cpu-isa amx on FP32 experts (no tiles) is refused, not run as avx512_bf16
    (the AMX path is stood in for by its emulation, so that this runs on any CPU)."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from freetoken_sglang.cpu import executor as cpu_executor
    from freetoken_sglang.errors import RefusedError
    from freetoken_sglang.runtime import FreeTokenRuntime

    real = cpu_executor.CpuExpertExecutor

    def executor(*a, isa="auto", **kw):
        return real(*a, isa="amx_emulated" if isa == "amx" else isa, **kw)

    monkeypatch.setattr(cpu_executor, "CpuExpertExecutor", executor)
    _, pool, _ = _runtime(num_slots=12)  # FP32 banks
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, top_k=K, activation="silu")
    method = SimpleNamespace(moe_runner_config=cfg, base_method=None,
                             format=SimpleNamespace(executor_kwargs=lambda m: {}))
    rt = SimpleNamespace(backend="gpu", pool=pool, layers={0: method}, moe_layer_ids=[0],
                         config=SimpleNamespace(miss_policy="qstar", prefill_cpu="off",
                                                cpu_threads=1, cpu_isa="amx"))
    with pytest.raises(RefusedError, match="AMX tiles need dense BF16 experts .* fp32"):
        FreeTokenRuntime._start_cpu_side(rt, 16)


@pytest.mark.parametrize("b_h", [10.0, 40.0])
def test_decode_runs_the_admission_rules_cpu_misses_at_any_bandwidth_ratio(b_h, published):
    """q* with the admission rule sends the misses it does not admit to the CPU whatever q*
    is, also where B_H <= B_P makes Eq. 4 fill every miss (``fill_ratio`` >= 1): the decode
    executor runs and merges them, and masks them in the GPU MoE (Session 30 found it did
    neither there: the outputs lost those experts, and on CUDA the -1 ids reached SGLang's
    kernel without ``filter_expert``). Every call equals stock, and CPU items ran."""
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute.decode import DecodeExecutor
    from freetoken_sglang.policy.miss import MissPolicy

    rt, pool, layers = _runtime(num_slots=E + 4)
    policy = MissPolicy("qstar", (20.0, b_h), admission=True)
    assert (policy.decode_split.fill_ratio >= 1) == (b_h < 20.0)  # B_H <= B_P: Eq. 4 fills all
    counters = torch.zeros(5, L, dtype=torch.int64)
    rt.split_for = policy.split_for
    rt.is_decode_sized = lambda rows: True
    rt.counters = SimpleNamespace(of_phase=lambda phase: counters)
    with CpuExpertExecutor(pool.banks, num_threads=2) as cpu:
        rt.cpu_branch = CpuBranch(cpu, "cpu", H, K, torch.float32)
        ex = DecodeExecutor(rt)
        for s in range(6 * L):
            T = 1 + s % 3
            call = _call(layers[s % L], s % L, T, 500 + s)
            rt.num_valid.fill_(T)
            torch.testing.assert_close(ex.run(call), _stock(call), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, s=s: f"call {s}: {m}")
        assert rt.cpu_branch.calls > 0 and int(counters[4].sum()) > 0
        _assert_slots_hold_their_owners(rt, pool)
