"""The wave executor: a layer call's experts in groups that fit the wave buffer, each group
copied and then computed, when the slot pool cannot give the call a whole layer."""

from __future__ import annotations

import math

import torch

from freetoken_sglang.cache.residency import FillPlan, max_unique_experts, used_experts
from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.execute.slot_moe import run_on_slots

# Fields of WaveExecutor.counts.
WAVE_FIELDS = ("layer_calls", "experts_streamed", "experts_reused")


class WaveExecutor:
    """Serves a layer call in ``ceil(K / W)`` waves (K: the call's most distinct experts, W:
    the wave buffer's rows). Resident experts run from their LRU slots in the first wave; the
    call's non-resident distinct experts, in expert order, fill the wave buffer W at a time
    (the cache's filler: UVA on CUDA) and run; each wave's partial output, in the layer
    dtype, is summed in fp32 (so in BF16 the result can differ from stock's single sum in the
    last bit). The LRU is not touched. Every count and index stays on the device and the wave
    count comes from shapes, so decode CUDA graphs capture it.

    Args:
        runtime: the process's ``FreeTokenRuntime``.
    """

    name = "waves"

    def __init__(self, runtime):
        self.rt = runtime
        cache = runtime.cache
        self.cache = cache
        self.E = cache.num_experts
        self.W = cache.layout.buffer_rows
        self.base = cache.layout.lru_slots
        self.counts = torch.zeros(len(WAVE_FIELDS), dtype=torch.int64, device=cache.device)

    def run(self, call: LayerCall) -> torch.Tensor:
        E, W, base, device = self.E, self.W, self.base, call.x.device
        ids = call.topk_ids
        T, k = ids.shape
        used = used_experts(ids, self.rt.num_valid, E)
        layer_res = self.cache.residency.layer_slots(call.ordinal, E)
        resident = used & (layer_res >= 0)
        need = used & (layer_res < 0)
        rank = torch.cumsum(need.int(), 0) - 1
        flat = torch.arange(call.ordinal * E, (call.ordinal + 1) * E, dtype=torch.int32, device=device)
        waves = math.ceil(max_unique_experts(T, k, E) / W)
        out = torch.zeros(call.x.shape, dtype=torch.float32, device=device)
        for g in range(waves):
            in_g = need & (rank >= g * W) & (rank < (g + 1) * W)
            row = (base + rank - g * W).int()
            pos = torch.where(in_g, rank - g * W, W).long()
            src = torch.zeros(W + 1, dtype=torch.int32, device=device)
            dst = torch.zeros(W + 1, dtype=torch.int32, device=device)
            src.index_copy_(0, pos, flat)
            dst.index_copy_(0, pos, row)
            count = in_g.sum().int().reshape(1)
            self.cache.filler.run(FillPlan(src=src[:W], dst=dst[:W], count=count))
            others = torch.where(resident, layer_res, -1) if g == 0 else torch.full_like(layer_res, -1)
            slots = torch.where(in_g, row, others)
            routed = torch.where(slots[ids.long()] >= 0, ids, -1).to(ids.dtype)
            part = run_on_slots(
                call, routed, slots, self.cache, skip_negative_ids=True, inplace=False
            )
            out += part.float()
        self.counts += torch.stack(
            [torch.ones((), dtype=torch.int64, device=device), need.sum(), resident.sum()]
        )
        return out.to(call.x.dtype)

    def snapshot(self):
        return dict(zip(WAVE_FIELDS, self.counts.tolist()))

    def reset(self) -> None:
        self.counts.zero_()
