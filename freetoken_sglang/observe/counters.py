"""Expert-cache counters: routed expert reads, hits, fills, evictions and CPU-executed misses,
per phase and MoE layer.

The counters live on the device and are advanced inside the (graph-captured) layer call, so
counting costs no host sync; ``snapshot`` reads them back off the hot path, for
``GET /freetoken/stats`` and SGLang's periodic decode log.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

# Field order of ``ExpertCounters.counts``.
FIELDS = ("reads", "hits", "fills", "evictions", "cpu")
PHASES = ("decode", "prefill")


class ExpertCounters:
    """int64 ``counts[phase, 5, L]``: per phase and MoE layer, since start (or the last reset).
    The phase is ``decode`` for layer calls small enough to split their misses
    (``policy.miss.SPLIT_MAX_TOKENS`` rows: decode steps, short prefills) and ``prefill`` for
    the rest. Fields:

    - ``reads``: unique routed experts of the layer calls (hits + fills + cpu; an expert
      routed to by several tokens of one call counts once);
    - ``hits``: of those, already resident in a slot;
    - ``fills``: copied from the host pool into a slot before the call computed;
    - ``evictions``: fills (late fills too) that displaced a resident expert;
    - ``cpu``: misses run in place on the CPU (they do not change residency, except under
      the late fill, which copies them in after the call: ``ResidencyState.late`` counts
      those).
    """

    def __init__(self, moe_layer_ids: List[int], device):
        self.moe_layer_ids = list(moe_layer_ids)
        self.counts = torch.zeros(
            (len(PHASES), len(FIELDS), len(self.moe_layer_ids)), dtype=torch.int64, device=device
        )
        self._last_totals: Optional[Dict[str, int]] = None

    def of_phase(self, phase: str) -> torch.Tensor:
        """The int64 ``[5, L]`` view a layer call of ``phase`` advances."""
        return self.counts[PHASES.index(phase)]

    def reset(self) -> None:
        self.counts.zero_()
        self._last_totals = None

    def snapshot(self) -> Dict[str, object]:
        """JSON-ready totals (all, decode, prefill) and per-layer counts of both phases
        (reads the device: not for the hot path)."""
        per_phase = self.counts.cpu().tolist()

        def totals_of(rows):
            t = {f: int(sum(r)) for f, r in zip(FIELDS, rows)}
            t["hit_rate"] = t["hits"] / t["reads"] if t["reads"] else None
            return t

        both = [[a + b for a, b in zip(ra, rb)] for ra, rb in zip(*per_phase)]
        layers = [
            {"layer_id": lid, **{f: both[i][j] for i, f in enumerate(FIELDS)}}
            for j, lid in enumerate(self.moe_layer_ids)
        ]
        out = {"total": totals_of(both), "layers": layers}
        for phase, rows in zip(PHASES, per_phase):
            out[phase] = totals_of(rows)
        return out

    def log_line(self, all_resident: bool = False) -> str:
        """One line for the decode log: the window since the previous call, and the totals
        (``all_resident``: the cache holds every expert, so no layer call goes through the
        LRU)."""
        totals = self.snapshot()["total"]
        last = self._last_totals or {f: 0 for f in FIELDS}
        window = {f: totals[f] - last[f] for f in FIELDS}
        self._last_totals = {f: totals[f] for f in FIELDS}
        total = (f"total reads {totals['reads']}, hits {totals['hits']}, fills "
                 f"{totals['fills']}, evictions {totals['evictions']}, cpu {totals['cpu']}")
        if all_resident:
            return ("FreeToken expert cache: every expert resident, layer calls run as stock "
                    f"SGLang's (not counted); {total}")
        if not window["reads"]:
            return ("FreeToken expert cache: no layer call went through the LRU since the "
                    "last line (they ran in waves or streamed: /freetoken/stats "
                    f"prefill_stream); {total}")
        rate = window["hits"] / window["reads"]
        return (
            f"FreeToken expert cache: hit rate {rate:.3f} over the last "
            f"{window['reads']} reads ({window['fills']} fills, {window['evictions']} "
            f"evictions, {window['cpu']} on the CPU); {total}"
        )
