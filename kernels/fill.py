"""Triton kernels that copy planned expert rows from the pinned host pool into GPU slots
through unified virtual addressing (the ``uva`` fill of ``freetoken_sglang/cache/fills.py``):
every bank of a fill in one launch (``copy_rows_banks``), which can also rewrite a call's
per-block expert ids to slot ids (the remap of ``kernels/residency.py``), saving its launch."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from freetoken_sglang.kernels.residency import remap_block, remap_expert_ids_

_BLOCK = 4096


@functools.lru_cache(maxsize=None)
def _max_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` reinterpreted with the widest integer element its row size allows."""
    row_bytes = t[0].numel() * t.element_size()
    flat = t.reshape(t.shape[0], -1)
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row_bytes % size == 0 and t.element_size() <= size:
            return flat.view(dtype)
    return flat.view(torch.uint8)


def copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    count: torch.Tensor,
) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count[0]``, all read on the device: one
    bank's ``copy_rows_banks``.

    Args:
        src: ``[R, ...]`` rows to read (a UVA alias of pinned host memory, or device memory).
        dst: ``[S, ...]`` contiguous device rows, same row shape and dtype as ``src``.
        src_idx, dst_idx: int32 ``[K]`` on the device.
        count: int32 ``[1]`` on the device, at most ``K``.

    Raises:
        ValueError: the rows differ, or a bank is not contiguous.
    """
    copy_rows_banks([src], [dst], src_idx, dst_idx, count)


# Banks one launch of ``copy_rows_banks`` carries (BF16 experts have 2, FP8 block 4).
MAX_BANKS = 4


@triton.jit
def _copy_chunk(src_ptr, dst_ptr, row_elems, s, d, chunk, BLOCK: tl.constexpr):
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    v = tl.load(src_ptr + s * row_elems + offs, mask=mask)
    tl.store(dst_ptr + d * row_elems + offs, v, mask=mask)


@triton.jit
def _copy_banks_kernel(
    s0, d0, r0, c0,
    s1, d1, r1, c1,
    s2, d2, r2, c2,
    s3, d3, r3, c3,
    src_idx_ptr,
    dst_idx_ptr,
    count_ptr,
    ids_ptr,  # int [n_ids] per-block expert ids rewritten to slots (REMAP)
    n_ids,
    layer_slots_ptr,  # int32 [num_experts] slot of each local expert (REMAP)
    num_experts,
    null_slot,  # the remap's null_slot (NULL_SLOT)
    BLOCK: tl.constexpr,
    REMAP: tl.constexpr,
    REMAP_BLOCK: tl.constexpr,
    KEEP_NEGATIVE: tl.constexpr,  # the remap's keep_negative
    NULL_SLOT: tl.constexpr,  # the remap has a null_slot
):
    if REMAP:  # remap_expert_ids_, the ids spread over the programs
        for i0 in range(tl.program_id(0) * REMAP_BLOCK, n_ids,
                        tl.num_programs(0) * REMAP_BLOCK):
            remap_block(ids_ptr, i0 + tl.arange(0, REMAP_BLOCK), n_ids, layer_slots_ptr,
                        num_experts, null_slot, KEEP_NEGATIVE, NULL_SLOT)
    # The (row, chunk) work of every bank of the counted rows: a row's chunks are bank 0's,
    # then bank 1's, ...; banks past the used ones have no chunks.
    n = tl.load(count_ptr)
    per_row = c0 + c1 + c2 + c3
    for w in range(tl.program_id(0), n * per_row, tl.num_programs(0)):
        i = w // per_row
        c = w % per_row
        s = tl.load(src_idx_ptr + i).to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64)
        if c < c0:
            _copy_chunk(s0, d0, r0, s, d, c, BLOCK)
        elif c < c0 + c1:
            _copy_chunk(s1, d1, r1, s, d, c - c0, BLOCK)
        elif c < c0 + c1 + c2:
            _copy_chunk(s2, d2, r2, s, d, c - c0 - c1, BLOCK)
        else:
            _copy_chunk(s3, d3, r3, s, d, c - c0 - c1 - c2, BLOCK)


# Expert ids a program of the fill rewrites per step of its remap loop
_REMAP_BLOCK = 128


def copy_rows_banks(srcs, dsts, src_idx, dst_idx, count, remap=None) -> None:
    """``dsts[b][dst_idx[i]] = srcs[b][src_idx[i]]`` for every bank ``b`` and ``i < count[0]``,
    in one kernel launch per ``MAX_BANKS`` banks (indices and count read on the device).
    With ``remap = (expert_ids, layer_slots[, keep_negative[, null_slot]])`` the first launch
    also does ``residency.remap_expert_ids_(*remap)`` (SGLang's per-block expert ids to slot
    ids; -1 stays, an expert without a slot reads slot 0, or with ``keep_negative`` gets -1,
    or with a ``null_slot`` both read that all-zero slot), so a
    decode call's fill and remap are one launch. The remap reads ``layer_slots`` only, never
    the copied rows.

    Args:
        srcs, dsts: equal-length sequences of banks as for ``copy_rows`` (``[R, ...]`` UVA
            aliases or device rows; ``[S, ...]`` contiguous device rows, same row shape and
            dtype per bank).
        src_idx, dst_idx: int32 ``[K]`` on the device.
        count: int32 ``[1]`` on the device, at most ``K``.
        remap: optional ``(expert_ids, layer_slots[, keep_negative[, null_slot]])``:
            contiguous int ``[N]`` ids rewritten in place, int32 ``[E]`` slots, on the banks'
            device, a bool (default False) and a slot row or None (with no row to copy, K = 0
            or no bank,
            ``remap_expert_ids_`` does it alone).

    Raises:
        ValueError: a bank's rows differ between source and destination, a bank is not
            contiguous, the remap's expert ids are not, the remap is not 2 to 4 items, or
            its ``null_slot`` is negative.
    """
    srcs, dsts = list(srcs), list(dsts)
    if len(srcs) != len(dsts):
        raise ValueError(f"copy_rows_banks: {len(srcs)} source banks, {len(dsts)} destinations")
    if remap is not None:
        if len(remap) not in (2, 3, 4):
            raise ValueError("copy_rows_banks: remap is "
                             "(expert_ids, layer_slots[, keep_negative[, null_slot]])")
        ids, layer_slots, keep_negative, null_slot = (*remap, False, None)[:4]
        if null_slot is not None and null_slot < 0:
            raise ValueError(f"copy_rows_banks: null_slot must be a slot row, got {null_slot}")
        if not ids.is_contiguous():
            raise ValueError("copy_rows_banks: remap needs contiguous expert ids")
    k = src_idx.numel()
    if k == 0 or not srcs:
        if remap is not None:
            remap_expert_ids_(*remap)
        return
    banks = []
    for src, dst in zip(srcs, dsts):  # every bank checked before any is copied
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(
                f"copy_rows_banks: rows differ: src {tuple(src.shape[1:])} {src.dtype}, "
                f"dst {tuple(dst.shape[1:])} {dst.dtype}"
            )
        if not (src.is_contiguous() and dst.is_contiguous()):
            raise ValueError("copy_rows_banks needs contiguous src and dst banks")
        s, d = _as_words(src), _as_words(dst)
        banks.append((s, d, s.shape[1], triton.cdiv(s.shape[1], _BLOCK)))
    for start in range(0, len(banks), MAX_BANKS):
        group = banks[start:start + MAX_BANKS]
        total = sum(b[3] for b in group)
        args = [x for b in group for x in b]
        while len(args) < 4 * MAX_BANKS:  # unused banks: no chunks
            args += args[:2] + [0, 0]
        grid = (min(k * total, _max_programs(dsts[start].device)),)
        if start == 0 and remap is not None:
            extra = (ids, ids.numel(), layer_slots, layer_slots.numel(),
                     0 if null_slot is None else int(null_slot))
        else:  # (unused: REMAP is off)
            extra = (src_idx, 0, src_idx, 0, 0)
        _copy_banks_kernel[grid](*args, src_idx, dst_idx, count, *extra, BLOCK=_BLOCK,
                                 REMAP=start == 0 and remap is not None,
                                 REMAP_BLOCK=_REMAP_BLOCK,
                                 KEEP_NEGATIVE=remap is not None and bool(keep_negative),
                                 NULL_SLOT=remap is not None and null_slot is not None)
