"""The CPU branch's two GPU kernels for the doorbell (``ft_doorbell`` in cpu_executor.h): post a layer call's CPU work into mapped host memory, and wait for its partial and merge it; both do nothing when the call has no CPU item.

The host buffers are reached through unified virtual addressing (pinned memory aliased as CUDA
tensors). Ordering across PCIe uses system-scope fences (PTX ``fence.sc.sys``): the inputs
before the ring on the GPU side; the CPU's partial before ``done`` on the host side, and the
GPU reads the partial only after it has seen ``done`` and fenced.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fence_sys(x):
    """``fence.sc.sys`` in every thread (returns ``x``, so the compiler keeps it in order)."""
    return tl.inline_asm_elementwise(
        "fence.sc.sys; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _post_kernel(x_ptr, x_stride, rows_ptr, experts_ptr, weights_ptr, count_ptr, seq_ptr,
                 hx_ptr, hrows_ptr, hexperts_ptr, hweights_ptr, hcount_ptr, hnrows_ptr,
                 ring_ptr, n_rows, n_items, H: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr):
    count = tl.load(count_ptr)
    if count > 0:
        offs_h = tl.arange(0, BLOCK_H)
        for r in range(0, n_rows):
            for h0 in range(0, H, BLOCK_H):
                m = h0 + offs_h < H
                v = tl.load(x_ptr + r * x_stride + h0 + offs_h, mask=m)
                tl.store(hx_ptr + r * H + h0 + offs_h, v, mask=m)
        offs_i = tl.arange(0, BLOCK_I)
        for i0 in range(0, n_items, BLOCK_I):
            mi = i0 + offs_i < n_items
            tl.store(hrows_ptr + i0 + offs_i, tl.load(rows_ptr + i0 + offs_i, mask=mi), mask=mi)
            tl.store(hexperts_ptr + i0 + offs_i, tl.load(experts_ptr + i0 + offs_i, mask=mi),
                     mask=mi)
            tl.store(hweights_ptr + i0 + offs_i, tl.load(weights_ptr + i0 + offs_i, mask=mi),
                     mask=mi)
        tl.store(hcount_ptr, count)
        tl.store(hnrows_ptr, n_rows)
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        f = _fence_sys(offs_i)  # the inputs reach host memory before the ring
        tl.debug_barrier()
        tl.store(ring_ptr + offs_i * 0, seq + (f * 0).to(tl.int64), mask=offs_i == 0)


@triton.jit
def _wait_merge_kernel(out_ptr, out_stride, count_ptr, seq_ptr, done_ptr, part_ptr,
                       status_ptr, max_spins, H: tl.constexpr, BLOCK_H: tl.constexpr):
    count = tl.load(count_ptr)
    if count > 0:
        r = tl.program_id(0)
        hb = tl.program_id(1)
        seq = tl.load(seq_ptr)
        d = tl.load(done_ptr, volatile=True)
        spins = max_spins * 0  # (an int32 tensor: Triton's loop-carried types must not change)
        while (d != seq) & (spins < max_spins):
            d = tl.load(done_ptr, volatile=True)
            spins += 1
        offs = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        m = offs < H
        if d == seq:
            f = _fence_sys(offs)  # the partial is read after done was seen
            tl.debug_barrier()
            p = tl.load(part_ptr + r * H + offs + f * 0, mask=m, volatile=True)
            o = tl.load(out_ptr + r * out_stride + offs, mask=m).to(tl.float32)
            tl.store(out_ptr + r * out_stride + offs, (o + p).to(out_ptr.dtype.element_ty),
                     mask=m)  # (round to nearest even, as torch's add_)
        else:
            tl.store(status_ptr, 1)  # the executor did not answer: raised by CpuBranch.check


def post(x: torch.Tensor, rows, experts, weights, count, seq, host: dict) -> None:
    """Copy a layer call's CPU work into the mapped host buffers and ring the doorbell, or do
    nothing when ``count[0] == 0``.

    Args:
        x: ``[T, H]`` activations (CUDA, ``stride(1) == 1``).
        rows, experts, weights: ``[n]`` int32, int32, fp32 work items (``CpuWork``).
        count: int32 ``[1]`` item count; seq: int64 ``[1]`` device sequence counter.
        host: UVA aliases of the mapped host buffers: ``x`` ``[max_rows, H]``, ``rows``,
            ``experts``, ``weights``, ``count``, ``n_rows`` (int32 ``[1]``), ``ring``
            (int64 ``[1]``).

    Raises:
        ValueError: ``x`` or the items do not fit the host buffers, ``x``'s rows are not
            contiguous, or ``count`` is not int32.
    """
    T, H = x.shape
    n = rows.numel()
    if x.stride(1) != 1 or count.dtype != torch.int32 or T > host["x"].shape[0] \
            or n > host["rows"].numel():
        raise ValueError(
            f"doorbell.post: x [{T}, {H}] (stride {x.stride()}), {n} items and a {count.dtype} "
            f"count do not fit the branch's buffers ({host['x'].shape[0]} rows, "
            f"{host['rows'].numel()} items, int32 count, rows of stride 1)")
    _post_kernel[(1,)](
        x, x.stride(0), rows, experts, weights, count, seq,
        host["x"], host["rows"], host["experts"], host["weights"], host["count"],
        host["n_rows"], host["ring"], T, n, H=H,
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
