"""How the slot pool is split between the decode LRU and the prefill buffers (paper §3.1).

The slot banks hold ``total`` rows. Rows ``[0, lru_slots)`` are the LRU cache that decode
uses (``residency.py`` never looks past them). Full-layer prefill buffers (two for double-
buffered streaming, E rows each) come in one of two ways:

- **borrowed** (default; the paper's way): every row is in the LRU; each streamed forward
  lends the 2E least recently used slots out as the buffers (their experts are evicted) and
  gives them back at its end holding the streamed experts of the last two MoE layers, as the
  most recent entries, which seeds the next decode step (``execute/prefill_stream.py``);
- **reserved**: rows ``[lru_slots, total)`` are the buffers, outside the LRU for good; a
  streamed prefill evicts nothing, but decode has 2E slots fewer.

Borrowed is the default by measurement (benchmarks/RESULTS.md, session 7; H200, Qwen3-30B-A3B
shape, 25% of the pool): batch-4 decode kept its hit rate (0.182 against 0.086 reserved) and
ran 7-8% faster, agent TTFTs were the same within 2%, a streamed chunk was 1-3% slower
(scattered copies), and with either, decode after an 8k-token prefill refilled nothing of its
working set. A pool that cannot spare two full layers gets a smaller reserved wave buffer
instead, which serves a layer call's experts in groups.
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
        borrowed: ``stream`` only: the buffers are lent out of the LRU per streamed forward
            (``buffer_rows`` is then 0: every row is an LRU slot).
    """

    total: int
    lru_slots: int
    buffer_rows: int
    buffers: int
    kind: str
    borrowed: bool = False

    def buffer_base(self, b: int, num_experts: int) -> int:
        """First slot row of reserved full-layer buffer ``b``.

        Raises:
            ValueError: the buffers are borrowed (their slots change per forward).
        """
        if self.borrowed:
            raise ValueError("borrowed prefill buffers have no fixed slot rows")
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
            if self.borrowed:
                return (
                    f"{self.lru_slots} LRU slots; {what} of {num_experts} experts borrowed "
                    f"from the LRU's oldest slots per streamed forward ({how})"
                )
            return f"{self.lru_slots} LRU slots + {what} of {num_experts} experts ({how})"
        return (
            f"{self.lru_slots} LRU slots + a {self.buffer_rows}-expert wave buffer (less "
            f"than {2 * num_experts} + top-k slots: layers larger than the LRU run in waves)"
        )


def plan_layout(
    num_slots: int,
    num_experts: int,
    num_rows: int,
    top_k: int,
    buffers: int = 2,
    borrow: bool = True,
) -> SlotLayout:
    """Split ``num_slots`` slot rows between the LRU and the prefill buffers.

    Args:
        num_slots: S, the slots the size flags give.
        num_experts: E per MoE layer.
        num_rows: L*E, every expert of the pool.
        top_k: k; the LRU keeps at least k slots when it exists.
        buffers: full-layer buffers wanted (2: double-buffered; 1: no overlap; 0: none,
            prefill goes through the LRU).
        borrow: ``stream`` buffers borrowed from the LRU per streamed forward (True) or
            reserved after it (False).

    Returns:
        ``resident`` when S >= L*E; with ``buffers=0``, ``lru`` (every slot in the LRU) when
        S >= E; ``stream`` when S >= buffers*E + k (borrowed: ``lru_slots = S``; reserved:
        ``S - buffers*E``); else ``waves`` with a
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
        if borrow:
            return SlotLayout(num_slots, num_slots, 0, buffers, STREAM, borrowed=True)
        rows = buffers * num_experts
        return SlotLayout(num_slots, num_slots - rows, rows, buffers, STREAM)
    wave = min(num_experts, max(top_k, num_slots // 4))
    lru = num_slots - wave
    if lru < top_k:
        lru, wave = 0, min(num_experts, num_slots)
    return SlotLayout(lru + wave, lru, wave, 0, WAVES)
