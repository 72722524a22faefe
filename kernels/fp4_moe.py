"""Triton kernels that run a decode-sized MoE call straight from FP4 slots (MXFP4, NVFP4).

``fp4_moe`` reads each routed expert's packed e2m1 codes and block scales from the slot banks
and decodes them in registers (no dequantized copy): kernel 1 computes, per (token, expert)
pair and block of I, the gate and up dot products over H, the bias, and the activation;
kernel 2 computes, per token and block of H, the down projection of each of the token's k
pairs, its bias and router weight, and their sum. Each weight is the dequantized weight of
``experts/formats.py`` exactly (rounded to the activation dtype as ``kernels/fp4.py`` writes
it), and the rounding points are those of SGLang 0.5.17's Triton sequence
(``_fused_moe_kernel_sequence``) over the dequantized experts, so the output differs from it
only by fp32 accumulation order (and the last bits of exp/sigmoid). Static grids from T and
k, no host sync, no atomics: CUDA-graph safe and deterministic. ``execute/slot_moe.py`` runs
it for FP4 calls of at most ``DIRECT_FP4_MAX_PAIRS`` pairs.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch
import triton
import triton.language as tl

from freetoken_sglang.kernels.fp4 import _bf16_bits, _e4m3, _e8m0

#: Activation codes of kernel 1 (the function SGLang's sequence applies after GEMM1).
ACT_SILU = 0  # silu_and_mul (CUDA kernel: gate / (1 + exp(-gate)) * up)
ACT_SWIGLU = 1  # swiglu_gpt_oss_sigmoid_alpha / swiglu_no_interleaved_with_alpha_and_limit
ACT_SILU_CLAMP = 2  # _swiglu_silu_clamp_mul (limit, no alpha)

#: Default block sizes: output columns of I per kernel-1 program (2 * BLOCK_N rows of w13),
#: rows of H per kernel-2 program, code bytes a row per loop step of each kernel, warps.
#: GPT-OSS-120B at T=1 (I = H = 2880, k = 4): 720 kernel-1 and 360 kernel-2 programs.
DEFAULT_BLOCKS = dict(BLOCK_N=16, BLOCK_H=8, BLOCK_K1=128, BLOCK_K2=128, WARPS_UP=4,
                      WARPS_DOWN=4)

_TWO_126 = tl.constexpr(8.507059173023462e37)  # 2^126, exact in fp32


def activation_code(activation: str, is_gated: bool, gemm1_alpha: Optional[float],
                    gemm1_limit: Optional[float], swiglu_limit: Optional[float],
                    gate_up_interleaved: bool):
    """``(code, interleaved)`` of the activation SGLang's ``_fused_moe_kernel_sequence``
    applies for these ``MoeRunnerConfig`` fields, or None where ``fp4_moe`` does not
    implement it (gelu, situ, non-gated, DeepSeek-V4's ``swiglu_limit``). ``interleaved``:
    gate and up are rows 2i and 2i+1 of w13 (GPT-OSS), else rows i and I + i."""
    if activation != "silu" or not is_gated:
        return None
    if gemm1_alpha is not None:
        return (ACT_SWIGLU, bool(gate_up_interleaved)) if gemm1_limit is not None else None
    if gemm1_limit is not None:
        return ACT_SILU_CLAMP, False
    if swiglu_limit is not None:
        return None
    return ACT_SILU, False


@triton.jit
def _e2m1_pair(byte):
    """fp32 e2m1 values of the low and high nibbles of int32 ``byte``, exact: each nibble's
    magnitude bits land in the exponent's low bits and the mantissa's top bit, its sign bit in
    the sign (``e2m1 * 2^-126``, subnormal for 0 and 0.5), then one exact multiply by 2^126.
    Equal to ``fp4._e2m1`` bit for bit, in fewer operations."""
    lo = ((byte & 0x07) << 22) | ((byte & 0x08) << 28)
    hi = ((byte & 0x70) << 18) | ((byte & 0x80) << 24)
    return (lo.to(tl.float32, bitcast=True) * _TWO_126,
            hi.to(tl.float32, bitcast=True) * _TWO_126)


@triton.jit
def _round_act(x, BF16: tl.constexpr):
    """fp32 ``x`` rounded to the activation dtype (to nearest even), as fp32."""
    if BF16:  # by hand: Triton's interpreter truncates fp32 -> bf16 casts
        bits = x.to(tl.uint32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return tl.where(x != x, x, r.to(tl.float32, bitcast=True))
    else:
        return x.to(tl.float16).to(tl.float32)


@triton.jit
def _store_act(ptr, x, mask, BF16: tl.constexpr):
    """Store fp32 ``x`` (already rounded) into an activation-dtype tensor (bf16 viewed as
    int16)."""
    if BF16:
        tl.store(ptr, _bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(tl.float16), mask=mask)


@triton.jit
def _fp4_chunk(acc, code_rows, scale_rows, s2, x_ptr, k0,
               NG: tl.constexpr, BPG: tl.constexpr, NV: tl.constexpr, ROUND_W: tl.constexpr,
               BF16: tl.constexpr):
    """``acc [R, NG, BPG] += w * x`` over code bytes ``[k0, k0 + NG*BPG)`` of rows whose code
    and scale row pointers are ``code_rows [R]`` and ``scale_rows [R]`` (BPG bytes, one scale
    each); ``x_ptr`` points at the row of activations the bytes multiply (two values a
    byte, low nibble first). ``s2 [R]``: NVFP4's scale_2 of each row."""
    g = tl.arange(0, NG)
    b = tl.arange(0, BPG)
    cols = k0 + g[:, None] * BPG + b[None, :]  # [NG, BPG] byte columns
    byte = tl.load(code_rows[:, None, None] + cols[None, :, :]).to(tl.int32)
    sbyte = tl.load(scale_rows[:, None] + (k0 // BPG + g)[None, :]).to(tl.int32)
    if NV:
        scale = _e4m3(sbyte)[:, :, None]
    else:
        scale = _e8m0(sbyte)[:, :, None]
    lo, hi = _e2m1_pair(byte)
    lo = lo * scale
    hi = hi * scale
    if NV:  # ModelOpt's definition: (e2m1 * e4m3) * scale_2 in fp32, rounded once
        lo = lo * s2[:, None, None]
        hi = hi * s2[:, None, None]
    if ROUND_W:  # the dequantized weight in the activation dtype (kernels/fp4.py)
        lo = _round_act(lo, BF16)
        hi = _round_act(hi, BF16)
    pair = tl.arange(0, 2)
    xx = tl.load(x_ptr + 2 * cols[:, :, None] + pair[None, None, :]).to(tl.float32)
    x_lo, x_hi = tl.split(xx)
    return acc + lo * x_lo[None, :, :] + hi * x_hi[None, :, :]


@triton.jit
def _fp4_rows_dot(code_rows, scale_rows, s2, x_ptr, half,
                  R: tl.constexpr, BPG: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_KT: tl.constexpr, NV: tl.constexpr, ROUND_W: tl.constexpr,
                  BF16: tl.constexpr):
    """fp32 ``[R]``: each row's dot product with the activations over all ``half`` code
    bytes: BLOCK_K bytes a step, then the remainder BLOCK_KT bytes a step (both divide it:
    no masks)."""
    main = (half // BLOCK_K) * BLOCK_K
    acc = tl.zeros((R, BLOCK_K // BPG, BPG), dtype=tl.float32)
    for k0 in range(0, main, BLOCK_K):
        acc = _fp4_chunk(acc, code_rows, scale_rows, s2, x_ptr, k0, BLOCK_K // BPG, BPG, NV,
                         ROUND_W, BF16)
    tail = tl.zeros((R, BLOCK_KT // BPG, BPG), dtype=tl.float32)
    for k0 in range(main, half, BLOCK_KT):
        tail = _fp4_chunk(tail, code_rows, scale_rows, s2, x_ptr, k0, BLOCK_KT // BPG, BPG,
                          NV, ROUND_W, BF16)
    return tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(tl.sum(tail, axis=2), axis=1)


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_x, ids_ptr, slots_ptr, weights_ptr,
    codes_ptr, scales_ptr, scale2_ptr, bias_ptr,
    out_ptr,  # [T*k, I] activation dtype (bf16 as int16)
    I, N, half, groups, halves, alpha, limit,
    TOPK: tl.constexpr, GROUP: tl.constexpr, NV: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, INTERLEAVED: tl.constexpr, ACT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr, BF16: tl.constexpr, ROUND_W: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KT: tl.constexpr,
):
    p = tl.program_id(0)  # pair t * k + j
    eid = tl.load(ids_ptr + p).to(tl.int32)
    if eid < 0:  # served elsewhere: kernel 2 skips the pair, its row stays unwritten
        return
    if HAS_SLOTS:  # a non-resident expert (-1) reads slot 0, as remap_expert_ids_ does
        slot = tl.maximum(tl.load(slots_ptr + eid).to(tl.int64), 0)
    else:
        slot = eid.to(tl.int64)
    t = p // TOPK
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < I
    cols = tl.minimum(cols, I - 1)  # the tail block re-reads the last row (no load masks)
    # one tile of 2 * BLOCK_N rows, gate and up of each column side by side
    half_of = tl.arange(0, 2)[None, :]
    if INTERLEAVED:
        rows = 2 * cols[:, None] + half_of  # contiguous rows
    else:
        rows = cols[:, None] + I * half_of
    rows = tl.reshape(rows, (2 * BLOCK_N,))
    BPG: tl.constexpr = GROUP // 2
    if NV:
        s2 = tl.load(scale2_ptr + slot * halves + (rows * halves) // N)
    else:
        s2 = tl.zeros((2 * BLOCK_N,), dtype=tl.float32)
    dots = _fp4_rows_dot(codes_ptr + slot * N * half + rows * half,
                         scales_ptr + slot * N * groups + rows * groups, s2,
                         x_ptr + t.to(tl.int64) * stride_x, half,
                         2 * BLOCK_N, BPG, BLOCK_K, BLOCK_KT, NV, ROUND_W, BF16)
    if HAS_BIAS:
        dots += tl.load(bias_ptr + slot * N + rows).to(tl.float32)
    gate, up = tl.split(tl.reshape(dots, (BLOCK_N, 2)))
    # fused_moe_kernel's epilogue: + bias (above), * router weight (on input), rounded
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + p).to(tl.float32)
        gate *= w
        up *= w
    gate = _round_act(gate, BF16)
    up = _round_act(up, BF16)
    if ACT == 0:  # silu_and_mul's kernel (elementwise/activation.cuh)
        act = gate / (1.0 + tl.exp(-gate)) * up
    elif ACT == 1:  # GPT-OSS swiglu (torch.compile'd: fp32, rounded once)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate * alpha) * (up + 1.0)
    else:  # _swiglu_silu_clamp_mul (torch.compile'd)
        act = tl.minimum(gate * tl.sigmoid(gate), limit)
        act = act * tl.minimum(tl.maximum(up, -limit), limit)
    _store_act(out_ptr + p.to(tl.int64) * I + cols, _round_act(act, BF16), mask, BF16)


@triton.jit
def _down_kernel(
    inter_ptr,  # [T*k, I] activation dtype
    ids_ptr, slots_ptr, weights_ptr,
    codes_ptr, scales_ptr, scale2_ptr, bias_ptr,
    out_ptr, stride_out,  # [T, H] activation dtype (bf16 as int16)
    H, I, half, groups, rsf,
    TOPK: tl.constexpr, GROUP: tl.constexpr, NV: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_SLOTS: tl.constexpr, MUL_WEIGHT: tl.constexpr, BF16: tl.constexpr,
    ROUND_W: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_KT: tl.constexpr,
):
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = rows < H
    rows = tl.minimum(rows, H - 1)
    BPG: tl.constexpr = GROUP // 2
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        eid = tl.load(ids_ptr + p).to(tl.int32)
        if eid >= 0:  # a -1 entry adds SGLang's zeros (filter_expert)
            if HAS_SLOTS:  # (-1: slot 0, as kernel 1)
                slot = tl.maximum(tl.load(slots_ptr + eid).to(tl.int64), 0)
            else:
                slot = eid.to(tl.int64)
            if NV:
                s2 = tl.load(scale2_ptr + slot + rows * 0)
            else:
                s2 = tl.zeros((BLOCK_H,), dtype=tl.float32)
            y = _fp4_rows_dot(codes_ptr + slot * H * half + rows * half,
                              scales_ptr + slot * H * groups + rows * groups, s2,
                              inter_ptr + p.to(tl.int64) * I, half,
                              BLOCK_H, BPG, BLOCK_K, BLOCK_KT, NV, ROUND_W, BF16)
            if HAS_BIAS:
                y += tl.load(bias_ptr + slot * H + rows).to(tl.float32)
            if MUL_WEIGHT:
                y *= tl.load(weights_ptr + p).to(tl.float32)
            total += _round_act(y, BF16)  # intermediate_cache3's rounding
    if SCALE:  # moe_sum_reduce: the fp32 sum of the k outputs times routed_scaling_factor
        total = total * rsf
    _store_act(out_ptr + t.to(tl.int64) * stride_out + rows, _round_act(total, BF16), mask,
               BF16)


def _tail_block(half: int, block: int, bpg: int) -> int:
    """The largest power of two <= ``block`` dividing ``half`` (at least ``bpg``)."""
    b = block
    while half % b:
        b //= 2
    if b < bpg:
        raise ValueError(f"{half} code bytes a row are not a multiple of the {bpg}-byte "
                         "scale blocks")
    return b


def _proj(banks: Dict[str, torch.Tensor], p: str):
    codes, scales = banks[f"{p}_weight"], banks[f"{p}_weight_scale"]
    s2 = banks.get(f"{p}_weight_scale_2")
    bias = banks.get(f"{p}_weight_bias")
    for name, b in ((f"{p}_weight", codes), (f"{p}_weight_scale", scales),
                    (f"{p}_weight_scale_2", s2), (f"{p}_weight_bias", bias)):
        if b is not None and not b.is_contiguous():
            raise ValueError(f"fp4_moe: bank {name} must be contiguous")
    return codes, scales.view(torch.uint8), s2, bias


def fp4_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_ids: torch.Tensor,
    layer_slots: Optional[torch.Tensor],
    banks: Dict[str, torch.Tensor],
    act: int,
    interleaved: bool,
    gemm1_alpha: Optional[float] = None,
    gemm1_limit: Optional[float] = None,
    apply_router_weight_on_input: bool = False,
    routed_scaling_factor: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
    blocks: Optional[dict] = None,
) -> torch.Tensor:
    """The routed-expert output of one MoE call over FP4 slot banks, with the rounding of
    SGLang 0.5.17's ``_fused_moe_kernel_sequence`` over the dequantized experts (GEMM1 + bias
    (* router weight if on input) rounded to the dtype, the activation rounded, each expert's
    GEMM2 + bias (* router weight) rounded, their fp32 sum times ``routed_scaling_factor``
    rounded: ``moe_sum_reduce``), differing only by fp32 accumulation order.

    Args:
        x: ``[T, H]`` bf16 or fp16 activations (rows contiguous).
        topk_weights: ``[T, k]`` router weights (fp32).
        routed_ids: int ``[T, k]`` local expert ids; -1 entries contribute zero.
        layer_slots: int ``[E]`` slot of each local expert (-1, no slot: slot 0 is read, as
            SGLang's path reads it after ``remap_expert_ids_``; only rows the decision treats
            as padding route there), or None (the id is the slot).
        banks: contiguous slot banks under SGLang's names: ``w13_weight`` uint8 ``[S, N, H/2]``
            (N = 2I), ``w2_weight`` uint8 ``[S, H, I/2]`` (two e2m1 codes a byte, low nibble
            first), ``{w13,w2}_weight_scale`` (uint8 e8m0 per 32 values: MXFP4; float8_e4m3fn
            per 16: NVFP4), NVFP4's fp32 ``{w13,w2}_weight_scale_2`` (``[S, 2]`` or ``[S]``,
            ``[S]``), optional ``{w13,w2}_weight_bias`` ``[S, N]``, ``[S, H]``.
        act, interleaved: ``activation_code``'s result.
        gemm1_alpha, gemm1_limit: SwiGLU's alpha and clamp limit (``ACT_SWIGLU``,
            ``ACT_SILU_CLAMP``).
        apply_router_weight_on_input: the router weight scales GEMM1's output, not GEMM2's.
        routed_scaling_factor: the sum's factor (None: 1).
        out: ``[T, H]`` of ``x``'s dtype to write (e.g. ``x`` itself: it is written after
            ``x`` is read), else a new tensor.
        blocks: overrides of ``DEFAULT_BLOCKS``.

    Returns:
        ``[T, H]`` in ``x.dtype`` (``out`` when given).

    Raises:
        ValueError: another dtype than bf16/fp16, a non-contiguous bank, banks whose shapes
            are not the format's unpadded experts (scale blocks of 32, NVFP4 16), or top-k
            weights not shaped as the ids.
    """
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp4_moe: activations must be bf16 or fp16, not {x.dtype}")
    if x.stride(-1) != 1:
        raise ValueError("fp4_moe: x's rows must be contiguous")
    cfg = {**DEFAULT_BLOCKS, **(blocks or {})}
    T, H = x.shape
    k = routed_ids.shape[1]
    c13, s13, s2_13, b13 = _proj(banks, "w13")
    c2, s2c, s2_2, b2 = _proj(banks, "w2")
    N, I = c13.shape[1], c2.shape[2] * 2
    nv = s2_13 is not None
    group = H // s13.shape[-1]
    if (group != (16 if nv else 32) or s13.shape[-1] * group != H or N != 2 * I
            or c13.shape[2] * 2 != H or s2c.shape[-1] * group != I
            or topk_weights.shape != routed_ids.shape):
        raise ValueError(
            f"fp4_moe: banks w13 {tuple(c13.shape)} (scales {tuple(s13.shape)}), w2 "
            f"{tuple(c2.shape)} (scales {tuple(s2c.shape)}) for x [{T}, {H}] are not unpadded "
            f"{'NVFP4 (scale per 16)' if nv else 'MXFP4 (scale per 32)'} experts [S, 2I, H/2], "
            f"[S, H, I/2], or the top-k weights {tuple(topk_weights.shape)} are not the ids' "
            f"{tuple(routed_ids.shape)}")
    bf16 = x.dtype == torch.bfloat16
    round_w = nv or not bf16  # MXFP4 weights are exact in bf16
    ids = routed_ids.contiguous()
    weights = topk_weights.contiguous()
    slots = layer_slots if layer_slots is not None else ids  # a dummy pointer
    dummy = c13
    inter = torch.empty((T * k, I), dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError("fp4_moe: out must be a [T, H] tensor of x's dtype, rows contiguous")
    if T == 0:
        return out
    half13, half2 = H // 2, I // 2
    bpg = group // 2
    view = (lambda t: t.view(torch.int16)) if bf16 else (lambda t: t)
    _gate_up_kernel[(T * k, triton.cdiv(I, cfg["BLOCK_N"]))](
        x, x.stride(0), ids, slots, weights,
        c13, s13, s2_13.reshape(s2_13.shape[0], -1) if nv else dummy,
        b13 if b13 is not None else dummy, view(inter),
        I, N, half13, s13.shape[-1], s2_13[0].numel() if nv else 1,
        float(gemm1_alpha or 0.0), float(gemm1_limit or 0.0),
        TOPK=k, GROUP=group, NV=nv, HAS_BIAS=b13 is not None,
        HAS_SLOTS=layer_slots is not None, INTERLEAVED=interleaved, ACT=act,
        MUL_WEIGHT=apply_router_weight_on_input, BF16=bf16, ROUND_W=round_w,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K1"],
        BLOCK_KT=_tail_block(half13, cfg["BLOCK_K1"], bpg), num_warps=cfg["WARPS_UP"],
    )
    rsf = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    _down_kernel[(T, triton.cdiv(H, cfg["BLOCK_H"]))](
        inter, ids, slots, weights,
        c2, s2c, s2_2 if nv else dummy, b2 if b2 is not None else dummy,
        view(out), out.stride(0),
        H, I, half2, s2c.shape[-1], rsf,
        TOPK=k, GROUP=I // s2c.shape[-1], NV=nv, HAS_BIAS=b2 is not None,
        HAS_SLOTS=layer_slots is not None, MUL_WEIGHT=not apply_router_weight_on_input,
        BF16=bf16, ROUND_W=round_w, SCALE=rsf != 1.0,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_K=cfg["BLOCK_K2"],
        BLOCK_KT=_tail_block(half2, cfg["BLOCK_K2"], (I // s2c.shape[-1]) // 2),
        num_warps=cfg["WARPS_DOWN"],
    )
    return out


def fp4_moe_bytes(T: int, k: int, H: int, I: int, nv: bool, gated: bool = True,
                  bias: bool = False) -> int:
    """Bytes of weights ``fp4_moe`` reads for a call of T*k pairs, every pair's expert read
    once by kernel 1 and once by kernel 2 (codes, scales, scale_2, biases; the activations
    and the [T*k, I] intermediate are left out)."""
    group = 16 if nv else 32
    n = (2 if gated else 1) * I
    per = n * (H // 2 + H // group) + H * (I // 2 + I // group)
    if bias:
        per += 2 * (n + H)
    if nv:
        per += 4 * 3
    return T * k * per
