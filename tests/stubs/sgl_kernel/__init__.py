"""A CPU stand-in for ``sgl_kernel``, for running SGLang 0.5.17 on a machine without CUDA.

The CUDA wheel of sgl_kernel cannot be imported without a driver and its CPU build is not on
PyPI. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few CPU helpers from it. Written here
in plain torch: ``assign_req_to_token_pool_cpu`` (every model), for gated DeltaNet layers
(Qwen3-Next, Qwen3.5) the ``mamba`` wrappers and three ``torch.ops.sgl_kernel`` ops
(``gdn.py``), and Qwen3.5's four attention/projection ops (``qwen3_5.py``); each checked
against transformers in tests/test_stub_gdn_ops.py, and in SGLang by tests/test_hybrid_cpu.py.
No other ``torch.ops.sgl_kernel`` op is registered, so SGLang takes its native-torch paths
elsewhere. Every other attribute resolves to a function that raises
``NotImplementedError`` naming itself when called.

Two fixes of SGLang's CPU path live here too, since stock SGLang needs them as much as FreeToken:
SGLang 0.5.17 builds Qwen3-Next's gated RMSNorm on ``torch.get_device_module()
.current_device()``, which is ``torch.cuda`` on a CUDA build of torch without a driver; with no
CUDA device, ``torch.get_device_module()`` without an argument answers ``torch.cuda`` whose
``current_device()`` is ``"cpu"`` here. Likewise ``torch.cuda.get_device_properties`` of a CPU
device, which Qwen3.5's gated RMSNorm asks for its SM count, answers one.
"""

import functools
import types

import torch

__version__ = "0.0.0+freetoken-cpu-stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> None:
    """For each request row r, in order, write the next ``end - start`` entries of
    ``out_cache_loc`` into ``req_to_token[r, start:end]``."""
    pos = 0
    for r, s, e in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()
    ):
        n = e - s
        req_to_token[r, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _register_gdn_ops() -> None:
    """``torch.ops.sgl_kernel`` ops that SGLang 0.5.17 calls for gated DeltaNet layers on the
    CPU (``gdn_backend.py``, ``gdn_triton.py``, ``fla/fused_norm_gate.py``), in plain torch
    (``gdn.py``)."""
    from typing import Tuple

    from sgl_kernel.gdn import delta_rule, gating

    @torch.library.custom_op("sgl_kernel::fused_gdn_gating_cpu", mutates_args=())
    def fused_gdn_gating_cpu(
        A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        g, beta = gating(A_log, a, b, dt_bias)
        return g.unsqueeze(0).contiguous(), beta.unsqueeze(0).contiguous()

    @torch.library.custom_op(
        "sgl_kernel::fused_sigmoid_gating_delta_rule_update_cpu",
        mutates_args=("initial_state_source",),
    )
    def fused_sigmoid_gating_delta_rule_update_cpu(
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        initial_state_source: torch.Tensor,
        initial_state_indices: torch.Tensor,
        cu_seqlens: torch.Tensor,
        use_qk_l2norm_in_kernel: bool,
        softplus_beta: float,
        softplus_threshold: float,
    ) -> torch.Tensor:
        # One token per sequence (decode): q, k [1, B, H, K], v [1, B, HV, V], a, b [B, HV].
        g, beta = gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
        out = torch.empty(v.shape, dtype=v.dtype)
        starts = cu_seqlens.tolist()
        for i, slot in enumerate(initial_state_indices.tolist()):
            s, e = starts[i], starts[i + 1]
            o, S = delta_rule(q[0, s:e], k[0, s:e], v[0, s:e], g[s:e], beta[s:e],
                              initial_state_source[slot], use_qk_l2norm_in_kernel)
            out[0, s:e] = o.to(v.dtype)
            initial_state_source[slot] = S.to(initial_state_source.dtype)
        return out

    @torch.library.custom_op("sgl_kernel::fused_rmsnorm_gated_cpu", mutates_args=())
    def fused_rmsnorm_gated_cpu(
        x: torch.Tensor, weight: torch.Tensor, g: torch.Tensor, eps: float
    ) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        h = weight * h.to(x.dtype)
        return (h * torch.nn.functional.silu(g.float())).to(x.dtype)


def _register_qwen3_5_ops() -> None:
    """The four ``torch.ops.sgl_kernel`` ops SGLang 0.5.17's ``models/qwen3_5.py`` binds at
    import on the CPU, with sgl-kernel's CPU signatures, in plain torch (``qwen3_5.py``).
    (``fused_input_proj_cpu`` there runs only for bf16 AMX-packed weights: not registered.)"""
    from typing import Tuple

    from sgl_kernel import qwen3_5 as q35

    @torch.library.custom_op("sgl_kernel::fused_sigmoid_mul_cpu", mutates_args=("input",))
    def fused_sigmoid_mul_cpu(input: torch.Tensor, gate: torch.Tensor,
                              inplace: bool) -> torch.Tensor:
        out = q35.sigmoid_mul(input, gate)
        if inplace:
            input.copy_(out)
        return out  # a copy even when inplace: custom ops may not return an input

    @torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_cpu", mutates_args=())
    def fused_qk_gemma_rmsnorm_cpu(
        q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        eps: float, head_dim: int,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return q35.qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim)

    @torch.library.custom_op("sgl_kernel::fused_qk_gemma_rmsnorm_with_gate_cpu",
                             mutates_args=())
    def fused_qk_gemma_rmsnorm_with_gate_cpu(
        q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
        eps: float, head_dim: int, num_head: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return q35.qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim,
                                              num_head)

    @torch.library.custom_op("sgl_kernel::fused_qkvzba_split_reshape_cat_contiguous_cpu",
                             mutates_args=())
    def fused_qkvzba_split_reshape_cat_contiguous_cpu(
        mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int,
        head_qk: int, head_v: int,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return q35.qkvzba_split_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v,
                                           head_qk, head_v)


_register_gdn_ops()
_register_qwen3_5_ops()

if not torch.cuda.is_available():
    # SGLang 0.5.17 builds FusedRMSNormGated on torch.get_device_module().current_device()
    # (models/qwen3_next.py, qwen3_5.py): torch.cuda on a CUDA build without a driver.
    _get_device_module = torch.get_device_module

    class _CudaOnCpu:
        """``torch.cuda`` in every respect (as before), except that ``current_device()``
        answers ``"cpu"`` instead of raising for want of a driver."""

        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def current_device():
            return "cpu"

    _cuda_on_cpu = _CudaOnCpu()

    @functools.wraps(_get_device_module)  # torch.compile looks for __wrapped__
    def _device_module(device=None):
        module = _get_device_module(device)
        return _cuda_on_cpu if device is None and module is torch.cuda else module

    torch.get_device_module = _device_module

    # Without sgl-kernel's AMX backend (``convert_weight_packed``, not in this stand-in),
    # SGLang 0.5.17 runs Qwen3.5's gated RMSNorm (fla/layernorm_gated.py) as a Triton kernel
    # whose grid is sized by torch.cuda.get_device_properties(x.device).multi_processor_count,
    # asked even of a CPU tensor. For a CPU device, answer one "multiprocessor" (Triton's
    # interpreter runs one program at a time; rows per block do not change the result).
    _get_device_properties = torch.cuda.get_device_properties

    @functools.wraps(_get_device_properties)
    def _device_properties(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return types.SimpleNamespace(multi_processor_count=1)
        return _get_device_properties(device)

    torch.cuda.get_device_properties = _device_properties


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in used by the tests"
        )

    _missing.__name__ = name
    return _missing
