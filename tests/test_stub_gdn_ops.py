"""The CPU stand-in's gated DeltaNet ops (tests/stubs/sgl_kernel) and Qwen3.5's attention and
projection ops against transformers' own torch implementations (``modeling_qwen3_next``,
``modeling_qwen3_5_moe``), on random inputs; the layouts are SGLang 0.5.17's CPU call sites'
(tests/test_hybrid_cpu.py runs them inside SGLang)."""

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


def _qwen3_5_text_config(**kw):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=6, num_hidden_layers=2, **kw)


def _randomize(module, g_):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g_) * 0.3)
    return module


def test_qk_gemma_rmsnorm_matches_transformers(sk):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNorm

    g_ = torch.Generator().manual_seed(4)
    D, T, H, HKV = 8, 5, 4, 2
    q_norm = _randomize(Qwen3_5MoeRMSNorm(D, eps=1e-6), g_)
    k_norm = _randomize(Qwen3_5MoeRMSNorm(D, eps=1e-6), g_)
    # q, k are column slices of one qkv projection in SGLang (non-contiguous)
    qkv = torch.randn(T, (H + 2 * HKV) * D, generator=g_)
    q, k = qkv[:, :H * D], qkv[:, H * D:(H + HKV) * D]
    got_q, got_k = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_cpu(
        q, k, q_norm.weight.detach(), k_norm.weight.detach(), 1e-6, D)
    with torch.no_grad():
        torch.testing.assert_close(got_q.view(T, H, D), q_norm(q.reshape(T, H, D)))
        torch.testing.assert_close(got_k.view(T, HKV, D), k_norm(k.reshape(T, HKV, D)))


def test_gated_attention_ops_match_transformers(sk):
    """q/gate split + q/k norm (fused_qk_gemma_rmsnorm_with_gate_cpu) and the output gate
    (fused_sigmoid_mul_cpu) as SGLang's CPU path chains them, against transformers'
    Qwen3_5MoeAttention (eager, no mask, identity RoPE)."""
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeAttention

    g_ = torch.Generator().manual_seed(5)
    cfg = _qwen3_5_text_config()
    cfg._attn_implementation = "eager"
    attn = _randomize(Qwen3_5MoeAttention(cfg, 0), g_).eval()
    T, H, HKV, D = 6, 4, 2, 8
    x = torch.randn(1, T, 32, generator=g_)
    ones, zeros = torch.ones(1, T, D), torch.zeros(1, T, D)
    with torch.no_grad():
        want, _ = attn(x, (ones, zeros), None)
        # SGLang: one qkv projection, [q_h0, gate_h0, q_h1, ...] | k | v
        qkv = torch.cat([attn.q_proj(x[0]), attn.k_proj(x[0]), attn.v_proj(x[0])], dim=-1)
        q_gate, k, v = qkv.split([2 * H * D, HKV * D, HKV * D], dim=-1)
        q, k, gate = torch.ops.sgl_kernel.fused_qk_gemma_rmsnorm_with_gate_cpu(
            q_gate, k, attn.q_norm.weight, attn.k_norm.weight, 1e-6, D, H)
        assert q.shape == gate.shape == (T * H, D) and k.shape == (T * HKV, D)
        q, k, v = q.view(T, H, D), k.view(T, HKV, D), v.reshape(T, HKV, D)
        k, v = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
        w = torch.softmax(torch.einsum("thd,shd->hts", q, k) * D ** -0.5, dim=-1)
        out = torch.einsum("hts,shd->thd", w, v).reshape(T, H * D)
        before = out.clone()
        gated = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(out, gate.view(T, -1), inplace=True)
        torch.testing.assert_close(attn.o_proj(gated), want[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out, gated)  # in place as well
        # a strided 3D gate [T, H, D], out of place
        gate3 = torch.randn(T, H, 2 * D, generator=g_)[..., :D]
        got = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(before, gate3, False)
        torch.testing.assert_close(got, before * torch.sigmoid(gate3.reshape(T, -1)))


def test_qkvzba_split_matches_transformers_projections(sk):
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

    g_ = torch.Generator().manual_seed(6)
    cfg = _qwen3_5_text_config()
    gdn = _randomize(Qwen3_5MoeGatedDeltaNet(cfg, 0), g_)
    T, HK, HV, DK, DV = 5, 2, 4, 8, 6
    x = torch.randn(T, 32, generator=g_)
    with torch.no_grad():
        # SGLang's merged in_proj_qkvz = [in_proj_qkv; in_proj_z], in_proj_ba = [b; a]
        qkvz = x @ torch.cat([gdn.in_proj_qkv.weight, gdn.in_proj_z.weight]).T
        ba = x @ torch.cat([gdn.in_proj_b.weight, gdn.in_proj_a.weight]).T
        mixed_qkv, z, b, a = (
            torch.ops.sgl_kernel.fused_qkvzba_split_reshape_cat_contiguous_cpu(
                qkvz, ba, HK, HV, DK, DV))
        torch.testing.assert_close(mixed_qkv, gdn.in_proj_qkv(x))
        torch.testing.assert_close(z, gdn.in_proj_z(x).reshape(T, HV, DV))
        torch.testing.assert_close(b, gdn.in_proj_b(x))
        torch.testing.assert_close(a, gdn.in_proj_a(x))
    assert all(t.is_contiguous() for t in (mixed_qkv, z, b, a))
