"""SGLang's fused-MoE GEMM with FP4 weights decoded in registers: its arithmetic over slots.

``fp4_fused_moe_gemm`` is SGLang 0.5.17's ``invoke_fused_moe_kernel`` / ``fused_moe_kernel``
(``sglang/kernels/ops/moe/fused_moe_triton_kernels.py``, the unquantized branch without TMA) for
FP4 slot banks (MXFP4, NVFP4): the same program grid, token gather, tile shapes and
``acc += tl.dot(a, b)`` over the config's ``BLOCK_SIZE_K``, the same epilogue (bias, router
weight, one rounding), but each B tile is decoded from the FP4 codes and block scales into the
activation dtype in registers (``kernels/fp4.py``'s values bit for bit) instead of loaded from
dequantized copies. Inside SGLang's own kernel sequence (``patches/fused_moe.py``
``gemm_replaced``) a call therefore computes what SGLang computes over the dequantized experts,
with the same MMA chain per output element, and reads a quarter of their bytes.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import triton
import triton.language as tl

from freetoken_sglang.kernels.fp4 import _e2m1, _e4m3, _e8m0


@triton.jit
def _fp4_fused_moe_kernel(
    a_ptr, codes_ptr, scales_ptr, scale2_ptr, bias_ptr, c_ptr, topk_weights_ptr,
    sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    N, K, EM, num_valid_tokens,
    stride_am, stride_ak, stride_bias_e, stride_bias_n, stride_cm, stride_cn,
    half_k,  # code bytes a weight row (K / 2)
    groups,  # scales a weight row (K / GROUP)
    halves,  # NVFP4's scale_2 entries an expert
    GROUP: tl.constexpr, NV: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, top_k: tl.constexpr,
    compute_type: tl.constexpr, even_Ks: tl.constexpr, c_sorted: tl.constexpr,
    filter_expert: tl.constexpr,
):
    # fused_moe_kernel's program mapping (grouped ordering)
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    num_tokens_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_SIZE_M >= num_tokens_post_padded:
        return
    offs_token_id = pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    offs_token = tl.load(sorted_token_ids_ptr + offs_token_id).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    off_experts = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    if c_sorted:
        c_ptrs = c_ptr + stride_cm * offs_token_id[:, None] + stride_cn * offs_cn[None, :]
    else:
        c_ptrs = c_ptr + stride_cm * offs_token[:, None] + stride_cn * offs_cn[None, :]
    c_mask = token_mask[:, None] & (offs_cn[None, :] < N)
    if filter_expert and off_experts == -1:  # write_zeros_to_output
        tl.store(c_ptrs, tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=compute_type),
                 mask=c_mask)
        return
    offs_bn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + (offs_token[:, None] // top_k * stride_am + offs_k[None, :] * stride_ak)
    w_rows = off_experts * N + offs_bn  # the tile's weight rows in the [S * N] banks
    code_rows = codes_ptr + w_rows * half_k
    scale_rows = scales_ptr + w_rows * groups
    if NV:  # scale_2 of each row's half (gate, up) or of the expert
        s2 = tl.load(scale2_ptr + off_experts * halves + (offs_bn * halves) // N)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + off_experts * stride_bias_e + offs_bn[None, :] * stride_bias_n)
    accumulator = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_SIZE_K):
        kk = k_start + offs_k
        if even_Ks:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            byte = tl.load(code_rows[None, :] + (kk // 2)[:, None]).to(tl.int32)
            sbyte = tl.load(scale_rows[None, :] + (kk // GROUP)[:, None]).to(tl.int32)
        else:
            a = tl.load(a_ptrs, mask=token_mask[:, None] & (offs_k[None, :] < K - k_start),
                        other=0.0)
            kmask = (kk < K)[:, None]
            byte = tl.load(code_rows[None, :] + (kk // 2)[:, None], mask=kmask,
                           other=0).to(tl.int32)
            sbyte = tl.load(scale_rows[None, :] + (kk // GROUP)[:, None], mask=kmask,
                            other=0).to(tl.int32)
        code = tl.where((kk % 2 == 0)[:, None], byte & 15, byte >> 4)  # low nibble first
        if NV:
            w = _e2m1(code) * _e4m3(sbyte) * s2[None, :]
        else:
            w = _e2m1(code) * _e8m0(sbyte)
        if not even_Ks:
            w = tl.where(kmask, w, 0.0)  # SGLang's masked B loads give 0
        b = w.to(compute_type)  # [BLOCK_SIZE_K, BLOCK_SIZE_N]: the dequantized weights
        accumulator += tl.dot(a, b)
        a_ptrs += BLOCK_SIZE_K * stride_ak
    if HAS_BIAS:
        accumulator += bias
    if MUL_ROUTED_WEIGHT:
        moe_weight = tl.load(topk_weights_ptr + offs_token, mask=token_mask, other=0)
        accumulator *= moe_weight[:, None]
    tl.store(c_ptrs, accumulator.to(compute_type), mask=c_mask)


def fp4_fused_moe_gemm(A: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                       scale_2: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                       C: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       sorted_token_ids: torch.Tensor, expert_ids: torch.Tensor,
                       num_tokens_post_padded: torch.Tensor, mul_routed_weight: bool,
                       top_k: int, config: Dict[str, Any], compute_type,
                       c_sorted: bool = False, filter_expert: bool = True) -> None:
    """``invoke_fused_moe_kernel``'s unquantized call with B given as FP4 slot banks:
    ``C[token * top_k + j] = round((A[token] @ dequant(B[e]).T + bias[e]) (* weight))``.

    Args:
        A: ``[M, K]`` activations (bf16 or fp16, ``compute_type``).
        codes: uint8 ``[S, N, K/2]`` e2m1 codes, low nibble first; scales: ``[S, N, K/32]``
            e8m0 bytes (MXFP4) or ``[S, N, K/16]`` float8_e4m3fn (NVFP4, with ``scale_2``
            fp32 ``[S]`` or ``[S, 2]``, the latter by halves of the N rows).
        bias: ``[S, N]`` or None; C: the output (``[M * top_k, N]`` rows by token id, or
            by sorted position with ``c_sorted``).
        topk_weights, topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded,
        mul_routed_weight, top_k, config, compute_type, c_sorted, filter_expert: as
            SGLang's ``invoke_fused_moe_kernel`` (``expert_ids``: slot rows, -1 skipped).

    Raises:
        ValueError: banks whose shapes do not match the format, or a K that is not a multiple
            of the scale group.
    """
    S, N, half_k = codes.shape
    K = 2 * half_k
    nv = scale_2 is not None
    group = K // scales.shape[-1]
    if scales.shape[:2] != (S, N) or group != (16 if nv else 32) or A.shape[-1] != K:
        raise ValueError(
            f"fp4_fused_moe_gemm: codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and "
            f"activations {tuple(A.shape)} are not one {'NVFP4' if nv else 'MXFP4'} GEMM")
    s2 = scale_2.reshape(S, -1) if nv else codes  # (a dummy pointer for MXFP4)
    grid = (triton.cdiv(sorted_token_ids.shape[0], config["BLOCK_SIZE_M"])
            * triton.cdiv(N, config["BLOCK_SIZE_N"]),)
    _fp4_fused_moe_kernel[grid](
        A, codes, scales.view(torch.uint8), s2, bias if bias is not None else codes, C,
        topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        N, K, sorted_token_ids.shape[0], topk_ids.numel(),
        A.stride(0), A.stride(1),
        bias.stride(0) if bias is not None else 0, bias.stride(1) if bias is not None else 0,
        C.stride(-2), C.stride(-1), half_k, scales.shape[-1], s2.shape[1] if nv else 1,
        GROUP=group, NV=nv, HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k, compute_type=compute_type,
        even_Ks=K % config["BLOCK_SIZE_K"] == 0, c_sorted=c_sorted,
        filter_expert=filter_expert, **config,
    )
