"""The resident executor: every expert has a slot of its own, so a layer call is stock SGLang's MoE over the layer's slice of the slot banks."""

from __future__ import annotations

from typing import Dict, List

import torch

from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import run_on_slots_native, run_on_slots_triton


class ResidentExecutor:
    """Serves the ``resident`` layout (``cache/layout.py``: at least L*E slots), where slot
    ``l*E + e`` holds expert e of MoE layer l for good (``ResidencyState.make_all_resident``).

    Nothing is decided, filled or remapped: on CUDA a layer call is SGLang's own Triton MoE
    run (``fused_experts_impl``'s sequence) over the ``[E, ...]`` views
    ``slot_banks[name][l*E:(l+1)*E]``, with the router's ids as they are, so its cost and
    its output are stock SGLang's (FP4 formats: each call's experts dequantized first,
    ``slot_moe._run_dequantized``). Layer calls here go through no LRU, so the LRU counters
    (reads, hits, ...) do not count them and no recency is recorded. On the CPU the same
    slots run through SGLang's native MoE (``slot_moe.run_on_slots_native``).

    Args:
        runtime: the process's ``FreeTokenRuntime`` (its ``cache`` must be all resident).

    Raises:
        ValueError: the cache is not all resident.
    """

    name = "resident"

    def __init__(self, runtime):
        cache = runtime.cache
        if not cache.all_resident:
            raise ValueError(f"the resident executor needs every expert resident, not the "
                             f"{cache.layout.kind} layout")
        self.rt = runtime
        E = cache.num_experts
        layers = cache.pool.num_rows // E
        self.layer_banks: List[Dict[str, torch.Tensor]] = [
            {n: b[l * E:(l + 1) * E] for n, b in cache.slot_banks.items()} for l in range(layers)
        ]

    def run(self, call: LayerCall) -> torch.Tensor:
        """The layer's routed-expert output ``[T, H]`` (the executor contract), from the
        layer's own slots with the router's ids as they are."""
        if call.x.is_cuda:
            return run_on_slots_triton(call.layer, call.x, call.topk_weights, call.topk_ids,
                                       None, self.layer_banks[call.ordinal])
        cache = self.rt.cache
        return run_on_slots_native(call.layer, call.x, call.topk_output, call.topk_ids,
                                   cache.residency.layer_slots(call.ordinal, cache.num_experts),
                                   cache.banks_with_null_slots, cache.num_slots)
