"""The device-side cache decision on CUDA (``cache.residency.decide``) in one Triton program.

One program de-duplicates a layer call's routed experts, classifies them against the
residency table, splits the misses between fills and CPU execution (q*, paper §3.2), picks an
LRU victim for each fill, and writes the fill plan and the CPU work items (paper §4.1). Given a
doorbell target (``decide(post=)``), the same program posts a call with CPU items to the CPU
branch (``kernels/doorbell.py``): the items, x's rows, the count, then the ring.

One launch per layer call, no host sync, fixed shapes: decode CUDA graphs capture it. A
slot's LRU key is ``stamp * S + slot``, so the least recently used slot is simply the
smallest key; a chosen victim is re-keyed with the current stamp, so the next search skips
it. Calls with no miss never scan the slots nor read the q table, and calls with no CPU item
skip the CPU routing (the hit path; with the admission or the re-miss rule, a call with
misses scans the slots once more for the least recently used stamp, and the useful admission
loads that slot's last fill). Results are identical to the torch reference in
``freetoken_sglang/cache/residency.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from freetoken_sglang.cache.residency import (
    FILL_ALL,
    CpuWork,
    FillPlan,
    LayerDecision,
    MissSplit,
    ResidencyState,
    fill_count_after,
    reuse_need,
    max_unique_experts,
)
from freetoken_sglang.kernels.doorbell import DoorbellPost, _post_tail, check_post

# Routed entries per step of the decision program's loops, and its warps: one warp over
# 32 entries took 5.65-5.71 us per all-hit call on the H200 at bs1 and bs4, against
# 11.74-13.63 at 64 entries and 4 warps and 6.85-9.23 at the other blocks and warp counts
# tried, and was the fastest when every expert misses too (bench_layer_overhead.py
# --decide-configs; benchmarks/RESULTS.md, session 17).
DECIDE_BLOCK = 32
DECIDE_WARPS = 1
# Calls without a miss (or without a CPU item) skip the q table's load and the CPU routing's
# per-entry reduction; False runs every call through them (bench_layer_overhead.py's
# decide-full, the A/B of the hit path)
DECIDE_HIT_PATH = True
# The counters' atomic adds: relaxed (no fence; the host reads them after a sync), or Triton's
# default "acq_rel", whose fences serialize the five adds behind every earlier store
# (bench_layer_overhead.py's decide-acqrel, the A/B)
DECIDE_COUNTER_SEM = "relaxed"
_SLOT_BLOCK = 1024
# The most x elements per step of the doorbell post's copy in the decision program (one warp:
# 64 a thread; other sizes not measured); a step copies within one row
POST_BLOCK = 2048


@triton.jit
def _decide_kernel(
    ids_ptr,  # int [T*k] local expert ids, row-major
    weights_ptr,  # fp32 [T*k] router weights
    ids_out_ptr,  # same dtype as ids [T*k] out: ids for the GPU compute
    n_entries,
    top_k,
    num_valid_ptr,  # int [1]
    res_ptr,  # int32 [L*E+1]
    owner_ptr,  # int32 [S+1]
    key_ptr,  # int64 [S]
    last_use_ptr,  # int64 [L*E]
    num_slots,
    base,  # l*E
    num_experts,
    clock_ptr,  # int64 [1]
    src_ptr,  # int32 [K] out
    dst_ptr,  # int32 [K] out
    count_ptr,  # int32 [1] out
    cpu_rows_ptr,  # int32 [T*k] out
    cpu_experts_ptr,  # int32 [T*k] out
    cpu_weights_ptr,  # fp32 [T*k] out
    cpu_count_ptr,  # int32 [1] out
    counters_ptr,  # int64 [5, L]
    ordinal,
    num_layers,
    q_table_ptr,  # int32 [(E+1)*(E+1)] or [E+1]: fills among r other misses after f forced
    weight_scale,
    missed_ptr,  # int8 [L*E] (the return rule)
    returns_ptr,  # fp32 [2] (R, N) (the return rule)
    fill_us,  # the return rule's branch times (MissSplit), us
    cpu_us,
    fill_fixed_us,
    fixed_diff_us,  # fill_fixed_us - cpu_fixed_us
    uses_needed,  # B_H/B_P - 1 (the valued re-miss rule), fp32
    late_src_ptr,  # int32 [K] out (the late fill)
    late_dst_ptr,  # int32 [K] out (the late fill)
    late_count_ptr,  # int32 [1] out (the late fill)
    late_total_ptr,  # int64 [1] (the late fill)
    filled_at_ptr,  # int64 [S+1] each slot's last fill (the useful admission)
    x_ptr,  # [T, H] layer input (the doorbell post)
    x_stride,
    n_rows,  # T
    hidden,  # H
    seq_ptr,  # int64 [1] device sequence counter (the doorbell post)
    hx_ptr,  # mapped host buffers (UVA): x [max_rows, H], the items, count, n_rows, ring
    hrows_ptr,
    hexperts_ptr,
    hweights_ptr,
    hcount_ptr,
    hnrows_ptr,
    ring_ptr,
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
    ADMIT: tl.constexpr,  # the admission rule (MissSplit.admit_reuse)
    USEFUL: tl.constexpr,  # ... in its useful form (MissSplit.admit_useful)
    REFILL: tl.constexpr,  # the re-miss rule (MissSplit.fill_reused)
    VALUED: tl.constexpr,  # ... in its valued form (MissSplit.fill_reused_valued)
    RETURN: tl.constexpr,  # the return rule (MissSplit.return_rule)
    LATE: tl.constexpr,  # the late fill (MissSplit.late_fill)
    LATE_ALL: tl.constexpr,  # ... of every admitted CPU run (MissSplit.late_all)
    POST: tl.constexpr,  # post a call with CPU items to the doorbell (decide(post=))
    POST_BLOCK: tl.constexpr,  # x elements per step of the post's copy (a row's at most)
    POST_FENCE: tl.constexpr,  # the post's fence over this many elements: every thread
    HIT_PATH: tl.constexpr,  # calls without misses skip the q table and the CPU routing
    COUNTER_SEM: tl.constexpr,  # the counters' atomic adds (DECIDE_COUNTER_SEM)
):
    e = tl.arange(0, E_PAD)
    em = e < num_experts
    # Every load that needs nothing of the entries is issued before their loop: on an all-hit
    # call the program then waits on one round of loads (a loop is a barrier to the compiler).
    nv = tl.load(num_valid_ptr)
    res = tl.load(res_ptr + base + e, mask=em, other=-1)
    now = tl.load(clock_ptr) + 1
    last = tl.load(last_use_ptr + base + e, mask=em, other=0)
    used = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n_entries
        valid = inb & ((offs // top_k) < nv)
        ids = tl.load(ids_ptr + offs, mask=inb, other=0)
        ids32 = tl.where(valid, ids.to(tl.int32), -1)
        eq = (ids32[:, None] == e[None, :]).to(tl.int32)
        used = tl.maximum(used, tl.max(eq, axis=0))
        if HIT_PATH:
            # The routing for the GPU compute as it is when no entry goes to the CPU (padded
            # rows take row 0's experts); a call with CPU items rewrites it below.
            row0 = tl.load(ids_ptr + (offs % top_k), mask=inb, other=0)
            tl.store(ids_out_ptr + offs, tl.where(valid, ids, row0), mask=inb)
    hit = (used > 0) & (res >= 0) & em
    miss = (used > 0) & (res < 0) & em
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    tl.store(clock_ptr, now)
    S = num_slots
    slot = res.to(tl.int64)
    # Stamp the hits first: no slot used by this call can be a victim.
    tl.store(key_ptr + slot, now * S + slot, mask=hit)
    tl.debug_barrier()
    if ADMIT or REFILL or RETURN:
        # Reused misses: used more recently than the least recently used slot (its stamp is
        # -1 while a slot is empty: every miss). No miss: no scan (S * 0 loops) and no load
        # (the bound starts above every key: stamps are at most now); ``oldest`` then goes
        # unused (``within`` needs a miss, the return rule's decay too).
        kmin = now * S + S
        for s0 in range(0, S * (n_miss > 0).to(tl.int32), SLOT_BLOCK):
            so = s0 + tl.arange(0, SLOT_BLOCK)
            keys = tl.load(key_ptr + so, mask=so < S, other=now * S + S)
            kmin = tl.minimum(kmin, tl.min(keys, axis=0))
        oldest = (kmin - ((kmin % S) + S) % S) // S
        within = miss & (last > oldest)
    else:
        within = miss & (e < 0)
    if ADMIT or REFILL:
        reused = within
    else:
        reused = miss & (e < 0)
    if USEFUL:
        # the least recently used slot (the smallest key) hit since its last fill (calm)
        # admits every miss; no miss: no load
        fa = tl.load(filled_at_ptr + ((kmin % S) + S) % S, mask=n_miss > 0, other=now)
        calm = oldest > fa
        admitted = reused | (miss & calm)
    else:
        calm = n_miss >= 0
        admitted = reused
    if RETURN:
        # The return rate r = R / N: misses whose expert is used again within the LRU age
        # (a hit, or a miss more recent than the least recently used slot) over the misses,
        # both decayed by 1 - 1/age on calls with misses (residency.py's reference).
        flag = tl.load(missed_ptr + base + e, mask=em, other=0)
        n_ret = tl.sum(((flag > 0) & (hit | within)).to(tl.float32), axis=0)
        # round-to-nearest divisions, and no fused multiply-adds (enable_fp_fusion=False at
        # the launch): each fp32 operation rounds as torch's do in the reference
        age = tl.maximum(now - oldest, 1).to(tl.float32)
        dec = tl.where(n_miss > 0, 1.0 - tl.div_rn(1.0, age), 1.0)
        r_cnt = tl.load(returns_ptr) * dec + n_ret
        n_cnt = tl.load(returns_ptr + 1) * dec
        rate = tl.where(n_cnt > 0, tl.minimum(tl.div_rn(r_cnt, tl.maximum(n_cnt, 1e-30)), 1.0),
                        0.0)
    # The re-miss rule fills every reused miss (with the useful admission: while calm) and
    # counts it in q; the rest of q goes to the other misses (the table's row of the forced
    # count).
    if REFILL:
        forced = reused & calm
        if VALUED:
            # expected uses before eviction (LRU age / time since the last use) of at least
            # B_H/B_P - 1, in fp32 as the reference's valued_reuse
            age_f = (now - oldest).to(tl.float32)
            gap_f = tl.maximum(now - last, 1).to(tl.float32)
            forced = forced & (age_f >= uses_needed * gap_f)
    else:
        forced = miss & (e < 0)
    rest = miss & (forced == 0)
    if ADMIT:
        eligible = rest & admitted
    else:
        eligible = rest
    # q of the split (rounding and the lone-miss rule, forced fills counted), computed once on
    # the host in double precision (``fill_count_after``): the kernel's float scalars are fp32.
    n_forced = tl.sum(forced.to(tl.int32), axis=0)
    n_rest = tl.sum(rest.to(tl.int32), axis=0)
    # (a call without misses fills nothing whatever the table says: no load, no wait on it)
    if HIT_PATH:
        need_q = n_miss > 0
    else:
        need_q = n_miss >= 0
    q_rest = tl.load(q_table_ptr + n_forced * (num_experts + 1) + n_rest, mask=need_q, other=0)
    q_rest = tl.minimum(q_rest, tl.sum(eligible.to(tl.int32), axis=0))
    erank = tl.cumsum(eligible.to(tl.int32), axis=0) - 1
    fillm = forced | (eligible & (erank < q_rest))
    if RETURN:
        # keeps_cpu: the CPU experts stay only where they save more now than r of them cost
        # in later fills; otherwise every miss is filled.
        m_f = n_miss.to(tl.float32)
        q_f = tl.sum(fillm.to(tl.int32), axis=0).to(tl.float32)
        c_f = m_f - q_f
        by_fill = c_f * fill_us + tl.where(q_f > 0, 0.0, fill_fixed_us)
        by_cpu = fixed_diff_us + m_f * fill_us - c_f * cpu_us
        keep = (c_f <= 0) | (tl.minimum(by_fill, by_cpu) > rate * c_f * fill_us)
        fillm = tl.where(keep, fillm, miss)
        tl.store(returns_ptr, r_cnt)
        tl.store(returns_ptr + 1, n_cnt + m_f)
        tl.store(missed_ptr + base + e, miss.to(tl.int8), mask=(used > 0) & em)
    cpu = miss & (fillm == 0)
    n_cpu = tl.sum(cpu.to(tl.int32), axis=0)
    q = tl.sum(fillm.to(tl.int32), axis=0)
    rank = tl.cumsum(fillm.to(tl.int32), axis=0) - 1
    if LATE:
        # A call that fills none of its misses (Eq. 4 and every rule) fills them all late:
        # they keep running on the CPU, and get slots now (row 0 of the table: fill_count).
        # LATE_ALL: every other CPU run the admission rule admits (all without it) too. The
        # late fills take the victims after the call's own fills.
        q_base = tl.load(q_table_ptr + n_miss, mask=need_q, other=0)
        latem = miss & ((q == 0) & (q_base == 0))
        if LATE_ALL:
            if ADMIT:
                latem = latem | (cpu & admitted)
            else:
                latem = latem | cpu
        lrank = q + tl.cumsum(latem.to(tl.int32), axis=0) - 1
        n_late = tl.sum(latem.to(tl.int32), axis=0)
    else:
        latem = miss & (e < 0)
        lrank = rank
        n_late = q * 0
    n_evict = n_miss * 0
    tl.debug_barrier()
    tl.store(last_use_ptr + base + e, now + e * 0, mask=(used > 0) & em)
    for i in range(0, q + n_late):
        # The least recently used slot: the smallest key (keys are unique).
        kmin = tl.load(key_ptr)
        for s0 in range(0, S, SLOT_BLOCK):
            so = s0 + tl.arange(0, SLOT_BLOCK)
            keys = tl.load(key_ptr + so, mask=so < S, other=now * S + S)
            kmin = tl.minimum(kmin, tl.min(keys, axis=0))
        v = ((kmin % S) + S) % S
        # The i-th filled miss, in expert order (the call's own fills, then the late ones).
        ex = tl.sum(tl.where((fillm & (rank == i)) | (latem & (lrank == i)), e, 0), axis=0)
        flat = base + ex
        old = tl.load(owner_ptr + v)
        tl.store(res_ptr + tl.maximum(old, 0), -1, mask=old >= 0)
        n_evict += (old >= 0).to(tl.int32)
        tl.store(res_ptr + flat, v.to(tl.int32))
        tl.store(owner_ptr + v, flat)
        tl.store(key_ptr + v, now * S + v)
        tl.store(filled_at_ptr + v, now)
        if i < q:
            tl.store(src_ptr + i, flat)
            tl.store(dst_ptr + i, v.to(tl.int32))
        else:
            tl.store(late_src_ptr + (i - q), flat)
            tl.store(late_dst_ptr + (i - q), v.to(tl.int32))
        tl.debug_barrier()
    if LATE:
        tl.store(late_count_ptr, n_late)
        tl.store(late_total_ptr, tl.load(late_total_ptr) + n_late.to(tl.int64))
    tl.store(count_ptr, q)
    # Routing for the GPU compute (padded rows take row 0's experts, CPU entries -1) and
    # the CPU work items, compacted in row-major order.
    n_items = n_miss * 0
    n_full = n_entries + n_items  # the entries the CPU routing below goes over
    if HIT_PATH:
        # No CPU item: the first loop wrote the routing; no per-entry reduction over the
        # experts, compaction or item stores.
        n_full = n_full * (n_cpu > 0).to(tl.int32)
    for start in range(0, n_full, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n_entries
        valid = inb & ((offs // top_k) < nv)
        ids = tl.load(ids_ptr + offs, mask=inb, other=0)
        row0 = tl.load(ids_ptr + (offs % top_k), mask=inb, other=0)
        rid = tl.where(valid, ids, row0)
        on_cpu = tl.max(((rid.to(tl.int32)[:, None] == e[None, :]) & cpu[None, :]).to(tl.int32), axis=1) > 0
        tl.store(ids_out_ptr + offs, tl.where(on_cpu, -1, rid), mask=inb)
        emit = on_cpu & valid
        emiti = emit.to(tl.int32)
        pos = n_items + tl.cumsum(emiti, axis=0) - 1
        w = tl.load(weights_ptr + offs, mask=emit, other=0.0).to(tl.float32)
        item_row = offs // top_k
        item_expert = base + ids.to(tl.int32)
        item_weight = w * weight_scale
        tl.store(cpu_rows_ptr + pos, item_row, mask=emit)
        tl.store(cpu_experts_ptr + pos, item_expert, mask=emit)
        tl.store(cpu_weights_ptr + pos, item_weight, mask=emit)
        if POST:  # the items straight into host memory too (none on a call without)
            tl.store(hrows_ptr + pos, item_row, mask=emit)
            tl.store(hexperts_ptr + pos, item_expert, mask=emit)
            tl.store(hweights_ptr + pos, item_weight, mask=emit)
        n_items += tl.sum(emiti, axis=0)
    tl.store(cpu_count_ptr, n_items)
    if POST:
        # One program: the count is final here, and every item store above precedes the
        # post's fence in the thread that made it.
        if n_items > 0:
            _post_tail(x_ptr, x_stride, n_rows, hidden, hx_ptr, hcount_ptr, hnrows_ptr,
                       seq_ptr, ring_ptr, n_items, POST_BLOCK, POST_FENCE)
    # Atomic adds: no read back, so the program does not wait on five load round trips, and
    # relaxed: no fence before each (ordering with the host's reads comes from the stream).
    c = counters_ptr + ordinal
    tl.atomic_add(c, (n_hit + n_miss).to(tl.int64), sem=COUNTER_SEM)
    tl.atomic_add(c + num_layers, n_hit.to(tl.int64), sem=COUNTER_SEM)
    tl.atomic_add(c + 2 * num_layers, q.to(tl.int64), sem=COUNTER_SEM)
    tl.atomic_add(c + 3 * num_layers, n_evict.to(tl.int64), sem=COUNTER_SEM)
    tl.atomic_add(c + 4 * num_layers, n_cpu.to(tl.int64), sem=COUNTER_SEM)


@triton.jit
def remap_block(expert_ids_ptr, offs, n, layer_slots_ptr, num_experts, null_slot,
                KEEP_NEGATIVE: tl.constexpr, NULL_SLOT: tl.constexpr):
    """Rewrite ``expert_ids[offs]`` (``offs < n``) to ``layer_slots[id]``; ids outside
    ``[0, num_experts)`` stay; a negative slot becomes 0 unless ``KEEP_NEGATIVE``. With
    ``NULL_SLOT``, a negative slot and an id of -1 (the alignment's blocks of entries
    served elsewhere) become ``null_slot`` (also the fill kernel's remap,
    ``kernels/fill.py``)."""
    m = offs < n
    x = tl.load(expert_ids_ptr + offs, mask=m, other=-2)
    ok = m & (x >= 0) & (x < num_experts)
    slot = tl.load(layer_slots_ptr + tl.where(ok, x, 0), mask=ok, other=0)
    if NULL_SLOT:
        slot = tl.where(slot < 0, null_slot, slot)
        slot = tl.where(x == -1, null_slot, slot)
        ok = ok | (m & (x == -1))
    elif not KEEP_NEGATIVE:
        slot = tl.maximum(slot, 0)
    tl.store(expert_ids_ptr + offs, slot.to(x.dtype), mask=ok)


@triton.jit
def _remap_kernel(expert_ids_ptr, n, layer_slots_ptr, num_experts, null_slot,
                  KEEP_NEGATIVE: tl.constexpr, NULL_SLOT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    remap_block(expert_ids_ptr, offs, n, layer_slots_ptr, num_experts, null_slot,
                KEEP_NEGATIVE, NULL_SLOT)


_Q_TABLES = {}


def q_table(split: MissSplit, num_experts: int, device) -> torch.Tensor:
    """int32 on ``device``: entry ``f * (E+1) + r`` is ``fill_count_after(f, r, split)``, the
    fills among a layer call's r misses beside f forced fills (the re-miss rule). ``[E+1]``
    (f = 0 only, i.e. ``fill_count``) unless ``split.fill_reused``, else ``[(E+1)*(E+1)]``.
    Built once per (split, E, device) and kept (captured graphs hold its address); the runtime
    builds its splits' tables before any graph is captured."""
    device = torch.device(device)
    key = (split, num_experts, str(device))
    table = _Q_TABLES.get(key)
    if table is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        # No host-to-device copy inside a capture: the graph computes it on the device.
        on = device if capturing else torch.device("cpu")
        r = torch.arange(num_experts + 1, dtype=torch.int64, device=on)
        f = r.unsqueeze(1) if split.fill_reused else torch.zeros_like(r[:1]).unsqueeze(1)
        table = fill_count_after(f, r.unsqueeze(0), split).reshape(-1).to(torch.int32)
        if capturing:
            return table
        table = table.to(device)
        _Q_TABLES[key] = table
    return table


def decide_triton(
    state: ResidencyState,
    counters: torch.Tensor,
    ordinal: int,
    num_experts: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_valid: torch.Tensor,
    split: MissSplit = FILL_ALL,
    weight_scale: float = 1.0,
    post: "DoorbellPost | None" = None,
) -> LayerDecision:
    """``freetoken_sglang.cache.residency.decide`` in one kernel launch (same arguments and
    results). Works on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``.

    With ``post`` the program also posts the call's CPU work to the doorbell when it has
    some: the items into ``post.host`` as it writes them, then x's T rows, the count, T,
    ``seq + 1`` and, after a system fence, the ring (``kernels/doorbell.py``); a call without
    CPU items writes none of them.

    Raises:
        ValueError: ``post.x`` is not ``[T, H]`` with rows of stride 1, or ``post.x`` and the
            ``T * k`` items do not fit ``post.host``.
    """
    t, k = topk_ids.shape
    E = num_experts
    K = max_unique_experts(t, k, E)
    device = topk_ids.device
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    weights = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    ids_out = torch.empty_like(ids)
    i32 = dict(dtype=torch.int32, device=device)
    plan = FillPlan(
        src=torch.empty(K, **i32), dst=torch.empty(K, **i32), count=torch.empty(1, **i32)
    )
    work = CpuWork(
        rows=torch.empty(t * k, **i32),
        experts=torch.empty(t * k, **i32),
        weights=torch.empty(t * k, dtype=torch.float32, device=device),
        count=torch.empty(1, **i32),
    )
    if post is not None:
        check_post(post.x, t * k, post.host)
        if post.x.shape[0] != t:
            raise ValueError(f"decide: the doorbell post's x has {post.x.shape[0]} rows, the "
                             f"routing {t}")
        x, host = post.x, post.host
        post_args = (x, x.stride(0), t, x.shape[1], post.seq, host["x"], host["rows"],
                     host["experts"], host["weights"], host["count"], host["n_rows"],
                     host["ring"])
        post_block = min(POST_BLOCK, triton.next_power_of_2(x.shape[1]))
    else:  # (unused: POST is off)
        post_args = (weights, 0, 0, 0, state.clock) + (plan.count,) * 7
        post_block = 1
    late_on = bool(split.late_fill) and state.num_slots > 0
    late = (FillPlan(src=torch.empty(K, **i32), dst=torch.empty(K, **i32),
                     count=torch.zeros(1, **i32)) if split.late_fill else None)
    _decide_kernel[(1,)](
        ids,
        weights,
        ids_out,
        t * k,
        k,
        num_valid,
        state.residency,
        state.owner,
        state.key,
        state.last_use,
        state.num_slots,
        ordinal * E,
        E,
        state.clock,
        plan.src,
        plan.dst,
        plan.count,
        work.rows,
        work.experts,
        work.weights,
        work.count,
        counters,
        ordinal,
        counters.shape[1],
        q_table(split, E, device),
        float(weight_scale),
        state.missed,
        state.returns,
        float(split.fill_us),
        float(split.cpu_us),
        float(split.fill_fixed_us),
        float(split.fill_fixed_us - split.cpu_fixed_us),
        reuse_need(split),
        late.src if late is not None else plan.src,
        late.dst if late is not None else plan.dst,
        late.count if late is not None else plan.count,
        state.late,
        state.filled_at,
        *post_args,
        E_PAD=triton.next_power_of_2(E),
        BLOCK=DECIDE_BLOCK,
        SLOT_BLOCK=_SLOT_BLOCK,
        ADMIT=bool(split.admit_reuse) and state.num_slots > 0,
        USEFUL=bool(split.admit_reuse and split.admit_useful) and state.num_slots > 0,
        REFILL=bool(split.fill_reused) and state.num_slots > 0,
        VALUED=bool(split.fill_reused and split.fill_reused_valued) and state.num_slots > 0,
        RETURN=bool(split.return_rule) and state.num_slots > 0,
        LATE=late_on,
        LATE_ALL=late_on and bool(split.late_all),
        POST=post is not None,
        POST_BLOCK=post_block,
        POST_FENCE=32 * DECIDE_WARPS,
        HIT_PATH=DECIDE_HIT_PATH,
        COUNTER_SEM=DECIDE_COUNTER_SEM,
        num_warps=DECIDE_WARPS,
        enable_fp_fusion=False,  # the return rule's fp32 sums round as the reference's
    )
    return LayerDecision(plan, ids_out, work, late)


def remap_expert_ids_(expert_ids: torch.Tensor, layer_slots: torch.Tensor,
                      keep_negative: bool = False, null_slot: Optional[int] = None) -> None:
    """Rewrite, in place, the per-block local expert ids of SGLang's token alignment into
    slot ids (``layer_slots[e]``); negative ids (unused blocks) stay as they are. A negative
    ``layer_slots[e]`` becomes slot 0, or with ``keep_negative`` stays negative (the block
    is then skipped by SGLang's kernels under ``filter_expert``). With ``null_slot`` (a slot
    row index, all zeros: ``ExpertCache.null_slot``), a negative ``layer_slots[e]`` and an
    id of -1 (the alignment's blocks of entries served elsewhere) become ``null_slot``:
    those entries are computed against zero weights, exactly 0, without ``filter_expert``.

    Raises:
        ValueError: ``null_slot`` is negative.
    """
    if null_slot is not None and null_slot < 0:
        raise ValueError(f"remap_expert_ids_: null_slot must be a slot row, got {null_slot}")
    n = expert_ids.numel()
    block = 256
    _remap_kernel[(triton.cdiv(n, block),)](
        expert_ids, n, layer_slots, layer_slots.numel(),
        0 if null_slot is None else int(null_slot),
        KEEP_NEGATIVE=keep_negative, NULL_SLOT=null_slot is not None, BLOCK=block
    )
