"""Triton kernel that copies planned expert rows from the pinned host pool into GPU slots
through unified virtual addressing (the ``uva`` fill of ``freetoken_sglang/cache/fills.py``)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _copy_rows_kernel(
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    count_ptr,
    row_elems,
    chunks,
    BLOCK: tl.constexpr,
):
    # Persistent programs walk the (row, chunk) work of the counted rows only, so a call
    # with nothing to fill costs one load per program.
    n = tl.load(count_ptr)
    for w in range(tl.program_id(0), n * chunks, tl.num_programs(0)):
        i = w // chunks
        chunk = w % chunks
        s = tl.load(src_idx_ptr + i).to(tl.int64)
        d = tl.load(dst_idx_ptr + i).to(tl.int64)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_elems
        v = tl.load(src_ptr + s * row_elems + offs, mask=mask)
        tl.store(dst_ptr + d * row_elems + offs, v, mask=mask)


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
    """``dst[dst_idx[i]] = src[src_idx[i]]`` for ``i < count[0]``, all read on the device.

    Args:
        src: ``[R, ...]`` rows to read (a UVA alias of pinned host memory, or device memory).
        dst: ``[S, ...]`` contiguous device rows, same row shape and dtype as ``src``.
        src_idx, dst_idx: int32 ``[K]`` on the device.
        count: int32 ``[1]`` on the device; entries at or past it are skipped.
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"copy_rows: rows differ: src {tuple(src.shape[1:])} {src.dtype}, "
            f"dst {tuple(dst.shape[1:])} {dst.dtype}"
        )
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_rows needs contiguous src and dst banks")
    k = src_idx.numel()
    if k == 0:
        return
    s = _as_words(src)
    d = _as_words(dst)
    row_elems = s.shape[1]
    chunks = triton.cdiv(row_elems, _BLOCK)
    grid = (min(k * chunks, _max_programs(dst.device)),)
    _copy_rows_kernel[grid](
        s, d, src_idx, dst_idx, count, row_elems, chunks, BLOCK=_BLOCK
    )
