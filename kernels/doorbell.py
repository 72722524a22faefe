"""The GPU side of the doorbell CPU branch (``ft_doorbell`` in cpu_executor.h): post a call's CPU work, await its partial, merge it.

Nothing of it runs on a layer call without CPU items.

Folded (``cpu/branch.py``, the default): the decision kernel posts (``kernels/residency.py``
calls ``_post_tail`` after writing the items to the host too), and the MoE's sum over top-k,
which replaces SGLang's sum-reduce (``reduce_merge``), awaits the partial and adds it before its
one rounding; a call without CPU items then launches no kernel beyond the fill policy's.
Separate kernels: ``post`` (the A/B of ``bench_layer_overhead.py`` only) and ``wait_merge``
(after a MoE that does not end in SGLang's general sum-reduce: top-k <= 2 at scale 1,
FreeToken's own FP4 kernels), each a kernel that returns at once without items.

The host buffers are reached through unified virtual addressing (pinned memory aliased as CUDA
tensors). Ordering across PCIe uses system-scope fences (PTX ``fence.sc.sys``): the inputs
before the ring on the GPU side; the CPU's partial before ``done`` on the host side, and the
GPU reads the partial only after it has seen ``done`` and fenced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


# reduce_merge's hidden elements per program and its warps: the MoE over slots with this sum
# took 43.30 / 125.83 us per all-hit call at bs1 / bs4 on an H100 (Qwen3-30B-A3B shape),
# against 43.74 / 126.66 at 1024 x 4 and 43.37-43.83 / 125.85-126.70 at 256 x 1-2, 512 x 2 and
# 2048 x 8 (bench_layer_overhead.py --reduce-configs, one run; RESULTS.md, Session 32). Each
# element's sum is the same at any block.
REDUCE_BLOCK = 512
REDUCE_WARPS = 4


@dataclass(frozen=True)
class DoorbellPost:
    """Where the decision kernel posts a layer call's CPU work (``residency.decide(post=)``).

    Attributes:
        x: ``[T, H]`` layer input (CUDA, ``stride(1) == 1``), copied to ``host["x"]``.
        seq: int64 ``[1]`` device sequence counter, bumped by each post.
        host: UVA aliases of the mapped host buffers (``CpuBranch``): ``x`` ``[max_rows, H]``
            (x's dtype), ``rows``, ``experts`` (int32), ``weights`` (fp32) of at least
            ``T * k`` items, ``count``, ``n_rows`` (int32 ``[1]``), ``ring`` (int64 ``[1]``).
    """

    x: torch.Tensor
    seq: torch.Tensor
    host: dict


def check_post(x: torch.Tensor, n_items: int, host: dict) -> None:
    """Raise ValueError unless ``x`` ``[T, H]`` (rows of stride 1) and ``n_items`` items fit
    the mapped buffers ``host``."""
    T, H = x.shape
    if x.stride(1) != 1 or T > host["x"].shape[0] or H != host["x"].shape[1] \
            or n_items > host["rows"].numel():
        raise ValueError(
            f"doorbell post: x [{T}, {H}] (stride {x.stride()}) and {n_items} items do not "
            f"fit the branch's buffers ({list(host['x'].shape)} rows, {host['rows'].numel()} "
            "items, rows of stride 1)")


@triton.jit
def _fence_sys(x):
    """``fence.sc.sys`` in every thread (returns ``x``, so the compiler keeps it in order)."""
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _post_tail(x_ptr, x_stride, n_rows, hidden, hx_ptr, hcount_ptr, hnrows_ptr, seq_ptr,
               ring_ptr, count, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    """The end of a post, in one program, after the items are in host memory: x's ``n_rows``
    rows, ``count`` and ``n_rows``, then ``seq + 1`` into ``seq`` and, after a system fence in
    every thread (``FENCE``: at least the program's threads) and a barrier, into the ring."""
    offs = tl.arange(0, BLOCK)
    for r in range(0, n_rows):
        for h0 in range(0, hidden, BLOCK):
            m = h0 + offs < hidden
            v = tl.load(x_ptr + r * x_stride + h0 + offs, mask=m)
            tl.store(hx_ptr + r * hidden + h0 + offs, v, mask=m)
    tl.store(hcount_ptr, count)
    tl.store(hnrows_ptr, n_rows)
    seq = tl.load(seq_ptr) + 1
    tl.store(seq_ptr, seq)
    offs_f = tl.arange(0, FENCE)
    f = _fence_sys(offs_f)  # the inputs reach host memory before the ring
    tl.debug_barrier()
    tl.store(ring_ptr + offs_f * 0, seq + (f * 0).to(tl.int64), mask=offs_f == 0)


@triton.jit
def _served(seq_ptr, done_ptr, max_spins):
    """Poll ``done`` until it equals ``seq`` (True), or ``max_spins`` times (False)."""
    seq = tl.load(seq_ptr)
    d = tl.load(done_ptr, volatile=True)
    spins = max_spins * 0  # (an int32 tensor: Triton's loop-carried types must not change)
    while (d != seq) & (spins < max_spins):
        d = tl.load(done_ptr, volatile=True)
        spins += 1
    return d == seq


@triton.jit
def _post_kernel(x_ptr, x_stride, rows_ptr, experts_ptr, weights_ptr, count_ptr, seq_ptr,
                 hx_ptr, hrows_ptr, hexperts_ptr, hweights_ptr, hcount_ptr, hnrows_ptr,
                 ring_ptr, n_rows, hidden, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    count = tl.load(count_ptr)
    if count > 0:
        offs_i = tl.arange(0, BLOCK_I)
        for i0 in range(0, count, BLOCK_I):
            mi = i0 + offs_i < count
            tl.store(hrows_ptr + i0 + offs_i, tl.load(rows_ptr + i0 + offs_i, mask=mi), mask=mi)
            tl.store(hexperts_ptr + i0 + offs_i, tl.load(experts_ptr + i0 + offs_i, mask=mi),
                     mask=mi)
            tl.store(hweights_ptr + i0 + offs_i, tl.load(weights_ptr + i0 + offs_i, mask=mi),
                     mask=mi)
        _post_tail(x_ptr, x_stride, n_rows, hidden, hx_ptr, hcount_ptr, hnrows_ptr, seq_ptr,
                   ring_ptr, count, BLOCK_H, 256)  # (8 warps)


@triton.jit
def _wait_merge_kernel(out_ptr, out_stride, count_ptr, seq_ptr, done_ptr, part_ptr,
                       status_ptr, max_spins, H: tl.constexpr, BLOCK_H: tl.constexpr):
    count = tl.load(count_ptr)
    if count > 0:
        r = tl.program_id(0)
        hb = tl.program_id(1)
        offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = offs < H
        if _served(seq_ptr, done_ptr, max_spins):
            f = _fence_sys(offs)  # the partial is read after done was seen
            tl.debug_barrier()
            p = tl.load(part_ptr + r * H + offs + f * 0, mask=m, volatile=True)
            o = tl.load(out_ptr + r * out_stride + offs, mask=m).to(tl.float32)
            tl.store(out_ptr + r * out_stride + offs, (o + p).to(out_ptr.dtype.element_ty),
                     mask=m)  # (round to nearest even, as torch's add_)
        else:
            tl.store(status_ptr, 1)  # the executor did not answer: raised by CpuBranch.check


@triton.jit
def _reduce_merge_kernel(in_ptr, in_stride0, in_stride1, out_ptr, out_stride, part_ptr,
                         part_stride, hidden, count_ptr, seq_ptr, done_ptr, status_ptr,
                         max_spins, TOPK: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_H: tl.constexpr):
    # SGLang's _moe_sum_reduce_kernel (fused_moe_triton_kernels.py): fp32, top-k in order,
    # times the scale; then the partial, before the one rounding. Top-k unrolled, as
    # sgl_kernel's moe_sum_reduce: every load is issued before the sum waits on one.
    count = tl.load(count_ptr)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        acc += tl.load(in_ptr + r * in_stride0 + j * in_stride1 + offs, mask=m,
                       other=0.0).to(tl.float32)
    acc *= SCALE
    if count > 0:
        if _served(seq_ptr, done_ptr, max_spins):
            f = _fence_sys(offs)  # the partial is read after done was seen
            tl.debug_barrier()
            acc += tl.load(part_ptr + r * part_stride + offs + f * 0, mask=m, other=0.0,
                           volatile=True)
        else:
            tl.store(status_ptr, 1)  # the executor did not answer: raised by CpuBranch.check
    tl.store(out_ptr + r * out_stride + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def post(x: torch.Tensor, rows, experts, weights, count, seq, host: dict) -> None:
    """Copy a layer call's CPU work into the mapped host buffers and ring the doorbell, or do
    nothing when ``count[0] == 0`` (a kernel of its own: the decision kernel posts itself
    with ``decide(post=)``; this one serves ``CpuBranch.fold = False``).

    Args:
        x: ``[T, H]`` activations (CUDA, ``stride(1) == 1``).
        rows, experts, weights: ``[n]`` int32, int32, fp32 work items (``CpuWork``).
        count: int32 ``[1]`` item count; seq: int64 ``[1]`` device sequence counter.
        host: as ``DoorbellPost.host``.

    Raises:
        ValueError: ``x`` or the items do not fit the host buffers, ``x``'s rows are not
            contiguous, or ``count`` is not int32.
    """
    T, H = x.shape
    check_post(x, rows.numel(), host)
    if count.dtype != torch.int32:
        raise ValueError(f"doorbell.post: the count must be int32, not {count.dtype}")
    _post_kernel[(1,)](
        x, x.stride(0), rows, experts, weights, count, seq,
        host["x"], host["rows"], host["experts"], host["weights"], host["count"],
        host["n_rows"], host["ring"], T, H,
        BLOCK_H=min(4096, triton.next_power_of_2(H)), BLOCK_I=512, num_warps=8,
    )


def wait_merge(out: torch.Tensor, count, seq, done, partial, status,
               max_spins: int = 1 << 24) -> None:
    """Wait until the executor has served the call posted last (``done == seq``), then add its
    fp32 partial ``[T, H]`` (UVA alias of host memory) to ``out`` ``[T, H]`` in place, computing
    in fp32; nothing when ``count[0] == 0``. After ``max_spins`` polls of ``done`` without an
    answer (a count of PCIe reads, not a time: how long 2^24 take is not measured) it sets
    ``status[0] = 1`` and leaves ``out`` unchanged; ``CpuBranch.check`` raises on it after the
    step."""
    T, H = out.shape
    block = min(1024, triton.next_power_of_2(H))
    _wait_merge_kernel[(T, triton.cdiv(H, block))](
        out, out.stride(0), count, seq, done, partial, status, max_spins, H=H,
        BLOCK_H=block, num_warps=4,
    )


def reduce_merge(expert_out: torch.Tensor, out: torch.Tensor, scale: float, count, seq, done,
                 partial, status, max_spins: int = 1 << 24) -> None:
    """SGLang's sum-reduce of a MoE's expert outputs, with the CPU partial merged into it:
    ``out[t] = round(sum_j expert_out[t, j] * scale (+ partial[t]))``, in fp32 with j in
    order from 0 and one rounding to ``out``'s dtype (nearest even), as SGLang's
    ``moe_sum_reduce_triton`` and sgl_kernel's ``moe_sum_reduce`` compute the sum. The partial
    is added only when ``count[0] > 0``, after waiting for ``done == seq`` as ``wait_merge``
    does; if the executor does not answer within ``max_spins`` polls, ``out`` is the sum alone
    and ``status[0] = 1``. One kernel either way (it replaces SGLang's sum-reduce,
    ``CpuBranch.merging_reduce``).

    Args:
        expert_out: ``[T, k, H]`` the down projection's outputs, router weights applied
            (SGLang's ``intermediate_cache3``; ``stride(2) == 1``).
        out: ``[T, H]`` the layer output (``stride(1) == 1``), written.
        scale: ``routed_scaling_factor`` (1.0 for none).
        count: int32 ``[1]`` the call's CPU item count; seq, done: int64 ``[1]``, the device
            counter and the UVA alias of the host's answer.
        partial: fp32 ``[>= T, H]`` UVA alias of the executor's output (``stride(1) == 1``).
        status: int32 ``[1]`` UVA alias, set to 1 when the executor did not answer.

    Raises:
        ValueError: shapes or strides that do not match.
    """
    T, k, H = expert_out.shape
    if out.shape != (T, H) or expert_out.stride(2) != 1 or out.stride(1) != 1 \
            or partial.shape[0] < T or partial.shape[1] != H or partial.stride(1) != 1:
        raise ValueError(
            f"doorbell.reduce_merge: expert outputs {list(expert_out.shape)} (strides "
            f"{expert_out.stride()}), out {list(out.shape)} (strides {out.stride()}) and a "
            f"partial {list(partial.shape)} do not match")
    block = min(REDUCE_BLOCK, triton.next_power_of_2(H))
    _reduce_merge_kernel[(T, triton.cdiv(H, block))](
        expert_out, expert_out.stride(0), expert_out.stride(1), out, out.stride(0), partial,
        partial.stride(0), H, count, seq, done, status, max_spins, TOPK=k,
        SCALE=float(scale), BLOCK_H=block, num_warps=REDUCE_WARPS,
        enable_fp_fusion=False,  # the scale's product rounds before the partial is added
    )
