"""Hooks into SGLang 0.5.17's CUDA-graph setup (``sglang.srt.model_executor.model_runner
.ModelRunner``).

- ``ModelRunner.init_cuda_graphs``, ``init_decode_cuda_graph`` and
  ``init_prefill_cuda_graph`` (after): capture ran dummy batches through the cache; empty it
  and zero the counters so serving starts from a clean state.
- ``model_runner_components.cuda_graph_setup.capture_decode_graph`` and
  ``capture_prefill_graph`` (around): the layer calls captured there belong to decode or
  extend forwards, which picks their executor (``execute/choice.py``); while they run, the
  streamed prefill copies nothing (dummy batches).
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook


def reset_after_capture(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        rt.reset_cache()
    return None


def _in_phase(phase):
    def around(original, *args, **kwargs):
        from freetoken_sglang.runtime import get_runtime

        rt = get_runtime()
        if rt is None:
            return original(*args, **kwargs)
        rt.phase, rt.capturing = phase, True
        try:
            return original(*args, **kwargs)
        finally:
            rt.phase, rt.capturing = None, False

    return around


_MR = "sglang.srt.model_executor.model_runner.ModelRunner"
_SETUP = "sglang.srt.model_executor.model_runner_components.cuda_graph_setup"
HOOKS = [
    Hook(f"{_MR}.init_cuda_graphs", reset_after_capture, "after"),
    Hook(f"{_MR}.init_decode_cuda_graph", reset_after_capture, "after"),
    Hook(f"{_MR}.init_prefill_cuda_graph", reset_after_capture, "after"),
    Hook(f"{_SETUP}.capture_decode_graph", _in_phase("decode"), "around"),
    Hook(f"{_SETUP}.capture_prefill_graph", _in_phase("extend"), "around"),
]
