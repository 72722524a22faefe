"""Expert-cache counters: routed expert reads, hits, fills and evictions, per MoE layer.

The counters live on the device and are advanced inside the (graph-captured) layer call, so
counting costs no host sync; ``snapshot`` reads them back off the hot path, for
``GET /freetoken/stats`` and SGLang's periodic decode log.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

# Row order of ``ExpertCounters.counts``.
FIELDS = ("reads", "hits", "fills", "evictions")


class ExpertCounters:
    """int64 ``counts[4, L]``: per MoE layer, since start (or the last reset):

    - ``reads``: unique routed experts of the layer calls (hits + fills; an expert routed
      to by several tokens of one call counts once);
    - ``hits``: of those, already resident in a slot;
    - ``fills``: copied from the host pool into a slot;
    - ``evictions``: fills that displaced a resident expert.
    """

    def __init__(self, moe_layer_ids: List[int], device):
        self.moe_layer_ids = list(moe_layer_ids)
        self.counts = torch.zeros(
            (len(FIELDS), len(self.moe_layer_ids)), dtype=torch.int64, device=device
        )
        self._last_totals: Optional[Dict[str, int]] = None

    def reset(self) -> None:
        self.counts.zero_()
        self._last_totals = None

    def snapshot(self) -> Dict[str, object]:
        """JSON-ready totals and per-layer counts (reads the device: not for the hot path)."""
        rows = self.counts.cpu().tolist()
        totals = {f: int(sum(r)) for f, r in zip(FIELDS, rows)}
        totals["hit_rate"] = totals["hits"] / totals["reads"] if totals["reads"] else None
        layers = [
            {"layer_id": lid, **{f: rows[i][j] for i, f in enumerate(FIELDS)}}
            for j, lid in enumerate(self.moe_layer_ids)
        ]
        return {"total": totals, "layers": layers}

    def log_line(self) -> str:
        """One line for the decode log: the window since the previous call, and the totals."""
        totals = self.snapshot()["total"]
        last = self._last_totals or {f: 0 for f in FIELDS}
        window = {f: totals[f] - last[f] for f in FIELDS}
        self._last_totals = {f: totals[f] for f in FIELDS}
        rate = window["hits"] / window["reads"] if window["reads"] else float("nan")
        return (
            f"FreeToken expert cache: hit rate {rate:.3f} over the last "
            f"{window['reads']} reads ({window['fills']} fills, {window['evictions']} "
            f"evictions); total reads {totals['reads']}, hits {totals['hits']}, fills "
            f"{totals['fills']}, evictions {totals['evictions']}"
        )
