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
- ``loader.DefaultModelLoader._get_weights_iterator`` (around): with ``--enable-freetoken``,
  SGLang's own multi-threaded safetensors loader (``enable_multithread_load``, on by default
  in 0.5.17, 8 threads, one shard per thread) gets one thread per core where there are more
  than 8 and ``--model-loader-extra-config`` sets no thread count, and the copies into the
  host pool run with one torch thread per core (SGLang sets one on GPUs). With
  ``--freetoken-ftw DIR``, the manifest is checked against the built model before any weight
  is read, and the checkpoint's routed-expert tensors of the MoE layers are dropped from the
  iterator (SGLang's default loader maps safetensors lazily, so their bytes are not read;
  ``--weight-loader-disable-mmap`` and checkpoint prefetch still read them); the runtime reads
  the pool from DIR (``experts/ftw.py``). The count is logged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re

import torch

from freetoken_sglang.patches import Hook

logger = logging.getLogger(__name__)


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
            if not torch.is_floating_point(template):  # stock keeps create_weights' values
                for m in layers:
                    getattr(m, name).data.fill_(rt.pool_initial_values.get(name, 0))
                continue
            # stock draws FP8 values in FP16 and converts them (uniform_ has no FP8 kernel)
            low_bits = torch.finfo(template.dtype).bits < 16
            values = torch.empty(template.shape, device=device,
                                 dtype=torch.float16 if low_bits else template.dtype)
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            values.uniform_(low, high, generator=gen)
            values = values.to(template.dtype).to("cpu")
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


# A routed expert's checkpoint tensor: ``...layers.<L>.<mlp|block_sparse_moe>.experts.<e>.``
# (per-expert names) or ``...layers.<L>.mlp.experts.<gate_up_proj|down_proj>...`` (fused);
# ``shared_expert(s)`` never matches.
_ROUTED_EXPERT = re.compile(
    r"(?:^|\.)layers\.(\d+)\.[A-Za-z_]+\.experts\.(?:\d+\.|gate_up_proj|down_proj)"
)


def routed_expert_layer(name: str):
    """The layer id of a routed expert's checkpoint tensor ``name``, else None (also for
    multi-token-prediction layers, ``mtp.layers.<i>``, which the served model does not load)."""
    if "mtp." in name:
        return None
    m = _ROUTED_EXPERT.search(name)
    return int(m.group(1)) if m else None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def get_weights_iterator(original, self, source, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.pool is None:
        return original(self, source, *args, **kwargs)
    ftw_dir = getattr(rt.config, "ftw", None)
    if ftw_dir and source.model_config is not None:
        from freetoken_sglang.experts import ftw

        ftw.check_for_runtime(rt, source.model_config)  # refuse before reading anything
    extra = self.load_config.model_loader_extra_config
    cores = _cores()
    added = False
    if (cores > self.DEFAULT_NUM_THREADS and not ({"enable_multithread_load", "num_threads"}
                                                   & extra.keys())):
        from sglang.srt.runtime_context import get_model

        if not get_model().weight_loader_prefetch_checkpoints:  # keep SGLang's I/O choice
            extra["num_threads"] = cores
            added = True
    try:
        weights = original(self, source, *args, **kwargs)
    finally:
        if added:
            del extra["num_threads"]
    threads = extra.get("num_threads", cores if added else self.DEFAULT_NUM_THREADS)
    logger.info(
        "FreeToken: checkpoint %s through SGLang's loader (%s), copies into the host pool "
        "with %d torch threads",
        source.model_or_path,
        f"multi-threaded: {threads} threads" if extra.get("enable_multithread_load", True)
        else "single-threaded (--model-loader-extra-config)",
        cores,
    )
    return _pool_load(rt, weights, cores, set(rt.moe_layer_ids) if ftw_dir else None,
                      ftw_dir)


def _pool_load(rt, weights, cores, skip_layers, ftw_dir):
    """Yield ``weights`` with ``cores`` torch threads for the consumer's copies, without the
    routed experts of ``skip_layers`` (None: keep all); log what was skipped."""
    skipped = skipped_bytes = 0
    before = torch.get_num_threads()
    torch.set_num_threads(max(before, cores))
    try:
        for name, tensor in weights:
            if skip_layers is not None:
                layer = routed_expert_layer(name)
                if layer is not None and layer in skip_layers:
                    skipped += 1
                    skipped_bytes += tensor.numel() * tensor.element_size()
                    continue
            yield name, tensor
    finally:
        torch.set_num_threads(before)
        if skip_layers is not None:
            rt.ftw_skipped_tensors = getattr(rt, "ftw_skipped_tensors", 0) + skipped
            logger.info(
                "FreeToken: --freetoken-ftw: skipped %d routed-expert tensors (%.1f MiB) of "
                "the checkpoint, not read; the host pool loads from %s",
                skipped, skipped_bytes / (1 << 20), ftw_dir,
            )


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
    Hook(
        "sglang.srt.model_loader.loader.DefaultModelLoader._get_weights_iterator",
        get_weights_iterator,
        "around",
    ),
]
