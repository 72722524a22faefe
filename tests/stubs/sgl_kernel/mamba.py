"""``sgl_kernel.mamba`` of the CPU stand-in: the gated DeltaNet wrappers SGLang 0.5.17 imports
on the CPU (``layers/attention/linear/gdn_backend.py``, ``kernels/gdn_triton.py``), in plain
torch (``gdn.py``)."""

from __future__ import annotations

import os

import torch

from sgl_kernel.gdn import causal_conv, delta_rule

CHUNK = 64  # the Triton kernel's chunk (sglang.kernels.ops.attention.fla.chunk.CHUNK_SIZE)


def causal_conv1d_fn_cpu(x, weight, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None):
    """Prefill conv over packed sequences: ``x [dim, T]`` -> ``[dim, T]``; each sequence
    starts from its conv state (or zeros) and leaves its last ``width - 1`` inputs there."""
    w = weight.shape[-1] - 1
    out = torch.empty_like(x)
    starts = query_start_loc.tolist()
    for i in range(len(starts) - 1):
        s, e = starts[i], starts[i + 1]
        if e == s:
            continue
        slot = int(cache_indices[i])
        if bool(has_initial_state[i]):
            window = conv_states[slot].clone()
        else:
            window = x.new_zeros(x.shape[0], w)
        seg = x[:, s:e]
        out[:, s:e] = causal_conv(seg, window, weight, bias, activation == "silu").to(x.dtype)
        tail = torch.cat([window.to(x.dtype), seg], dim=-1)[:, -w:]
        conv_states[slot] = tail.to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_states, weight, bias, activation, conv_state_indices,
                             **_unused):
    """One decode token per row: ``x [B, dim]`` -> ``[B, dim]``; the state shifts by one."""
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        slot = int(conv_state_indices[i])
        window = conv_states[slot].clone()
        out[i] = causal_conv(x[i][:, None], window, weight, bias, activation == "silu")[:, 0]
        conv_states[slot] = torch.cat([window[:, 1:], x[i][:, None].to(window.dtype)], dim=-1)
    return out


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first,
                               use_qk_l2norm_in_kernel, initial_state_indices=None):
    """Prefill: ``q, k [1, T, H, K]``, ``v [1, T, HV, V]``, ``g, beta [1, T, HV]``; the states
    ``initial_state[initial_state_indices]`` ``[HV, V, K]`` are read and updated in place.
    Returns ``(o [1, T, HV, V], final states, None)`` as SGLang's CPU wrapper does (it returns
    no chunk states). With ``SGL_STUB_GDN_CHUNK_STATES=1`` the third item is instead what
    SGLang's Triton kernel returns (``sglang.kernels.ops.attention.fla.chunk``): ``h [1,
    chunks, HV, V, K]`` in ``k``'s dtype, the state at the start of every 64-token chunk of
    every sequence (its initial state first), so that the CPU tests reach the GPU's paths."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first is not supported")
    with_h = os.environ.get("SGL_STUB_GDN_CHUNK_STATES", "0") == "1"
    o = torch.empty(v.shape, dtype=v.dtype)
    starts = cu_seqlens.tolist()
    n = len(starts) - 1
    idx = (initial_state_indices if initial_state_indices is not None
           else torch.arange(n)).tolist()
    h = []
    for i in range(n):
        s, e = starts[i], starts[i + 1]
        state = initial_state[idx[i]]
        for c in range(s, e, CHUNK if with_h else max(e - s, 1)):
            ce = min(e, c + CHUNK) if with_h else e
            h.append(state.to(k.dtype, copy=True))  # not a view of the slot it updates
            out, state = delta_rule(q[0, c:ce], k[0, c:ce], v[0, c:ce], g[0, c:ce],
                                    beta[0, c:ce], state, use_qk_l2norm_in_kernel)
            o[0, c:ce] = out.to(v.dtype)
        initial_state[idx[i]] = state.to(initial_state.dtype)
    final = initial_state[torch.tensor(idx, dtype=torch.long)]
    return o, final, torch.stack(h)[None] if with_h and h else None
