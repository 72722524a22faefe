"""The decode miss policy: how a layer call's m missed experts are split between cache fills
over PCIe and in-place CPU execution (paper §3.2, Eq. 1-4).

- ``qstar``: ``q* = round(m * B_P / B_H)`` fills, at least one, the rest on the CPU;
- ``fill``: every miss is filled (no CPU execution);
- ``cpu``: every miss runs on the CPU and decode never changes residency (a
  KTransformers-like placement that only prefill updates: through the LRU with
  ``--freetoken-prefill lru``; under streaming, the last layers' experts that borrowed
  buffers give back, and nothing with reserved buffers).

Layer calls over more than ``SPLIT_MAX_TOKENS`` rows that reach the LRU (prefill chunks that
do not stream, ``execute/choice.py``) fill every miss in all
three policies; the decision is made from shapes alone, so captured graphs keep it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from freetoken_sglang.cache.residency import FILL_ALL, MissSplit

POLICIES = ("qstar", "fill", "cpu")

# Layer calls with at most this many rows (decode steps, short prefills) split their misses.
SPLIT_MAX_TOKENS = 64


@dataclass(frozen=True)
class MissPolicy:
    """A miss policy and the bandwidths it was derived from.

    Args:
        name: one of ``POLICIES``.
        bandwidth: ``(B_P, B_H)`` in GB/s (needed by ``qstar``).

    Raises:
        ValueError: unknown name, or ``qstar`` without positive bandwidths.
    """

    name: str
    bandwidth: Optional[Tuple[float, float]] = None

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"miss policy must be one of {POLICIES}, got {self.name!r}")
        if self.name == "qstar":
            if not self.bandwidth or min(self.bandwidth) <= 0:
                raise ValueError("the qstar miss policy needs positive B_P and B_H")

    @property
    def decode_split(self) -> MissSplit:
        """The split of a decode-sized layer call."""
        if self.name == "fill":
            return FILL_ALL
        if self.name == "cpu":
            return MissSplit(0.0, 0)
        b_p, b_h = self.bandwidth
        return MissSplit(b_p / b_h, 1)

    def split_for(self, num_tokens: int) -> MissSplit:
        """The split of a layer call over ``num_tokens`` rows (prefill-sized calls fill)."""
        return self.decode_split if num_tokens <= SPLIT_MAX_TOKENS else FILL_ALL

    def describe(self) -> str:
        if self.name != "qstar":
            return self.name
        b_p, b_h = self.bandwidth
        return f"qstar (B_P {b_p:.1f} GB/s, B_H {b_h:.1f} GB/s, q*/m = B_P/B_H = {b_p / b_h:.3f})"
