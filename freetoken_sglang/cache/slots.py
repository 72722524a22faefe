"""The GPU expert cache: one slot pool shared by all MoE layers (paper §3, §4.1).

Each slot holds one complete (layer, expert) across every bank of the host pool. This file
owns the slot memory and its sizing; ``layout.py`` splits it between the LRU and the prefill
buffers, ``residency.py`` keeps the LRU bookkeeping and ``fills.py`` moves experts into
slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from freetoken_sglang.config import FreeTokenConfig
from freetoken_sglang.cache.fills import Filler, LateFills
from freetoken_sglang.cache.layout import RESIDENT, SlotLayout
from freetoken_sglang.errors import RefusedError
from freetoken_sglang.experts.pool import GIB, HostExpertPool
from freetoken_sglang.cache.residency import ResidencyState

logger = logging.getLogger(__name__)


#: All-zero rows after a CUDA cache's slots (``ExpertCache.null_slot``): a decode call's
#: CPU-served entries are computed against one, exactly 0, so SGLang's kernels run without
#: ``filter_expert`` (``execute/slot_moe.py``). One expert's bytes of device memory.
CUDA_NULL_SLOTS = 1


class CacheSizeError(RefusedError):
    """The requested cache cannot serve one token's top-k experts, or does not fit."""


@dataclass(frozen=True)
class CacheSize:
    num_slots: int
    reason: str


def resolve_num_slots(
    config: FreeTokenConfig,
    pool: HostExpertPool,
    min_slots: int,
    min_slots_reason: str,
    free_bytes: Optional[int],
    slack_bytes: int = 0,
) -> CacheSize:
    """The number of slots the flags ask for, clamped to the pool size.

    Args:
        config: the flags.
        pool: the host pool (its expert size and row count).
        min_slots: the fewest slots that serve a layer call (top-k: larger calls run in
            waves).
        min_slots_reason: how ``min_slots`` was derived, for the error message.
        free_bytes: free device memory now (None on the CPU: no automatic size).
        slack_bytes: memory SGLang keeps back from the KV pool (``1 - mem_fraction_static``
            of the memory before loading).

    Raises:
        CacheSizeError: the size is below ``min_slots``, or does not fit in ``free_bytes``.
    """
    per_slot = pool.expert_bytes
    total = pool.num_rows
    if config.cache_slots is not None:
        slots, how = config.cache_slots, f"--freetoken-cache-slots {config.cache_slots}"
    elif config.cache_ratio is not None:
        slots = int(config.cache_ratio * total)
        how = f"--freetoken-cache-ratio {config.cache_ratio} of {total} experts"
    elif config.cache_gb is not None:
        slots = int(config.cache_gb * GIB // per_slot)
        how = f"--freetoken-cache-gb {config.cache_gb}"
    else:
        if free_bytes is None:
            slots, how = total, "no size flag on a CPU device: every expert"
        else:
            budget = free_bytes - slack_bytes - int(config.kv_reserve_gb * GIB)
            slots = max(0, budget // per_slot)
            how = (
                f"automatic: {free_bytes / GIB:.2f} GiB free - {slack_bytes / GIB:.2f} GiB "
                f"runtime slack - {config.kv_reserve_gb:.2f} GiB kept for the KV pool "
                "(--freetoken-kv-reserve-gb)"
            )
    slots = min(slots, total)
    if slots < min_slots:
        raise CacheSizeError(
            f"the GPU expert cache ({how}) would hold {slots} slot{'s' * (slots != 1)}, but at least "
            f"{min_slots} are needed ({min_slots_reason}); that is "
            f"{min_slots * per_slot / GIB:.3f} GiB. Ask for at least "
            f"--freetoken-cache-slots {min_slots} (or the same as -gb / -ratio)."
        )
    if free_bytes is not None and slots * per_slot > free_bytes - slack_bytes:
        raise CacheSizeError(
            f"the GPU expert cache ({how}) needs {slots * per_slot / GIB:.2f} GiB but only "
            f"{(free_bytes - slack_bytes) / GIB:.2f} GiB of GPU memory is free after the "
            "weights and runtime slack; ask for a smaller cache"
        )
    return CacheSize(slots, how)


class ExpertCache:
    """The slot banks on the device, their residency state and their filler.

    Args:
        pool: the host pool (bank shapes and dtypes; source of fills).
        layout: the split of the slot rows between the LRU and the prefill buffers.
        device: the serving device.
        null_slots: zero rows kept after the slots (``banks_with_null_slots``): on the CPU
            for SGLang's native MoE, which needs distinct expert ids for the entries it must
            skip; on CUDA one, ``null_slot``, that a decode call's CPU-served entries read
            (``execute/slot_moe.py``).

    ``num_slots`` is every slot row (``layout.total``); the residency state manages the
    first ``layout.lru_slots`` of them.
    """

    def __init__(self, pool: HostExpertPool, layout: SlotLayout, device, null_slots: int = 0):
        self.pool = pool
        self.layout = layout
        num_slots = layout.total
        self.num_slots = num_slots
        self.num_experts = pool.num_experts
        self.device = torch.device(device)
        self.null_slots = null_slots
        self.banks_with_null_slots: Dict[str, torch.Tensor] = {
            name: torch.zeros(
                (num_slots + null_slots, *spec.shape), dtype=spec.dtype, device=device
            )
            for name, spec in pool.specs.items()
        }
        self.slot_banks: Dict[str, torch.Tensor] = {
            name: bank[:num_slots] for name, bank in self.banks_with_null_slots.items()
        }
        self.residency = ResidencyState(pool.num_rows, layout.lru_slots, device)
        # No slot (the pure-CPU backend): nothing is ever filled.
        self.filler = Filler(pool.banks, pool.device_banks, self.slot_banks) if num_slots else None
        # the late fill's copies (policy/miss.py), joined by the forward's last MoE layer call
        self.late = LateFills(self.filler) if self.filler is not None else None
        self.all_resident = layout.kind == RESIDENT
        if self.all_resident:
            # Warm-up by construction: every expert is copied in once, never again.
            self.filler.fill_all()
            self.residency.make_all_resident()

    @property
    def null_slot(self) -> Optional[int]:
        """The first all-zero row after the slots (index ``num_slots`` of
        ``banks_with_null_slots``), or None where there is none."""
        return self.num_slots if self.null_slots else None

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.pool.expert_bytes

    def reset(self) -> None:
        """Forget every resident expert (after graph capture ran dummy batches). A cache that
        holds every expert keeps them."""
        if self.all_resident:
            self.residency.make_all_resident()
        else:
            self.residency.reset()

    def describe(self) -> str:
        pct = 100.0 * self.num_slots / max(1, self.pool.num_rows)
        if not self.num_slots:
            return "none"
        return (
            f"{self.num_slots} slots ({pct:.1f}% of the pool), {self.nbytes / GIB:.2f} GiB "
            f"on {self.device}: {self.layout.describe(self.num_experts)}; fills by "
            f"{self.filler.mode}"
        )
