"""Hooks into SGLang 0.5.17's CUDA-graph setup
(``sglang.srt.model_executor.model_runner.ModelRunner`` and
``sglang.srt.model_executor.model_runner_components.cuda_graph_setup``).

- ``ModelRunner.init_cuda_graphs``, ``init_decode_cuda_graph`` and
  ``init_prefill_cuda_graph`` (after): capture ran dummy batches through the cache; empty it
  and zero the counters so serving starts from a clean state.
- ``cuda_graph_setup.capture_decode_graph`` (around): when the host pool could not be pinned,
  fills must sync the host, so decode graphs are not captured (the warning at pin time says
  so).
"""

from __future__ import annotations

import logging

from freetoken_sglang.patches import Hook

logger = logging.getLogger(__name__)


def reset_after_capture(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        rt.reset_cache()
    return None


def capture_decode_graph(original, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.cache is None or rt.cache.filler.graph_safe:
        return original(*args, **kwargs)
    from sglang.srt.model_executor.model_runner_components.cuda_graph_setup import (
        GraphCapture,
    )

    model_runner = kwargs.get("model_runner", args[0] if args else None)
    logger.warning(
        "FreeToken: decode CUDA graphs are off because the host expert pool is not pinned"
    )
    phase = "draft_decode" if model_runner.is_draft_worker else "decode"
    return GraphCapture(runner=None, memory_phase=phase, memory_usage_gb=0, capture_time=0)


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
HOOKS = [
    Hook(f"{_MR}.init_cuda_graphs", reset_after_capture, "after"),
    Hook(f"{_MR}.init_decode_cuda_graph", reset_after_capture, "after"),
    Hook(f"{_MR}.init_prefill_cuda_graph", reset_after_capture, "after"),
    Hook(
        "sglang.srt.model_executor.model_runner_components.cuda_graph_setup."
        "capture_decode_graph",
        capture_decode_graph,
        "around",
    ),
]
