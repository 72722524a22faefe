"""SGLang 0.5.17's sum over top-k in its Triton fused-MoE sequence, replaced for one MoE call.

The module: ``sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe``.

``_fused_moe_kernel_sequence`` ends by summing the down GEMM's weighted expert outputs over
top-k through a module global of that file (``SUM_REDUCES``): on CUDA the torch.compile'd
``moe_sum_reduce_torch_compile`` at <= 32 rows and sgl_kernel's ``moe_sum_reduce`` above,
elsewhere its ``moe_sum_reduce_triton``; each takes ``(expert_out [T, k, H], out [T, H],
routed_scaling_factor)``. ``sum_reduce_replaced`` swaps those globals for the duration of a
``with`` block and restores them after, so it acts on the one MoE call inside it (the CPU
branch's merge, ``cpu/branch.py``); it is Python only, so a CUDA graph captured inside records
the replacement's kernels. It registers no ``Hook``: nothing changes outside the block.
"""

from __future__ import annotations

import contextlib
from typing import Callable, List

from freetoken_sglang.patches import Hook

#: The sum-reduce functions ``_fused_moe_kernel_sequence`` calls by module global (0.5.17).
SUM_REDUCES = ("moe_sum_reduce_torch_compile", "moe_sum_reduce", "moe_sum_reduce_triton")


@contextlib.contextmanager
def sum_reduce_replaced(make: Callable[[Callable], Callable]):
    """Inside the block, each of SGLang's ``SUM_REDUCES`` present in its ``fused_moe`` module
    is ``make(original)``, a function of the same arguments; restored on exit, also on error."""
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe

    saved = {n: getattr(fused_moe, n) for n in SUM_REDUCES if hasattr(fused_moe, n)}
    for name, original in saved.items():
        setattr(fused_moe, name, make(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(fused_moe, name, original)


HOOKS: List[Hook] = []
