"""The CPU stand-in's gated DeltaNet ops (tests/stubs/sgl_kernel) against transformers' own
torch implementations (``modeling_qwen3_next``), on random inputs; the layouts are SGLang
0.5.17's CPU call sites' (tests/test_hybrid_cpu.py runs them inside SGLang)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def sk():
    """The stand-in (conftest puts tests/stubs first on sys.path where no GPU is)."""
    import sgl_kernel

    if not sgl_kernel.__version__.endswith("freetoken-cpu-stub"):
        pytest.skip("the real sgl_kernel is in use (a GPU machine)")
    return sgl_kernel


def test_chunk_rule_matches_transformers(sk):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    from sgl_kernel.mamba import chunk_gated_delta_rule_cpu

    g_ = torch.Generator().manual_seed(0)
    H, HV, K, V = 2, 4, 16, 8
    lens = [5, 70, 1]
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=g_)
    k = torch.randn(1, T, H, K, generator=g_)
    v = torch.randn(1, T, HV, V, generator=g_)
    g = -torch.rand(1, T, HV, generator=g_)
    beta = torch.rand(1, T, HV, generator=g_)
    slots = torch.tensor([3, 0, 5])
    pool = torch.randn(6, HV, V, K, generator=g_) * 0.1
    before = pool.clone()
    cu = torch.tensor([0, 5, 75, 76], dtype=torch.int32)
    o, final, _ = chunk_gated_delta_rule_cpu(q, k, v, g, beta, pool, cu, False, True, slots)
    s = 0
    for i, n in enumerate(lens):
        e = s + n
        # transformers: heads repeated up to HV, state [B, HV, K, V]
        ref_o, ref_S = torch_chunk_gated_delta_rule(
            q[:, s:e].repeat_interleave(HV // H, 2), k[:, s:e].repeat_interleave(HV // H, 2),
            v[:, s:e], g[:, s:e], beta[:, s:e], initial_state=before[slots[i]].transpose(-1, -2)[None],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, s:e], ref_o, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(pool[slots[i]], ref_S[0].transpose(-1, -2), rtol=1e-4, atol=1e-4)
        s = e
    for slot in (1, 2, 4):
        assert torch.equal(pool[slot], before[slot])


def test_decode_update_matches_transformers(sk):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_recurrent_gated_delta_rule,
    )

    g_ = torch.Generator().manual_seed(1)
    B, H, HV, K, V = 3, 2, 4, 16, 8
    q = torch.randn(1, B, H, K, generator=g_)
    k = torch.randn(1, B, H, K, generator=g_)
    v = torch.randn(1, B, HV, V, generator=g_)
    a = torch.randn(B, HV, generator=g_)
    b = torch.randn(B, HV, generator=g_)
    A_log = torch.randn(HV, generator=g_)
    dt_bias = torch.randn(HV, generator=g_)
    pool = torch.randn(5, HV, V, K, generator=g_) * 0.1
    before = pool.clone()
    idx = torch.tensor([4, 1, 2])
    cu = torch.arange(B + 1, dtype=torch.int32)
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log, dt_bias, q, k, v, a, b, pool, idx, cu, True, 1.0, 20.0)
    # transformers' gating (Qwen3NextGatedDeltaNet.forward) and recurrent rule
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    beta = b.sigmoid()
    for i in range(B):
        ref_o, ref_S = torch_recurrent_gated_delta_rule(
            q[:, i:i + 1].repeat_interleave(HV // H, 2), k[:, i:i + 1].repeat_interleave(HV // H, 2),
            v[:, i:i + 1], g[None, i:i + 1], beta[None, i:i + 1],
            initial_state=before[idx[i]].transpose(-1, -2)[None], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, i:i + 1], ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[idx[i]], ref_S[0].transpose(-1, -2), rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[0], before[0]) and torch.equal(pool[3], before[3])
    g2, beta2 = torch.ops.sgl_kernel.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    torch.testing.assert_close(g2[0], g)
    torch.testing.assert_close(beta2[0], beta)


def test_conv_prefill_then_update_match_transformers(sk):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_causal_conv1d_update

    from sgl_kernel.mamba import causal_conv1d_fn_cpu, causal_conv1d_update_cpu

    g_ = torch.Generator().manual_seed(2)
    dim, width, T = 6, 4, 9
    w = torch.randn(dim, width, generator=g_)
    x = torch.randn(dim, T, generator=g_)
    states = torch.randn(3, dim, width - 1, generator=g_)
    fresh = states.clone()
    out = causal_conv1d_fn_cpu(x, w, None, "silu", states, torch.tensor([False]),
                               torch.tensor([2]), torch.tensor([0, T], dtype=torch.int32))
    # transformers' prefill: causal conv1d with left zero padding, then SiLU
    ref = F.silu(F.conv1d(F.pad(x[None], (width - 1, 0)), w.unsqueeze(1), groups=dim))[0]
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(states[2], x[:, -(width - 1):])
    assert torch.equal(states[:2], fresh[:2])
    # one decode token from that state, against transformers' update
    tok = torch.randn(1, dim, generator=g_)
    ref_state = torch.cat([torch.zeros(1, dim, 1), states[2:3].clone()], dim=-1)
    ref_out = torch_causal_conv1d_update(tok[:, :, None], ref_state, w, None, "silu")
    got = causal_conv1d_update_cpu(tok.clone(), states, w, None, "silu", torch.tensor([2]))
    torch.testing.assert_close(got, ref_out[:, :, 0])
    torch.testing.assert_close(states[2], ref_state[0, :, 1:])


def test_rmsnorm_gated_matches_transformers(sk):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    g_ = torch.Generator().manual_seed(3)
    norm = Qwen3NextRMSNormGated(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8, generator=g_))
    x, z = torch.randn(5, 8, generator=g_), torch.randn(5, 8, generator=g_)
    got = torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu(x, norm.weight.detach(), z, 1e-6)
    torch.testing.assert_close(got, norm(x, z).detach())
