"""Hooks into SGLang 0.5.17's ``sglang.srt.model_executor.model_runner.ModelRunner``.

- ``ModelRunner.load_model`` (around): starts the FreeToken runtime before the model is
  built (so MoE layers load into the host pool), then pins the pool and allocates the GPU
  expert cache, before SGLang sizes its KV pool from the memory left. Peak GPU memory during
  the load is measured and logged. MoE blocks with an alternate stream for their shared
  expert are set to one stream (``_single_stream_moe_blocks``).
- ``ModelRunner._forward_raw`` (around): records how many rows of the batch are real, on the
  device, so that captured graphs mask their padding out of the cache's recency; tells the
  runtime the forward's phase (decode, or extend: prefill and mixed batches), which starts
  streaming the first layers of a streamed prefill before layer 0's attention runs; after
  the step, appends its routing to the trace when ``--freetoken-record-routing`` is on.
"""

from __future__ import annotations

import logging
import time

import torch

from freetoken_sglang.patches import Hook

logger = logging.getLogger(__name__)


def load_model(original, self, *args, **kwargs):
    from freetoken_sglang import runtime

    cfg = runtime.config_of(self.server_args)
    if cfg is None:
        return original(self, *args, **kwargs)
    from freetoken_sglang.plugin import check_hooks_applied

    check_hooks_applied()
    rt = runtime.start(cfg, self)
    on_cuda = rt.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
        base = torch.cuda.memory_allocated(rt.device)
    t0 = time.perf_counter()
    result = original(self, *args, **kwargs)
    load_s = time.perf_counter() - t0
    peak = 0
    if on_cuda:
        torch.cuda.synchronize(rt.device)
        peak = torch.cuda.max_memory_allocated(rt.device) - base
    rt.finish_load(self, load_s, peak)
    _single_stream_moe_blocks(self.model)
    return result


def _single_stream_moe_blocks(model) -> None:
    """Run FreeToken MoE blocks on one stream: under graph capture SGLang's Qwen2-MoE block
    (``Qwen2MoeSparseMoeBlock.forward_normal_dual_stream``, used by Qwen3-Next and Qwen3.5)
    runs the routed experts on an alternate stream, where a streamed prefill's eager break
    would end the capture segment on the wrong stream."""
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    n = 0
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if (getattr(m, "alt_stream", None) is not None
                and isinstance(getattr(experts, "quant_method", None), FreeTokenMoEMethod)):
            m.alt_stream = None
            n += 1
    if n:
        logger.info("FreeToken: %d MoE blocks run their shared and routed experts on one "
                    "stream (no alternate stream under graph capture)", n)


def forward_raw(original, self, forward_batch, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.cache is None:
        return original(self, forward_batch, *args, **kwargs)
    ids = forward_batch.input_ids
    n = ids.shape[0] if ids is not None else forward_batch.positions.shape[0]
    rt.set_num_valid(n)
    mode = forward_batch.forward_mode
    decode = mode.is_decode()
    rt.begin_forward("decode" if decode else "extend", n, mixed=mode.is_mixed())
    try:
        result = original(self, forward_batch, *args, **kwargs)
    finally:
        rt.end_forward()
    if (rt.recorder is not None or rt.cpu_branch is not None or rt.replay is not None
            or rt.prefill_cpu_part is not None):
        rt.end_step("decode" if decode else "prefill", n)
    return result


HOOKS = [
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        load_model,
        "around",
    ),
    Hook(
        "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
        forward_raw,
        "around",
    ),
]
