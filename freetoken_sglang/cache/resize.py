"""Resizing the GPU expert cache while serving: what is kept, how it is put back, and when the free-memory watch resizes (paper §2.3, §3.3).

Bookkeeping and the rules only; ``runtime.FreeTokenRuntime.resize_cache`` runs a resize at a
scheduler safe point (no forward in flight): it frees the old slot banks, allocates the new
ones, re-captures SGLang's CUDA graphs over them, and then puts the kept experts back with
``install`` (copied again from the host pool, the source of truth, so a resize never needs the
old and the new banks at once).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch

from freetoken_sglang.cache.fills import Filler
from freetoken_sglang.cache.residency import FillPlan, ResidencyState


@dataclass(frozen=True)
class ResizeReport:
    """What one resize did (the answer of ``POST /freetoken/cache``).

    Attributes:
        old_slots, new_slots: slot rows before and after (LRU and prefill buffers).
        old_bytes, new_bytes: bytes of the slot banks before and after.
        kept: experts that stayed resident (the most recently used that fit).
        dropped: resident experts that did not fit.
        layout: the new split (``SlotLayout.describe``).
        graphs_recaptured: CUDA-graph runners captured again (``decode``, ``prefill``).
        seconds: wall time of the resize, graph capture included.
        reason: ``request`` (HTTP or Engine), ``policy`` (a miss-policy change alone: the
            cache is rebuilt at its size) or ``min-free`` (``--freetoken-min-free-gb``).
        free_bytes_after: free device memory after the resize (None on the CPU).
        clamped_to_pool: more slots were asked for than the pool has experts.
        invariant_problems: ``check_invariants`` of the new residency state (empty: sound).
        miss_policy: the decode miss policy after it (``MissPolicy.label``).
    """

    old_slots: int
    new_slots: int
    old_bytes: int
    new_bytes: int
    kept: int
    dropped: int
    layout: str
    graphs_recaptured: Tuple[str, ...]
    seconds: float
    reason: str
    free_bytes_after: Optional[int]
    clamped_to_pool: bool = False
    invariant_problems: Tuple[str, ...] = ()
    miss_policy: str = ""

    def as_dict(self) -> dict:
        out = asdict(self)
        out["graphs_recaptured"] = list(self.graphs_recaptured)
        out["invariant_problems"] = list(self.invariant_problems)
        return out


def kept_experts(state: ResidencyState, limit: int,
                 num_experts: int) -> List[Tuple[int, int]]:
    """The resident experts to keep, most recently used first, at most ``limit``.

    Args:
        state: the residency state of the cache being resized.
        limit: the most experts to return.
        num_experts: E, experts per MoE layer.

    Returns:
        ``(flat expert id l*E+e, last-use clock stamp)`` pairs, by descending stamp (the LRU's
        order); experts of equal stamp (one layer call's, or an all-resident cache's, which
        records no recency) by local expert index, then layer, so that a shrink of an
        all-resident cache keeps the same share of every MoE layer.
    """
    owner = state.owner[: state.num_slots].cpu()
    stamp = torch.div(state.key.cpu(), max(1, state.num_slots), rounding_mode="floor")
    held = [(int(owner[s]), int(stamp[s])) for s in (owner >= 0).nonzero().squeeze(1).tolist()]
    held.sort(key=lambda fs: (-fs[1], fs[0] % num_experts, fs[0]))
    return held[: max(0, limit)]


def kept_fill_clocks(state: ResidencyState, kept: List[Tuple[int, int]]) -> List[int]:
    """The clock of each ``kept`` expert's last fill in ``state`` (``ResidencyState.filled_at``
    of its slot; -2: none since that cache was built), for ``install``."""
    if not kept:
        return []
    flat = torch.tensor([f for f, _ in kept], dtype=torch.long, device=state.owner.device)
    return state.filled_at[state.residency[flat].long()].tolist()


def install(state: ResidencyState, filler: Optional[Filler], kept: List[Tuple[int, int]],
            clock: int, filled: Optional[List[int]] = None) -> None:
    """Put ``kept`` (``kept_experts``' pairs) into slots ``0 .. n-1`` of an empty cache, with
    their stamps and the old clock, so the LRU order among them is what it was; slots past
    them stay empty (first victims). ``filled``: the kept experts' last fill clocks
    (``kept_fill_clocks``), so the useful admission reads the same history; without it they
    count as never filled (-2: hit since, like an all-resident cache's).

    Raises:
        ValueError: more experts than LRU slots.
    """
    n = len(kept)
    if n > state.num_slots:
        raise ValueError(f"{n} kept experts do not fit in {state.num_slots} LRU slots")
    state.clock.fill_(clock)
    if not n:
        return
    dev = state.owner.device
    flat = torch.tensor([f for f, _ in kept], dtype=torch.int32, device=dev)
    slots = torch.arange(n, dtype=torch.int32, device=dev)
    stamps = torch.tensor([s for _, s in kept], dtype=torch.int64, device=dev)
    if filler is not None:
        filler.run(FillPlan(src=flat, dst=slots, count=torch.tensor([n], dtype=torch.int32,
                                                                       device=dev)))
    state.residency[flat.long()] = slots
    state.owner[:n] = flat
    state.key[:n] = stamps * state.num_slots + slots.long()
    if filled is not None:
        state.filled_at[:n] = torch.tensor(filled[:n], dtype=torch.int64, device=dev)


def check_invariants(state: ResidencyState) -> List[str]:
    """Problems of the residency state (empty when consistent): every slot's owner maps back
    to that slot and the reverse, the sinks are empty and the LRU keys are unique."""
    res = state.residency.cpu()
    owner = state.owner.cpu()
    key = state.key.cpu()
    S = state.num_slots
    problems = []
    if int(res[-1]) != -1 or int(owner[-1]) != -1:
        problems.append("a sink entry is set")
    held = (owner[:S] >= 0).nonzero().squeeze(1).tolist()
    for s in held:
        if int(res[int(owner[s])]) != s:
            problems.append(f"slot {s} holds expert {int(owner[s])}, which maps to "
                            f"{int(res[int(owner[s])])}")
    mapped = (res[:-1] >= 0).nonzero().squeeze(1).tolist()
    if len(mapped) != len(held):
        problems.append(f"{len(mapped)} experts map to a slot but {len(held)} slots are held")
    for e in mapped:
        if int(res[e]) >= S or int(owner[int(res[e])]) != e:
            problems.append(f"expert {e} maps to slot {int(res[e])}, which does not hold it")
    if len(set(key.tolist())) != S:
        problems.append("LRU keys are not unique")
    return problems


def runtime_reserve(slack_bytes: int, serving_free_bytes: Optional[int],
                    shrink_floor_bytes: Optional[int] = None) -> int:
    """Device memory (bytes) a resize leaves free for SGLang's runtime: its slack, or the
    free memory it started serving with (``serving_free_bytes``, after the KV pool and the
    CUDA graphs) when that is less, or the lowest free memory a shrink of this cache started
    from (``shrink_floor``) when that is less still, so that a cache can grow back into the
    memory its own shrinks freed: the server already ran with that little free."""
    reserve = slack_bytes if serving_free_bytes is None else min(slack_bytes, serving_free_bytes)
    if shrink_floor_bytes is not None:
        reserve = min(reserve, shrink_floor_bytes)
    return max(0, reserve)


def shrink_floor(free_before: int, free_after: int, freed_bytes: int) -> int:
    """The free device memory (bytes) a shrink started from, less what the shrink's rebuild
    kept of the bytes it freed (``freed_bytes - (free_after - free_before)``: the new CUDA
    graphs, which a later rebuild frees again before it captures), so that growing back to
    the old size is allowed exactly when the memory the shrink freed is free again."""
    kept_by_rebuild = max(0, freed_bytes - (free_after - free_before))
    return free_before - kept_by_rebuild


def resize_allowance(cache_bytes: int, free_bytes: int, slack_bytes: int) -> int:
    """Bytes a resized cache may take: its own ``cache_bytes`` (freed first) and the device's
    free memory beyond SGLang's runtime slack (``1 - mem_fraction_static`` of the memory
    before loading, which SGLang leaves free for activations and graph capture; the KV pool
    holds the rest)."""
    return cache_bytes + max(0, free_bytes - slack_bytes)


# The most a min-free shrink goes beyond the floor (``min_free_target``): well above the MiB
# a graph capture keeps, well under a large cache's grow step.
SHRINK_MARGIN_BYTES = 256 << 20


def min_free_target(
    num_slots: int,
    configured_slots: int,
    min_slots: int,
    free_bytes: int,
    min_free_bytes: int,
    slot_bytes: int,
    grow_step: int,
) -> Optional[int]:
    """The slot count ``--freetoken-min-free-gb`` asks for now, or None to stay.

    A band above the floor: under ``min_free_bytes`` it shrinks (to no fewer than
    ``min_slots``) by the slots that bring free device memory back to the floor plus a margin
    (one ``grow_step``, at most ``SHRINK_MARGIN_BYTES``, at least one slot); it grows back
    towards ``configured_slots`` only when at least two ``grow_step``s of slots fit above the
    floor, and then leaves one of them free. So the few MiB a resize's graph capture keeps,
    or a desktop's small allocations, do not make it resize again (every resize stalls decode
    for a graph capture; on the H200 a watch without the shrink margin shrank by 1-4 slots
    every 3 s).
    """
    if free_bytes < min_free_bytes:
        margin = max(slot_bytes, min(grow_step * slot_bytes, SHRINK_MARGIN_BYTES))
        short = min_free_bytes - free_bytes + margin
        want = max(min_slots, num_slots - -(-short // slot_bytes))
        return want if want < num_slots else None
    if num_slots < configured_slots:
        room = (free_bytes - min_free_bytes) // slot_bytes
        if room >= 2 * grow_step:
            return min(configured_slots, num_slots + room - grow_step)
    return None
