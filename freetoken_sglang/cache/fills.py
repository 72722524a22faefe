"""Cache fills: copy experts from the host pool into GPU slots, as a FillPlan says (paper §4.1).

Data movement only; ``residency.py`` decides what moves. Two ways, chosen once per cache:

- ``uva``: the pool is pinned and mapped; one Triton kernel launch for all banks of the fill
  reads the planned rows straight from host memory through unified virtual addressing, with
  every index and the count read on the device. No host sync, so CUDA graphs capture it.
- ``local``: pool and cache share a device (the CPU-run SGLang of the tests): the plan is
  read on the host and each row copied with ``copy_``.

A GPU cache over a pageable pool is not built: when the pool cannot be pinned the runtime
refuses to start and names ``--freetoken-backend cpu`` (every expert on the CPU).
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from freetoken_sglang.cache.residency import FillPlan


class Filler:
    """Carries out FillPlans for one pool/cache pair.

    Args:
        pool_banks: bank name -> host bank ``[L*E, ...]`` (the pool's own tensors).
        device_pool_banks: bank name -> UVA alias of the pinned host bank, or empty when the
            pool is not pinned.
        slot_banks: bank name -> slot bank ``[S, ...]`` on the cache's device.
    """

    def __init__(
        self,
        pool_banks: Dict[str, torch.Tensor],
        device_pool_banks: Dict[str, torch.Tensor],
        slot_banks: Dict[str, torch.Tensor],
    ):
        self.pool_banks = pool_banks
        self.slot_banks = slot_banks
        self.device_pool_banks = device_pool_banks
        device = next(iter(slot_banks.values())).device
        if device.type == "cpu":
            self.mode = "local"
        elif device_pool_banks:
            self.mode = "uva"
        else:
            raise ValueError(
                "a GPU expert cache needs the host pool pinned and mapped (HostExpertPool.pin)"
            )

    def run(self, plan: FillPlan, remap: Optional[tuple] = None) -> None:
        """Copy pool row ``plan.src[i]`` into slot ``plan.dst[i]`` of every bank, for
        ``i < plan.count[0]``. ``remap = (expert_ids, layer_slots[, keep_negative[, null_slot]])``
        (contiguous int ``[N]`` per-block expert ids of SGLang's token alignment, int32 ``[E]``
        slots, bool: an expert without a slot gets -1 instead of slot 0; a slot row or None:
        an expert without a slot and a -1 id read that all-zero slot) also rewrites those
        ids to slot ids (``kernels.residency.remap_expert_ids_``), in the fill's own launch
        under ``uva`` (``kernels.fill.copy_rows_banks``)."""
        if self.mode == "uva":
            from freetoken_sglang.kernels.fill import copy_rows_banks

            names = list(self.slot_banks)
            copy_rows_banks(
                [self.device_pool_banks[n] for n in names],
                [self.slot_banks[n] for n in names],
                plan.src, plan.dst, plan.count, remap=remap,
            )
            return
        if remap is not None:
            from freetoken_sglang.kernels.residency import remap_expert_ids_

            remap_expert_ids_(*remap)
        n = int(plan.count.item())
        src = plan.src[:n].tolist()
        dst = plan.dst[:n].tolist()
        for name, slots in self.slot_banks.items():
            pool = self.pool_banks[name]
            for s, d in zip(src, dst):
                slots[d].copy_(pool[s], non_blocking=False)

    def fill_all(self) -> None:
        """Copy the whole pool into slots ``0 .. L*E-1`` (a cache that holds every expert)."""
        for name, slots in self.slot_banks.items():
            pool = self.pool_banks[name]
            slots[: pool.shape[0]].copy_(pool, non_blocking=False)


class LateFills:
    """Fills that no compute of their layer call waits for (the late fill, ``policy/miss.py``):
    on CUDA each goes on a side stream forked from the current one after its decision, and the
    forward's last MoE layer call joins them (``join``), so a captured decode graph forks and
    joins inside itself; the next forward sees every slot filled. Without CUDA the copy runs
    at once.

    Args:
        filler: the cache's ``Filler``.
    """

    def __init__(self, filler: Filler):
        self.filler = filler
        self.stream = None
        if filler.mode == "uva":
            device = next(iter(filler.slot_banks.values())).device
            self.stream = torch.cuda.Stream(device=device)
        self._held = []  # plans in flight: kept alive until the join (no reuse of their memory)

    def launch(self, plan: FillPlan) -> None:
        """Copy ``plan``'s rows after the work queued so far, without making later work wait."""
        if self.stream is None:
            self.filler.run(plan)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            self.filler.run(plan)
        self._held.append(plan)

    @property
    def pending(self) -> bool:
        """Late fills launched and not yet joined (host-side: the forward being built)."""
        return bool(self._held)

    def wait(self) -> None:
        """Make the current stream wait for the late fills launched so far (``join`` without
        forgetting them: a later launch still needs the forward's last MoE layer)."""
        if self._held:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def join(self) -> None:
        """Make the current stream wait for every late fill launched so far, and forget them."""
        self.wait()
        self._held.clear()


def row_runs(pairs) -> list:
    """``(src, dst, n)`` runs of ``pairs``, a host sequence of ``(src_row, dst_row)`` in
    ascending ``src_row``: consecutive pairs whose rows both advance by one share a run (one
    copy each)."""
    runs = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1][2] += 1
        else:
            runs.append([src, dst, 1])
    return [tuple(r) for r in runs]


def copy_row_runs(
    pool_banks: Dict[str, torch.Tensor],
    slot_banks: Dict[str, torch.Tensor],
    runs,
    non_blocking: bool,
) -> None:
    """For each ``(src, dst, n)`` in ``runs``, copy pool rows ``[src, src+n)`` of every bank
    into slot rows ``[dst, dst+n)``. From a pinned pool to a CUDA cache with
    ``non_blocking`` this is one ``cudaMemcpyAsync`` per run and bank on the current stream:
    the copy engine moves the bytes, no SM is used (paper §3.1)."""
    for name, slots in slot_banks.items():
        pool = pool_banks[name]
        for src, dst, n in runs:
            slots[dst : dst + n].copy_(pool[src : src + n], non_blocking=non_blocking)
