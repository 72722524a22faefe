"""Plain-torch gated DeltaNet (Qwen3-Next, Qwen3.5) operations for the CPU stand-in.

Layouts follow SGLang 0.5.17's CPU call sites (``layers/attention/linear/gdn_backend.py``,
``kernels/gdn_triton.py``) and sgl-kernel's CPU ops: q/k ``[1, T, H, K]``, v ``[1, T, HV,
V]``, gates ``[T, HV]``, recurrent states ``[slots, HV, V, K]`` (fp32), conv states ``[slots,
dim, width - 1]``; states are updated in place at the given slots. V-head ``i`` reads k-head
``i // (HV / H)``. Checked against transformers' torch references
(tests/test_stub_gdn_ops.py) and inside SGLang (tests/test_hybrid_cpu.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gating(A_log, a, b, dt_bias, beta_sp: float = 1.0, threshold: float = 20.0):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``."""
    g = -torch.exp(A_log.float()) * F.softplus(
        a.float() + dt_bias.float(), beta=beta_sp, threshold=threshold
    )
    return g, torch.sigmoid(b.float())


def delta_rule(q, k, v, g, beta, state, use_l2norm: bool):
    """One sequence: q, k ``[T, H, K]``, v ``[T, HV, V]``, g, beta ``[T, HV]``, state ``[HV, V,
    K]`` (not modified). Returns the output ``[T, HV, V]`` (fp32) and the new state."""
    q, k, v = q.float(), k.float(), v.float()
    if use_l2norm:
        q, k = l2norm(q), l2norm(k)
    rep = v.shape[1] // q.shape[1]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    q = q * q.shape[-1] ** -0.5
    S = state.float().clone()  # [HV, V, K]
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        S = S * g[t].float().exp()[:, None, None]
        kv = (S * k[t][:, None, :]).sum(-1)  # [HV, V]
        delta = (v[t] - kv) * beta[t].float()[:, None]
        S = S + delta[:, :, None] * k[t][:, None, :]
        out[t] = (S * q[t][:, None, :]).sum(-1)
    return out, S


def causal_conv(x, window, weight, bias, silu: bool):
    """Depthwise causal conv of ``x [dim, T]`` after ``window [dim, width - 1]``."""
    z = torch.cat([window.to(x.dtype), x], dim=-1)
    y = F.conv1d(z.unsqueeze(0), weight.unsqueeze(1), bias, groups=x.shape[0])[0]
    return F.silu(y) if silu else y
