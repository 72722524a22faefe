"""Where one request's prefill ends a chunk, and which of its states become anchors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple


@dataclass(frozen=True)
class AnchorPlan:
    """The anchors of one admitted request (token positions; a position ``p`` is the state
    after the first ``p`` prompt tokens).

    ``cuts``: positions where a prefill chunk ends so that SGLang keeps the exact state
    there. ``keep``: every position whose state is kept as an anchor: the cuts, the matched
    prefix when a marker lies within ``min_distance`` after it, and the prompt end when one
    lies within ``min_distance`` before it (those two states exist without a cut).
    """

    cuts: Tuple[int, ...]
    keep: Tuple[int, ...]


def plan(positions: Sequence[int], prefix_len: int, prompt_len: int,
         min_distance: int, cuts_on: bool = True) -> AnchorPlan:
    """The plan of a request whose matched prefix is ``prefix_len`` tokens of a
    ``prompt_len``-token prompt with marker positions ``positions`` (``markers.find_markers``).

    Walking the markers beyond the prefix, one closer than ``min_distance`` to the last kept
    position (the prefix itself to begin with) is merged into it; one closer than that to
    the prompt end keeps the prompt end instead; every other one is a cut. With ``cuts_on``
    False there are no cuts: only the prefix and the prompt end are kept, each when a marker
    lies within ``min_distance`` of it (after the prefix, before the prompt end).
    """
    if not cuts_on:
        inside = [p for p in positions if prefix_len <= p < prompt_len]
        keep = set()
        if prefix_len > 0 and any(p - prefix_len < min_distance for p in inside):
            keep.add(prefix_len)
        if any(prompt_len - p < min_distance for p in inside):
            keep.add(prompt_len)
        return AnchorPlan((), tuple(sorted(keep)))
    cuts, keep = [], set()
    last = prefix_len
    for p in sorted(positions):
        if p < prefix_len or p >= prompt_len:
            continue
        if p - last < min_distance:
            if last == prefix_len and prefix_len > 0:
                keep.add(prefix_len)
            continue
        if prompt_len - p < min_distance:
            keep.add(prompt_len)
            break
        cuts.append(p)
        keep.add(p)
        last = p
    return AnchorPlan(tuple(cuts), tuple(sorted(keep)))


def next_cut(cuts: Sequence[int], done: int) -> Optional[int]:
    """The first cut beyond ``done`` prefilled tokens, or None."""
    for p in cuts:
        if p > done:
            return p
    return None
