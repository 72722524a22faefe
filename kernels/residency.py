"""Triton kernel of the device-side cache decision (``freetoken_sglang.residency.decide`` on
CUDA): one program de-duplicates a layer call's routed experts, classifies them against the
residency table, picks an LRU victim for each miss and writes the fill plan (paper §4.1).

One launch per layer call, no host sync, fixed shapes: decode CUDA graphs capture it. A
slot's LRU key is ``stamp * S + slot``, so the least recently used slot is simply the
smallest key; a chosen victim is re-keyed with the current stamp, so the next search skips
it. Calls with no miss never scan the slots. Results are identical to the torch reference
in ``freetoken_sglang/residency.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from freetoken_sglang.residency import FillPlan, ResidencyState, max_unique_experts

_BLOCK = 64
_SLOT_BLOCK = 1024


@triton.jit
def _decide_kernel(
    ids_ptr,  # int [T*k] local expert ids, row-major
    ids_out_ptr,  # same dtype [T*k] out: padded rows get row 0's experts
    n_entries,
    top_k,
    num_valid_ptr,  # int [1]
    res_ptr,  # int32 [L*E+1]
    owner_ptr,  # int32 [S+1]
    key_ptr,  # int64 [S]
    num_slots,
    base,  # l*E
    num_experts,
    clock_ptr,  # int64 [1]
    src_ptr,  # int32 [K] out
    dst_ptr,  # int32 [K] out
    count_ptr,  # int32 [1] out
    counters_ptr,  # int64 [4, L]
    ordinal,
    num_layers,
    E_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    SLOT_BLOCK: tl.constexpr,
):
    e = tl.arange(0, E_PAD)
    nv = tl.load(num_valid_ptr)
    used = tl.zeros([E_PAD], dtype=tl.int32)
    for start in range(0, n_entries, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n_entries
        valid = inb & ((offs // top_k) < nv)
        ids = tl.load(ids_ptr + offs, mask=inb, other=0)
        row0 = tl.load(ids_ptr + (offs % top_k), mask=inb, other=0)
        tl.store(ids_out_ptr + offs, tl.where(valid, ids, row0), mask=inb)
        ids32 = tl.where(valid, ids.to(tl.int32), -1)
        eq = (ids32[:, None] == e[None, :]).to(tl.int32)
        used = tl.maximum(used, tl.max(eq, axis=0))
    em = e < num_experts
    res = tl.load(res_ptr + base + e, mask=em, other=-1)
    hit = (used > 0) & (res >= 0) & em
    miss = (used > 0) & (res < 0) & em
    now = tl.load(clock_ptr) + 1
    tl.store(clock_ptr, now)
    S = num_slots
    slot = res.to(tl.int64)
    # Stamp the hits first: no slot used by this call can be a victim.
    tl.store(key_ptr + slot, now * S + slot, mask=hit)
    missi = miss.to(tl.int32)
    rank = tl.cumsum(missi, axis=0) - 1
    n_miss = tl.sum(missi, axis=0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_evict = n_miss * 0
    tl.debug_barrier()
    for i in range(0, n_miss):
        # The least recently used slot: the smallest key (keys are unique).
        kmin = tl.load(key_ptr)
        for s0 in range(0, S, SLOT_BLOCK):
            so = s0 + tl.arange(0, SLOT_BLOCK)
            keys = tl.load(key_ptr + so, mask=so < S, other=now * S + S)
            kmin = tl.minimum(kmin, tl.min(keys, axis=0))
        v = ((kmin % S) + S) % S
        # The i-th miss, in expert order.
        ex = tl.sum(tl.where(miss & (rank == i), e, 0), axis=0)
        flat = base + ex
        old = tl.load(owner_ptr + v)
        tl.store(res_ptr + tl.maximum(old, 0), -1, mask=old >= 0)
        n_evict += (old >= 0).to(tl.int32)
        tl.store(res_ptr + flat, v.to(tl.int32))
        tl.store(owner_ptr + v, flat)
        tl.store(key_ptr + v, now * S + v)
        tl.store(src_ptr + i, flat)
        tl.store(dst_ptr + i, v.to(tl.int32))
        tl.debug_barrier()
    tl.store(count_ptr, n_miss)
    c = counters_ptr + ordinal
    tl.store(c, tl.load(c) + (n_hit + n_miss).to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_hit.to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_miss.to(tl.int64))
    c += num_layers
    tl.store(c, tl.load(c) + n_evict.to(tl.int64))


@triton.jit
def _remap_kernel(expert_ids_ptr, n, layer_slots_ptr, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(expert_ids_ptr + offs, mask=m, other=-1)
    ok = m & (x >= 0) & (x < num_experts)
    slot = tl.load(layer_slots_ptr + tl.where(ok, x, 0), mask=ok, other=0)
    tl.store(expert_ids_ptr + offs, tl.maximum(slot, 0).to(x.dtype), mask=ok)


def decide_triton(
    state: ResidencyState,
    counters: torch.Tensor,
    ordinal: int,
    num_experts: int,
    topk_ids: torch.Tensor,
    num_valid: torch.Tensor,
):
    """``freetoken_sglang.residency.decide`` in one kernel launch (same arguments and
    results). Works on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    t, k = topk_ids.shape
    E = num_experts
    K = max_unique_experts(t, k, E)
    device = topk_ids.device
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    ids_out = torch.empty_like(ids)
    src = torch.empty(K, dtype=torch.int32, device=device)
    dst = torch.empty(K, dtype=torch.int32, device=device)
    count = torch.empty(1, dtype=torch.int32, device=device)
    _decide_kernel[(1,)](
        ids,
        ids_out,
        t * k,
        k,
        num_valid,
        state.residency,
        state.owner,
        state.key,
        state.num_slots,
        ordinal * E,
        E,
        state.clock,
        src,
        dst,
        count,
        counters,
        ordinal,
        counters.shape[1],
        E_PAD=triton.next_power_of_2(E),
        BLOCK=_BLOCK,
        SLOT_BLOCK=_SLOT_BLOCK,
        num_warps=4,
    )
    return FillPlan(src=src, dst=dst, count=count), ids_out


def remap_expert_ids_(expert_ids: torch.Tensor, layer_slots: torch.Tensor) -> None:
    """Rewrite, in place, the per-block local expert ids of SGLang's token alignment into
    slot ids (``layer_slots[e]``); negative ids (unused blocks) stay as they are."""
    n = expert_ids.numel()
    block = 256
    _remap_kernel[(triton.cdiv(n, block),)](
        expert_ids, n, layer_slots, layer_slots.numel(), BLOCK=block
    )
