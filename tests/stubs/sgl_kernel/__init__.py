"""A CPU stand-in for ``sgl_kernel``, for running SGLang 0.5.17 on a machine without CUDA.

The CUDA wheel of sgl_kernel cannot be imported without a driver and its CPU build is not on
PyPI. With ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few CPU helpers from it; the only one
it calls while serving the MoE families we test is ``assign_req_to_token_pool_cpu``, written
here in plain torch. Every other attribute resolves to a function that raises
``NotImplementedError`` naming itself when called. No ``torch.ops.sgl_kernel`` op is
registered, so SGLang takes its native-torch paths.
"""

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


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available in the CPU stand-in used by the tests"
        )

    _missing.__name__ = name
    return _missing
