"""Triton kernels of the device-side cache decision (``freetoken_sglang.residency.decide`` on
CUDA): classify a layer call's experts, then assign LRU victims and write the fill plan.

One layer call runs ``_classify`` (one program), ``torch.topk`` over the slots' LRU keys,
and ``_assign`` (one program): three launches, no host sync, fixed shapes, so decode CUDA
graphs capture it. The results are identical to the torch reference in
``freetoken_sglang/residency.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken_sglang.residency import FillPlan, ResidencyState, max_unique_experts

_BLOCK = 64


@triton.jit
def _classify(
    ids_ptr,  # int32/int64 [T*k] local expert ids, row-major
    n_entries,
    top_k,
    num_valid_ptr,  # int32 [1]
    res_ptr,  # int32 [L*E+1]
    base,  # l*E
    num_experts,
    key_ptr,  # int64 [S]
    num_slots,
    clock_ptr,  # int64 [1]
    cls_ptr,  # int32 [E_PAD] out: 0 unused, 1 hit, 2 miss
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    nv = tl.load(num_valid_ptr)
    used = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = (offs < n_entries) & ((offs // top_k) < nv)
        ids = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
        eq = (ids[:, None] == e[None, :]).to(tl.int32)
        used = tl.maximum(used, tl.max(eq, axis=0))
    em = e < num_experts
    res = tl.load(res_ptr + base + e, mask=em, other=-1)
    hit = (used > 0) & (res >= 0) & em
    miss = (used > 0) & (res < 0) & em
    now = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, now)
    slot = res.to(tl.int64)
    tl.store(key_ptr + slot, now * num_slots + slot, mask=hit)
    cls = tl.where(hit, 1, tl.where(miss, 2, 0))
    tl.store(cls_ptr + e, cls, mask=em)


@triton.jit
def _assign(
    cls_ptr,  # int32 [E_PAD]
    cand_ptr,  # int64 [K] slots, least recently used first
    res_ptr,  # int32 [L*E+1]
    owner_ptr,  # int32 [S+1]
    key_ptr,  # int64 [S]
    num_slots,
    base,
    num_experts,
    clock_ptr,  # int64 [1]
    src_ptr,  # int32 [K] out
    dst_ptr,  # int32 [K] out
    count_ptr,  # int32 [1] out
    counters_ptr,  # int64 [4, L]
    ordinal,
    num_layers,
    E_PAD: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    em = e < num_experts
    cls = tl.load(cls_ptr + e, mask=em, other=0)
    hit = cls == 1
    miss = cls == 2
    missi = miss.to(tl.int32)
    rank = tl.cumsum(missi, axis=0) - 1
    victim = tl.load(cand_ptr + rank, mask=miss, other=0).to(tl.int32)
    old = tl.load(owner_ptr + victim, mask=miss, other=-1)
    evicted = miss & (old >= 0)
    flat = base + e
    tl.store(res_ptr + old, -1, mask=evicted)
    tl.store(res_ptr + flat, victim, mask=miss)
    tl.store(owner_ptr + victim, flat, mask=miss)
    now = tl.load(clock_ptr)
    v64 = victim.to(tl.int64)
    tl.store(key_ptr + v64, now * num_slots + v64, mask=miss)
    tl.store(src_ptr + rank, flat, mask=miss)
    tl.store(dst_ptr + rank, victim, mask=miss)
    n_miss = tl.sum(missi, axis=0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_evict = tl.sum(evicted.to(tl.int32), axis=0)
    tl.store(count_ptr, n_miss)
    c = counters_ptr + ordinal
    tl.store(c, tl.load(c) + (n_hit + n_miss).to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_hit.to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_miss.to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_evict.to(tl.int64))


def decide_triton(
    state: ResidencyState,
    counters: torch.Tensor,
    ordinal: int,
    num_experts: int,
    topk_ids: torch.Tensor,
    num_valid: torch.Tensor,
) -> FillPlan:
    """``freetoken_sglang.residency.decide`` with the kernels above (same arguments and
    result). Works on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    t, k = topk_ids.shape
    E = num_experts
    K = max_unique_experts(t, k, E)
    e_pad = triton.next_power_of_2(E)
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    cls = torch.empty(e_pad, dtype=torch.int32, device=device)
    base = ordinal * E
    _classify[(1,)](
        ids,
        t * k,
        k,
        num_valid,
        state.residency,
        base,
        E,
        state.key,
        state.num_slots,
        state.clock,
        cls,
        E_PAD=e_pad,
        BLOCK=_BLOCK,
    )
    cand = torch.topk(state.key, min(K, state.num_slots), largest=False, sorted=True).indices
    src = torch.empty(K, dtype=torch.int32, device=device)
    dst = torch.empty(K, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    _assign[(1,)](
        cls,
        cand,
        state.residency,
        state.owner,
        state.key,
        state.num_slots,
        base,
        E,
        state.clock,
        src,
        dst,
        count,
        counters,
        ordinal,
        counters.shape[1],
        E_PAD=e_pad,
    )
    return FillPlan(src=src, dst=dst, count=count)
