"""Plain-torch Qwen3.5 operations for the CPU stand-in.

SGLang 0.5.17's ``models/qwen3_5.py`` binds four ``torch.ops.sgl_kernel`` ops at import time
when it runs on the CPU; these are their bodies (registered in ``__init__.py``). Signatures and
layouts follow sgl-kernel's CPU ops; the math follows SGLang's Triton versions
(``kernels/ops/elementwise/elementwise.py``, ``models/utils.py``,
``kernels/ops/attention/triton_gdn_fused_proj.py``), computed in fp32 and returned in the input
dtype. Checked against transformers' Qwen3.5 modules in tests/test_stub_gdn_ops.py.
"""

from __future__ import annotations

import torch


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * (1 + weight)`` over the last dim, in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x [T, H * D] * sigmoid(gate)``; ``gate`` is ``[T, H * D]`` or ``[T, H, D]``."""
    return (x.float() * torch.sigmoid(gate.reshape(x.shape).float())).to(x.dtype)


def qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """Per-head Gemma RMSNorm of ``q [T, H * D]`` and ``k [T, Hkv * D]``; same shapes out."""
    qn = gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps).reshape(q.shape)
    kn = gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps).reshape(k.shape)
    return qn, kn


def qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps: float, head_dim: int,
                               num_heads: int):
    """``q_gate [T, H * 2D]`` interleaved per head as ``[q_h, gate_h]``, ``k [T, Hkv * D]``.
    Returns normed q ``[T * H, D]``, normed k ``[T * Hkv, D]`` and the gate ``[T * H, D]``."""
    q, gate = q_gate.reshape(-1, num_heads, 2 * head_dim).split(head_dim, dim=-1)
    q = gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps)
    k = gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps)
    return q, k, _fresh(gate.reshape(-1, head_dim))


def qkvzba_split_contiguous(mixed_qkvz, mixed_ba, num_heads_qk: int, num_heads_v: int,
                            head_qk: int, head_v: int):
    """Split ``mixed_qkvz [T, q | k | v | z]`` and ``mixed_ba [T, b | a]`` (Qwen3.5's
    separate projections) into ``mixed_qkv [T, q | k | v]``, ``z [T, Hv, Dv]``, ``b``, ``a
    [T, Hv]``, all fresh and contiguous."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    mixed_qkv, z = mixed_qkvz.split([qkv_dim, num_heads_v * head_v], dim=-1)
    b, a = mixed_ba.split(num_heads_v, dim=-1)
    return _fresh(mixed_qkv), _fresh(z.reshape(-1, num_heads_v, head_v)), _fresh(b), _fresh(a)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy (a custom op's outputs may not alias its inputs)."""
    return x.clone(memory_format=torch.contiguous_format)
