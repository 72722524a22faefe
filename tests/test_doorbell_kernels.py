"""The CPU branch's doorbell kernels (kernels/doorbell.py) under the Triton interpreter, with CPU
tensors standing in for device memory and for the mapped host buffers (the system-scope fence,
PTX inline assembly, is the identity here; tests/test_gpu.py runs the real thing)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it beside a jit function)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter")


@triton.jit
def _identity(x):
    return x


@pytest.fixture
def doorbell(monkeypatch):
    import freetoken_sglang.kernels.doorbell as d

    monkeypatch.setattr(d, "_fence_sys", _identity)
    return d


def test_post_copies_the_work_and_rings_only_with_items(doorbell):
    T, H = 3, 96
    x = torch.randn(T, H).to(torch.bfloat16)
    rows = torch.tensor([0, 2, 2, 0, 0, 0], dtype=torch.int32)
    experts = torch.tensor([5, 1, 7, 0, 0, 0], dtype=torch.int32)
    weights = torch.tensor([0.5, 0.25, 1.0, 0, 0, 0])
    count = torch.tensor([3], dtype=torch.int32)
    seq = torch.zeros(1, dtype=torch.int64)
    host = dict(x=torch.zeros(4, H, dtype=torch.bfloat16), rows=torch.zeros(8, dtype=torch.int32),
                experts=torch.zeros(8, dtype=torch.int32), weights=torch.zeros(8),
                count=torch.zeros(1, dtype=torch.int32), n_rows=torch.zeros(1, dtype=torch.int32),
                ring=torch.zeros(1, dtype=torch.int64))
    doorbell.post(x, rows, experts, weights, count, seq, host)
    assert torch.equal(host["x"][:T], x) and torch.equal(host["experts"][:6], experts)
    assert torch.equal(host["rows"][:6], rows) and torch.equal(host["weights"][:6], weights)
    assert (int(host["count"]), int(host["n_rows"]), int(host["ring"]), int(seq)) == (3, 3, 1, 1)
    count.zero_()
    host["x"].zero_()
    doorbell.post(x, rows, experts, weights, count, seq, host)
    assert int(host["ring"]) == 1 and int(seq) == 1 and not host["x"].any()  # nothing posted


def test_wait_merge_adds_the_served_partial_and_nothing_else(doorbell):
    T, H = 3, 96
    seq = torch.tensor([4], dtype=torch.int64)
    done = torch.tensor([4], dtype=torch.int64)
    partial = torch.randn(T, H)
    status = torch.zeros(1, dtype=torch.int32)
    out = torch.randn(T, H)
    start = out.clone()
    doorbell.wait_merge(out, torch.tensor([2], dtype=torch.int32), seq, done, partial, status)
    assert torch.equal(out, start + partial) and int(status) == 0
    out = start.clone()  # no item: no wait, no merge (done lags behind seq here)
    done.fill_(3)
    doorbell.wait_merge(out, torch.tensor([0], dtype=torch.int32), seq, done, partial, status)
    assert torch.equal(out, start) and int(status) == 0
    # items, but the executor never answers: out untouched, status set, no hang
    doorbell.wait_merge(out, torch.tensor([2], dtype=torch.int32), seq, done, partial, status,
                        max_spins=3)
    assert torch.equal(out, start) and int(status) == 1


def _host_buffers(rows, H, items, dtype=torch.bfloat16):
    """Stand-ins for the mapped host buffers, filled with values no post writes."""
    return dict(x=torch.full((rows, H), -7.0, dtype=dtype),
                rows=torch.full((items,), -7, dtype=torch.int32),
                experts=torch.full((items,), -7, dtype=torch.int32),
                weights=torch.full((items,), -7.0),
                count=torch.full((1,), -7, dtype=torch.int32),
                n_rows=torch.full((1,), -7, dtype=torch.int32),
                ring=torch.full((1,), 5, dtype=torch.int64))


def test_decision_kernel_posts_the_cpu_work_only_with_items(doorbell):
    """The decision kernel with a doorbell target (``decide(post=)``): a call with CPU items
    writes exactly its items (as the reference decides them), x's T rows, the count and T into
    the host buffers and rings ``seq + 1``; a call without writes nothing at all."""
    from freetoken_sglang.cache.residency import MissSplit, ResidencyState, decide_reference
    from freetoken_sglang.kernels.residency import decide_triton

    E, k, T, H, L = 8, 2, 3, 40, 2
    ids = torch.tensor([[5, 1], [2, 7], [6, 3]], dtype=torch.int32)  # row 2: graph padding
    w = torch.tensor([[0.5, 0.25], [0.75, 0.125], [1.0, 1.0]])
    nv = torch.tensor([2], dtype=torch.int32)
    x = torch.randn(T, H + 8).to(torch.bfloat16)[:, :H]  # rows of stride H + 8
    split = MissSplit(0.0, 0)  # every miss runs on the CPU
    seq = torch.tensor([4], dtype=torch.int64)
    host = _host_buffers(4, H, 4 * k)
    post = doorbell.DoorbellPost(x, seq, host)
    state, ref = ResidencyState(L * E, 6, "cpu"), ResidencyState(L * E, 6, "cpu")
    counters = torch.zeros(5, L, dtype=torch.int64)
    d = decide_triton(state, counters, 1, E, ids, w, nv, split, 1.5, post=post)
    want = decide_reference(ref, counters.clone(), 1, E, ids, w, nv, split, 1.5).cpu
    n = int(want.count)
    assert n == 4 and int(d.cpu.count) == n  # rows 0 and 1, every expert missed
    assert torch.equal(host["rows"][:n], want.rows[:n])
    assert torch.equal(host["experts"][:n], want.experts[:n])
    assert torch.equal(host["weights"][:n], want.weights[:n])
    assert (host["rows"][n:] == -7).all() and (host["weights"][n:] == -7).all()
    assert torch.equal(host["x"][:T], x) and (host["x"][T:] == -7).all()
    assert (int(host["count"]), int(host["n_rows"]), int(host["ring"]), int(seq)) == (n, T, 5, 5)
    # every expert resident: no CPU item, nothing posted
    full = ResidencyState(L * E, L * E, "cpu")
    full.make_all_resident()
    host = _host_buffers(4, H, 4 * k)
    untouched = {name: b.clone() for name, b in host.items()}
    d = decide_triton(full, counters, 1, E, ids, w, nv, split, 1.5,
                      post=doorbell.DoorbellPost(x, seq, host))
    assert int(d.cpu.count) == 0 and int(seq) == 5
    assert all(torch.equal(host[name], b) for name, b in untouched.items())
    with pytest.raises(ValueError):  # more rows than the host buffers hold
        decide_triton(full, counters, 1, E, ids, w, nv, split, 1.5,
                      post=doorbell.DoorbellPost(x, seq, _host_buffers(2, H, 4 * k)))


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n).to(dst_ptr.dtype.element_ty),
             mask=offs < n)


def _rounded(t, dtype=torch.bfloat16):
    """fp32 ``t`` in ``dtype`` as Triton's ``.to`` rounds it here (the interpreter truncates
    to bf16, CUDA rounds to nearest even, which tests/test_gpu.py checks)."""
    out = torch.empty(t.shape, dtype=dtype)
    _cast_kernel[(1,)](t.contiguous(), out, t.numel(), BLOCK=triton.next_power_of_2(t.numel()))
    return out


def test_reduce_merge_is_sglangs_sum_plus_the_partial_rounded_once(doorbell):
    """``reduce_merge``: without CPU items, bit for bit SGLang's own sum-reduce (its Triton
    ``moe_sum_reduce_triton``); with items served (``done == seq``), the fp32 sum over top-k
    in order, times the scale, plus the partial, rounded once; unanswered, the sum alone and
    the status set."""
    from sglang.kernels.ops.moe.fused_moe_triton_kernels import moe_sum_reduce_triton

    T, k, H, scale = 3, 5, 96, 1.5
    g = torch.Generator().manual_seed(0)
    expert_out = torch.randn(T, k, H, generator=g).to(torch.bfloat16)
    partial = torch.randn(4, H, generator=g)
    seq = torch.tensor([4], dtype=torch.int64)
    done = torch.tensor([4], dtype=torch.int64)
    status = torch.zeros(1, dtype=torch.int32)
    none, some = torch.tensor([0], dtype=torch.int32), torch.tensor([2], dtype=torch.int32)
    sglang = torch.empty(T, H, dtype=torch.bfloat16)
    moe_sum_reduce_triton(expert_out, sglang, scale)
    out = torch.full((T, H), 9.0, dtype=torch.bfloat16)
    doorbell.reduce_merge(expert_out, out, scale, none, seq, done, partial, status)
    assert torch.equal(out, sglang) and int(status) == 0  # no item: no partial
    done.fill_(3)  # no item, no wait (a wait would give up and set the status)
    doorbell.reduce_merge(expert_out, out, scale, none, seq, done, partial, status, max_spins=3)
    assert torch.equal(out, sglang) and int(status) == 0
    done.fill_(4)
    doorbell.reduce_merge(expert_out, out, scale, some, seq, done, partial, status)
    acc = expert_out[:, 0].float()
    for j in range(1, k):
        acc = acc + expert_out[:, j].float()
    want = _rounded(acc * scale + partial[:T])
    assert torch.equal(out, want) and int(status) == 0
    assert not torch.equal(want, _rounded(sglang.float() + partial[:T]))  # (two roundings)
    done.fill_(3)
    doorbell.reduce_merge(expert_out, out, scale, some, seq, done, partial, status, max_spins=3)
    assert torch.equal(out, sglang) and int(status) == 1


@pytest.mark.parametrize("null", [False, True])
def test_decode_executor_runs_the_doorbell_end_to_end(null, doorbell, monkeypatch,
                                                      published_server_args):
    """``DecodeExecutor`` with the doorbell CPU branch, its GPU side in the interpreter: the
    decision kernel, SGLang's Triton MoE over the slots with our sum in place of SGLang's, and
    the real C serving thread polling plain CPU tensors that stand for the mapped buffers (one
    layer, experts 0-3 resident, every miss on the CPU, routed scale 1.5; FP16, as the
    interpreter multiplies BF16 matrices wrongly). A call with CPU items is served once and
    returns SGLang's own expert outputs (captured from its sum) summed in fp32 with the
    partial, rounded once; with ``fold`` off (the separate kernels) SGLang's output plus the
    partial; a call without items is not served and returns SGLang's own output. Folded, a
    call launches our sum alone (no post, no merge kernel), with or without items; unfolded,
    the post and the merge kernel besides SGLang's sum. With ``null`` the CPU entries are
    computed against the null slot (``CPU_ENTRIES_READ_NULL_SLOT``, no ``filter_expert``),
    bit for bit the same."""
    import importlib
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from test_fp4_slots_interpreter import FUSED_MOE, align_block_size

    from freetoken_sglang.cache.residency import MissSplit, ResidencyState
    from freetoken_sglang.cpu.branch import CpuBranch
    from freetoken_sglang.patches.fused_moe import sum_reduce_replaced
    from freetoken_sglang.cpu.executor import CpuExpertExecutor
    from freetoken_sglang.execute import decode
    from freetoken_sglang.execute.contract import LayerCall
    from freetoken_sglang.execute.slot_moe import run_on_slots_triton
    from freetoken_sglang.experts.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.kernels.residency import decide_triton, remap_expert_ids_

    # SGLang's CUDA-only pieces stand in (test_fp4_slots_interpreter.py); CPU tensors take the
    # executor's CUDA path
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "fused_moe_triton_config"),
                        "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "moe_align_block_size"),
                        "sgl_moe_align_block_size", align_block_size, raising=False)
    monkeypatch.setattr(decode, "decide", decide_triton)
    monkeypatch.setattr(decode, "routed_scale",  # as on CUDA: SGLang's sum scales
                        lambda layer, x: layer.moe_runner_config.routed_scaling_factor)
    monkeypatch.setattr(decode, "CPU_ENTRIES_READ_NULL_SLOT", null)
    fused = importlib.import_module(FUSED_MOE + "fused_moe")
    filters = []  # filter_expert of each of SGLang's kernel sequences run

    def spied(sequence):
        def run(*args, **kwargs):
            filters.append(kwargs["filter_expert"])
            return sequence(*args, **kwargs)
        return run

    monkeypatch.setattr(fused, "_fused_moe_kernel_sequence",
                        spied(fused._fused_moe_kernel_sequence))
    monkeypatch.setattr(decode, "run_on_slots", lambda call, ids, layer_slots, cache,
                        use_null_slot=False, **kw: run_on_slots_triton(
                            call.layer, call.x, call.topk_weights, ids, layer_slots,
                            cache.banks_with_null_slots if use_null_slot else cache.slot_banks,
                            null_slot=cache.null_slot if use_null_slot else None, **kw))
    E, H, I, T, k, f16 = 8, 64, 32, 3, 4, torch.float16
    g = torch.Generator().manual_seed(0)
    pool = HostExpertPool([0], E, bank_specs_for_layer(H, I, f16))
    for bank in pool.banks.values():
        bank.copy_((torch.randn(bank.shape, generator=g) * 0.2).to(bank.dtype))
    # slot e holds expert e; then the null slot, all zeros
    with_null = {n: torch.cat([b, torch.zeros_like(b[:1])]) for n, b in pool.banks.items()}
    slots = {n: b[:E] for n, b in with_null.items()}
    state = ResidencyState(E, E, "cpu")
    state.make_all_resident()
    state.residency[4:E] = -1  # experts 4-7 miss (no fill under MissSplit(0, 0))
    state.owner[4:E] = -1
    cfg = MoeRunnerConfig(num_experts=E, num_local_experts=E, hidden_size=H,
                          intermediate_size_per_partition=I, top_k=k, params_dtype=f16,
                          activation="silu", inplace=False, routed_scaling_factor=1.5)
    layer = SimpleNamespace(moe_runner_config=cfg, w13_weight=pool.layer_rows("w13_weight", 0),
                            w2_weight=pool.layer_rows("w2_weight", 0))
    x, w = torch.zeros(T, H, dtype=f16), torch.zeros(T, k)
    ids = torch.zeros(T, k, dtype=torch.int32)
    call = LayerCall(layer=layer, ordinal=0, x=x, topk_weights=w, topk_ids=ids, topk_output=None)
    counters = torch.zeros(5, 1, dtype=torch.int64)

    def route(with_items):
        while True:
            r = torch.stack([torch.randperm(E if with_items else 4, generator=g)[:k]
                             for _ in range(T)])
            if bool((r >= 4).any()) == with_items:
                break
        ids.copy_(r)
        w.copy_(torch.rand(T, k, generator=g))
        x.copy_(torch.randn(T, H, generator=g).to(f16))

    def expected(ex, fold):
        """SGLang's own MoE over the GPU entries (its expert outputs captured), the partial."""
        seen = []

        def spy(original):
            def reduce(expert_out, out, scale):
                seen.append((expert_out.clone(), scale))
                original(expert_out, out, scale)
            return reduce

        with sum_reduce_replaced(spy):
            own = run_on_slots_triton(layer, x, w, torch.where(ids >= 4, -1, ids),
                                      state.layer_slots(0, E), slots, skip_negative_ids=True)
        r, c = (ids >= 4).nonzero(as_tuple=True)  # row-major, as the kernel emits them
        if not r.numel():
            return own, 0
        partial = torch.zeros(T, H)
        ex.run(x, r.int(), ids[r, c], w[r, c] * 1.5, partial)
        if not fold:
            return _rounded(own.float() + partial, f16), r.numel()
        expert_out, scale = seen[0]
        acc = expert_out[:, 0].float()
        for j in range(1, k):
            acc = acc + expert_out[:, j].float()
        return _rounded(acc * scale + partial, f16), r.numel()

    launched = {}  # the doorbell's kernels of the executor's call

    def counting(name, fn):
        def run(*args, **kwargs):
            launched[name] = launched.get(name, 0) + 1
            return fn(*args, **kwargs)
        return run

    for name in ("post", "wait_merge", "reduce_merge"):
        monkeypatch.setattr(doorbell, name, counting(name, getattr(doorbell, name)))
    with CpuExpertExecutor(pool.banks, num_threads=2) as ex:
        branch = CpuBranch(ex, "cpu", H, k, f16, max_rows=4)
        branch._allocate(4, pin=False)
        branch._start_doorbell(4, mapped=False)
        branch.device = torch.device("cuda")  # (its GPU side: the interpreter's CPU tensors)
        def fill_nothing(plan, remap=None):
            # plans are empty (MissSplit(0, 0)): only the block-id remap the fill carries
            assert int(plan.count) == 0
            assert remap[3] == (E if null else None)  # the null slot, or filter_expert
            if remap is not None:
                remap_expert_ids_(*remap)

        rt = SimpleNamespace(
            cache=SimpleNamespace(residency=state, num_experts=E, slot_banks=slots,
                                  banks_with_null_slots=with_null, null_slot=E,
                                  late=SimpleNamespace(pending=False),
                                  filler=SimpleNamespace(run=fill_nothing)),
            split_for=lambda rows: MissSplit(0.0, 0), is_decode_sized=lambda rows: True,
            counters=SimpleNamespace(of_phase=lambda phase: counters),
            num_valid=torch.tensor([T], dtype=torch.int32), cpu_branch=branch)
        executor = decode.DecodeExecutor(rt)
        try:
            served = 0
            for step, (with_items, fold) in enumerate(
                    [(True, True), (False, True), (True, False), (False, False)]):
                branch.fold = fold
                route(with_items)
                launched.clear()
                filters.clear()
                got = executor.run(call)
                assert filters == [not null], step  # the null slot runs SGLang's unfiltered
                assert launched == ({"reduce_merge": 1} if fold else
                                    {"post": 1, "wait_merge": 1}), step
                want, n = expected(ex, fold)
                assert (n > 0) == with_items
                assert torch.equal(got, want), step
                served += with_items
                assert branch.doorbell.served == served == int(branch.hdr_host[0]), step
            branch.check()
        finally:
            branch.close()
