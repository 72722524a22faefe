"""Hooks into SGLang 0.5.17's model loader (``sglang.srt.model_loader``).

- ``loader.device_loading_context`` (around): leaves a FreeToken layer's host-pool
  parameters where they are; stock SGLang would copy each CPU parameter to the GPU for
  ``process_weights_after_loading`` and back.
- ``weight_utils.initialize_dummy_weights`` (around): for ``--load-format dummy``, fills
  the host pool with exactly the values stock SGLang gives the same parameters on the GPU
  (per-parameter seed, same generator device), generating one layer on the device and
  copying it into every layer's rows, instead of a slow single-threaded host fill. The
  copies run on every core the process may use: SGLang's ``ModelRunner.load_model`` sets one
  torch thread on GPUs, with which this fill of the Qwen3-30B-A3B pool (54 GiB) took 32.5 s
  on the H200 host, against 4-7 s on 16 cores (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import contextlib
import inspect
import os

import torch

from freetoken_sglang.patches import Hook


def _is_freetoken_layer(module) -> bool:
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    return isinstance(getattr(module, "quant_method", None), FreeTokenMoEMethod)


def device_loading_context(original, module, target_device, *args, **kwargs):
    if _is_freetoken_layer(module):
        return contextlib.nullcontext(module)
    return original(module, target_device, *args, **kwargs)


def initialize_dummy_weights(original, model, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    layers = [m for m in model.modules() if _is_freetoken_layer(m)]
    if rt is None or not layers:
        return original(model, *args, **kwargs)
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    low, high, seed = bound.arguments["low"], bound.arguments["high"], bound.arguments["seed"]
    names = list(rt.pool.specs)
    # Hide the pool views from the stock pass (an empty tensor draws nothing).
    saved = {}
    for m in layers:
        for name in names:
            p = getattr(m, name)
            saved[(id(m), name)] = p.data
            p.data = p.data.new_empty(0)
    try:
        original(model, *args, **kwargs)
    finally:
        for m in layers:
            for name in names:
                getattr(m, name).data = saved[(id(m), name)]
    device = rt.device
    with _torch_threads(len(os.sched_getaffinity(0))):
        for name in names:
            template = getattr(layers[0], name).data
            values = torch.empty(template.shape, dtype=template.dtype, device=device)
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            values.uniform_(low, high, generator=gen)
            values = values.to("cpu")
            # Same shape, numel and dtype in every layer, hence the same values as stock.
            for m in layers:
                getattr(m, name).data.copy_(values)
            del values


@contextlib.contextmanager
def _torch_threads(n: int):
    """Run the block with ``n`` torch intra-op threads (the cores this process may use), then
    restore the previous count. SGLang runs one scheduler process per GPU and FreeToken
    refuses tensor/pipeline/data parallelism, so one process uses the cores here."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


HOOKS = [
    Hook(
        "sglang.srt.model_loader.loader.device_loading_context",
        device_loading_context,
        "around",
    ),
    Hook(
        "sglang.srt.model_loader.weight_utils.initialize_dummy_weights",
        initialize_dummy_weights,
        "around",
    ),
]
