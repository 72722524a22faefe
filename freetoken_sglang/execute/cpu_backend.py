"""The CPU-backend executor: every routed expert of every layer call runs on the C executor
over the pageable host pool; the GPU gets only the fp32 partial back (paper §4.2)."""

from __future__ import annotations

import torch

from freetoken_sglang.cache.residency import MissSplit, decide
from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import routed_scale



class CpuBackendExecutor:
    """Args:
        runtime: the process's ``FreeTokenRuntime`` (a zero-slot cache whose residency
            decision lists the work items, counters, CPU branch)."""

    name = "cpu"

    def __init__(self, runtime):
        self.rt = runtime
        self.split = MissSplit(0.0, 0)  # every routed expert to the CPU, none filled

    def run(self, call: LayerCall) -> torch.Tensor:
        rt = self.rt
        x = call.x
        phase = "decode" if rt.is_decode_sized(call.rows) else "prefill"
        decision = decide(
            rt.cache.residency,
            rt.counters.of_phase(phase),
            call.ordinal,
            rt.cache.num_experts,
            call.topk_ids,
            call.topk_weights,
            rt.num_valid,
            self.split,
            routed_scale(call.layer, x),
        )
        rt.cpu_branch.launch(x, decision.cpu)
        return rt.cpu_branch.merge(torch.zeros_like(x))
