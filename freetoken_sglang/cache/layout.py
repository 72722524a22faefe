"""How the slot pool is split between the decode LRU and the prefill buffers (paper §3.1).

The slot banks hold ``total`` rows. Rows ``[0, lru_slots)`` are the LRU cache that decode
uses (``residency.py`` never looks past them); rows ``[lru_slots, total)`` are reserved for
prefill: two full-layer buffers of E rows each when the pool can spare them (double-buffered
streaming), else a smaller wave buffer that serves a layer call's experts in groups.

The buffers are reserved, not borrowed from the LRU per prefill: a streamed prefill evicts
nothing and leaves every LRU entry and its recency as it was, so the decode working set
survives, and no residency write is needed around a prefill. The replay of the H200 routing
traces (dummy weights) measured borrowed buffers (the 2E least recently used slots, the last
two layers seeding decode) 3.9 points of decode miss rate better at 25% of the pool
(benchmarks/RESULTS.md, session 6); borrowing is not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass

# Layouts.
RESIDENT = "resident"  # every expert has a slot: no buffer, nothing ever moves
STREAM = "stream"  # full-layer buffers (1 or 2) after the LRU slots
WAVES = "waves"  # a wave buffer smaller than one layer after the LRU slots
LRU_ONLY = "lru"  # no buffer: prefill goes through the LRU (--freetoken-prefill lru)


@dataclass(frozen=True)
class SlotLayout:
    """The split of ``total`` slot rows.

    Attributes:
        total: rows of every slot bank (LRU slots plus buffer rows).
        lru_slots: rows ``[0, lru_slots)`` managed by the LRU.
        buffer_rows: rows ``[lru_slots, total)``: ``buffers * E`` under ``stream``, the wave
            size under ``waves``, 0 under ``resident``.
        buffers: full-layer buffers under ``stream`` (1 or 2), else 0.
        kind: ``resident``, ``stream``, ``waves``, ``lru``, or ``none`` (no slot: the CPU
            backend).
    """

    total: int
    lru_slots: int
    buffer_rows: int
    buffers: int
    kind: str

    def buffer_base(self, b: int, num_experts: int) -> int:
        """First slot row of full-layer buffer ``b``."""
        return self.lru_slots + b * num_experts

    def describe(self, num_experts: int) -> str:
        if self.kind == RESIDENT:
            return "every expert resident"
        if self.kind == LRU_ONLY:
            return f"{self.lru_slots} LRU slots, no prefill buffer (prefill through the LRU)"
        if self.kind == STREAM:
            what = "2 full-layer prefill buffers" if self.buffers == 2 else (
                "1 full-layer prefill buffer"
            )
            how = "double-buffered" if self.buffers == 2 else "no overlap"
            return f"{self.lru_slots} LRU slots + {what} of {num_experts} experts ({how})"
        return (
            f"{self.lru_slots} LRU slots + a {self.buffer_rows}-expert wave buffer (less "
            f"than {2 * num_experts} + top-k slots: layers larger than the LRU run in waves)"
        )


def plan_layout(
    num_slots: int, num_experts: int, num_rows: int, top_k: int, buffers: int = 2
) -> SlotLayout:
    """Split ``num_slots`` slot rows between the LRU and the prefill buffers.

    Args:
        num_slots: S, the slots the size flags give.
        num_experts: E per MoE layer.
        num_rows: L*E, every expert of the pool.
        top_k: k; the LRU keeps at least k slots when it exists.
        buffers: full-layer buffers wanted (2: double-buffered; 1: no overlap; 0: none,
            prefill goes through the LRU).

    Returns:
        ``resident`` when S >= L*E; with ``buffers=0``, ``lru`` (every slot in the LRU) when
        S >= E; ``stream`` when S >= buffers*E + k; else ``waves`` with a
        wave buffer of ``min(E, max(k, S // 4))`` rows, and the LRU the rest (none when the
        rest would be under k slots: then every layer call runs in waves).

    Raises:
        ValueError: S < k (no layer call of one token could be served), or buffers not 0, 1
            or 2.
    """
    if buffers not in (0, 1, 2):
        raise ValueError(f"prefill buffers must be 0, 1 or 2, got {buffers}")
    if num_slots < top_k:
        raise ValueError(f"{num_slots} slots cannot serve one token's top-{top_k} experts")
    if num_slots >= num_rows:
        return SlotLayout(num_rows, num_rows, 0, 0, RESIDENT)
    if buffers == 0 and num_slots >= num_experts:
        return SlotLayout(num_slots, num_slots, 0, 0, LRU_ONLY)
    if buffers and num_slots >= buffers * num_experts + top_k:
        rows = buffers * num_experts
        return SlotLayout(num_slots, num_slots - rows, rows, buffers, STREAM)
    wave = min(num_experts, max(top_k, num_slots // 4))
    lru = num_slots - wave
    if lru < top_k:
        lru, wave = 0, min(num_experts, num_slots)
    return SlotLayout(lru + wave, lru, wave, 0, WAVES)
