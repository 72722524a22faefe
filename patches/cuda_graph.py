"""Hooks into SGLang 0.5.17's CUDA-graph setup (``sglang.srt.model_executor.model_runner
.ModelRunner``).

- ``ModelRunner.init_cuda_graphs``, ``init_decode_cuda_graph`` and
  ``init_prefill_cuda_graph`` (after): capture ran dummy batches through the cache; empty it
  and zero the counters so serving starts from a clean state.
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook


def reset_after_capture(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        rt.reset_cache()
    return None


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOKS = [
    Hook(f"{_MR}.init_cuda_graphs", reset_after_capture, "after"),
    Hook(f"{_MR}.init_decode_cuda_graph", reset_after_capture, "after"),
    Hook(f"{_MR}.init_prefill_cuda_graph", reset_after_capture, "after"),
]
