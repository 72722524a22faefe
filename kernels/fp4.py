"""Triton kernel that dequantizes FP4 experts (MXFP4, NVFP4) from their slots into the
activation dtype, for SGLang's unquantized MoE kernels (``execute/slot_moe.py``).

One launch per projection: it gathers the rows of the call's experts from the slot banks,
decodes e2m1 codes and their block scales arithmetically (no host tables: CUDA-graph safe)
and writes ``[n, R, C]``. The arithmetic is the formats' definitions in ``experts/formats.py``
(fp32 products, rounded once to the output dtype), so the result is bit-identical to
``dequantize_mxfp4`` / ``dequantize_nvfp4``; it reads the FP4 bytes once and writes the output
once, where the torch definitions make several fp32 passes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

_BLOCK = 512  # bytes (1024 values) of one row per program


@triton.jit
def _pow2(e):
    """fp32 ``2^e`` for int32 ``e`` in [-126, 127], built from its bits (exact; the
    hardware's exp2 is approximate and flushes subnormals)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(code):
    """fp32 value of e2m1 codes (int32, bit 3 the sign)."""
    mag = code & 7
    exp = mag >> 1
    man = (mag & 1).to(tl.float32)
    val = tl.where(exp == 0, 0.5 * man, (1.0 + 0.5 * man) * _pow2(exp - 1))
    return tl.where((code & 8) != 0, -val, val)


@triton.jit
def _e4m3(byte):
    """fp32 value of float8_e4m3fn bytes (int32)."""
    exp = (byte >> 3) & 15
    man = (byte & 7).to(tl.float32)
    val = tl.where(exp == 0, man * 0.001953125,  # subnormal: m / 8 * 2^-6
                   (1.0 + man * 0.125) * _pow2(exp - 7))
    val = tl.where((byte & 127) == 127, float("nan"), val)
    return tl.where((byte & 128) != 0, -val, val)


@triton.jit
def _e8m0(byte):
    """fp32 ``2^(byte - 127)`` of e8m0 bytes (int32): 0 is 2^-127 (subnormal), 255 inf (as
    SGLang's ``MXFP4QuantizeUtil`` computes it; the OCP format makes it NaN)."""
    bits = tl.where(byte == 0, 0x00400000, byte << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """int16 bit patterns of fp32 ``x`` rounded to bfloat16, to nearest even (finite x)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(x != x, 0x7FC0, bits.to(tl.int32))  # NaN stays NaN
    return bits.to(tl.int16)


@triton.jit
def _dequantize_kernel(
    codes_ptr,  # uint8 [S, R, C/2]
    scales_ptr,  # uint8 [S, R, C/G] (e8m0 for MX, e4m3 bytes for NV)
    scale2_ptr,  # fp32 [S, halves] (NV) or a dummy
    rows_ptr,  # int64 [n] slot row of each output expert
    out_ptr,  # [n, R, C]
    R,
    half_c,  # C / 2
    groups,  # C / G
    halves,  # scale_2 entries per expert (NV: 1, or 2 for gate and up)
    GROUP: tl.constexpr,
    NV: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)  # i * R + r
    i = row // R
    r = row % R
    slot = tl.load(rows_ptr + i).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (j < half_c) & (slot >= 0)  # a -1 row (unused) reads and writes nothing
    src = (slot * R + r) * half_c
    byte = tl.load(codes_ptr + src + j, mask=mask, other=0).to(tl.int32)
    sbyte = tl.load(scales_ptr + (slot * R + r) * groups + (2 * j) // GROUP, mask=mask,
                    other=0).to(tl.int32)
    if NV:
        scale = _e4m3(sbyte)
        s2 = tl.load(scale2_ptr + tl.maximum(slot, 0) * halves + (r * halves) // R)
    else:
        scale = _e8m0(sbyte)
    lo = _e2m1(byte & 15) * scale
    hi = _e2m1(byte >> 4) * scale
    if NV:
        lo = lo * s2
        hi = hi * s2
    dst = row.to(tl.int64) * (2 * half_c) + 2 * j
    if BF16:  # out_ptr is the bf16 output viewed as int16: round to nearest even by hand,
        # as torch does (Triton's interpreter truncates fp32 -> bf16 casts)
        lo = _bf16_bits(lo)
        hi = _bf16_bits(hi)
    tl.store(out_ptr + dst, lo.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + dst + 1, hi.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_fp4_rows(codes: torch.Tensor, scales: torch.Tensor,
                        scale_2: Optional[torch.Tensor], rows: torch.Tensor,
                        dtype: torch.dtype, out: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """The experts at slot ``rows`` of one projection's banks, dequantized.

    Args:
        codes: uint8 ``[S, R, C/2]``, two e2m1 codes per byte, low nibble first.
        scales: ``[S, R, C/32]`` uint8 e8m0 (MXFP4, ``scale_2`` None) or ``[S, R, C/16]``
            float8_e4m3fn (NVFP4).
        scale_2: NVFP4's fp32 ``[S]`` or ``[S, 2]`` (the first and second halves of the
            rows), else None.
        rows: int ``[n]`` slot rows; a -1 row is unused: nothing is read for it and its
            output is left unwritten (reading slot -1 would fall before the banks).
        dtype: the output dtype.
        out: optional contiguous ``[n, R, C]`` of ``dtype`` to write into.

    Returns:
        ``[n, R, C]`` in ``dtype``, bit-identical to ``experts.formats.dequantize_mxfp4`` /
        ``dequantize_nvfp4`` of ``codes[rows]`` (and its scales) on rows >= 0.

    Raises:
        ValueError: ``out`` of another shape, dtype or device, or not contiguous.
    """
    s, r, half_c = codes.shape
    n = rows.numel()
    if out is None:
        out = torch.empty((n, r, 2 * half_c), dtype=dtype, device=codes.device)
    elif (out.shape != (n, r, 2 * half_c) or out.dtype != dtype or not out.is_contiguous()
          or out.device != codes.device):
        raise ValueError(f"out must be a contiguous {dtype} tensor of shape "
                         f"{(n, r, 2 * half_c)} on {codes.device}, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}")
    if n == 0:
        return out
    nv = scale_2 is not None
    group = 2 * half_c // scales.shape[-1]
    s2 = scale_2.reshape(s, -1) if nv else codes  # a dummy pointer for MXFP4
    grid = (n * r, triton.cdiv(half_c, _BLOCK))
    bf16 = dtype == torch.bfloat16
    _dequantize_kernel[grid](
        codes, scales.view(torch.uint8), s2, rows.long().contiguous(),
        out.view(torch.int16) if bf16 else out, r, half_c, scales.shape[-1],
        s2.shape[1] if nv else 1, GROUP=group, NV=nv, BF16=bf16, BLOCK=_BLOCK,
    )
    return out
