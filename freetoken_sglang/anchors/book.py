"""The anchors of one scheduler process: the markers in use, each request's plan, the states."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

from freetoken_sglang.anchors.markers import find_markers, marker_ids
from freetoken_sglang.anchors.plan import AnchorPlan, plan
from freetoken_sglang.anchors.states import AnchorStates

logger = logging.getLogger(__name__)

# Request attribute holding its AnchorPlan (set at admission).
PLAN_ATTR = "_freetoken_anchor_plan"


def budget_bound(mamba_slots: int, max_running_requests: int) -> int:
    """The most anchor states the mamba pool can hold: its slots less two per running request
    (its own state and the copy a prefill chunk end inserts)."""
    return int(mamba_slots) - 2 * int(max_running_requests)


def default_budget(mamba_slots: int, max_running_requests: int) -> int:
    """Anchor states kept by default: half of ``budget_bound``."""
    return budget_bound(mamba_slots, max_running_requests) // 2


def cuts_enabled(mode: str, experts_on_gpu: bool) -> bool:
    """Whether anchors end prefill chunks (``--freetoken-anchor-cuts``): ``on``, ``off``, or
    ``auto``: on only when every routed expert is resident on the GPU. Otherwise each extra
    chunk pays a fixed cost per forward, whatever its length: a streamed pass over the pool's
    non-resident experts, their fills, or the CPU executor reading them (0.7-1.0 s per cut on
    the H200 at 25% cache for the Qwen3.6-35B-A3B shape: benchmarks/RESULTS.md, Session 9),
    more than the re-prefill a cut can save while SGLang keeps the state at every chunk and
    prompt end.

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"--freetoken-anchor-cuts: choose auto, on or off, not {mode!r}")
    return mode == "on" or (mode == "auto" and experts_on_gpu)


class Anchors:
    """Anchor markers ``markers`` (strings) encoded as ``ids``, merged within ``min_distance``
    tokens (``plan.plan``); ``cuts`` is ``--freetoken-anchor-cuts`` (``cuts_on``, whether
    plans end chunks, is resolved by ``attach``); ``states`` is set by ``attach`` once the
    scheduler's radix cache exists."""

    def __init__(self, markers: Sequence[str], ids: Sequence[Tuple[int, ...]],
                 min_distance: int, budget: Optional[int], cuts: str = "auto"):
        self.markers = tuple(markers)
        self.ids = [tuple(m) for m in ids]
        self.min_distance = int(min_distance)
        self.requested_budget = budget
        self.cuts_mode = cuts
        self.cuts_on = cuts == "on"  # resolved by attach
        self.states: Optional[AnchorStates] = None

    @classmethod
    def from_tokenizer(cls, tokenizer, markers, min_distance, budget,
                       cuts: str = "auto") -> "Anchors":
        return cls(markers, marker_ids(tokenizer, markers), min_distance, budget, cuts)

    def attach(self, tree_cache, mamba_slots: int, max_running_requests: int,
               kv_tokens: int, experts_on_gpu: bool) -> None:
        """Keep anchor states in ``tree_cache`` (a ``UnifiedRadixCache`` with a mamba
        component); the budget is the flag's or ``default_budget``, their KV at most half of
        the ``kv_tokens``-token KV pool; whether anchors end chunks follows ``cuts_enabled``
        (``experts_on_gpu``: every routed expert is resident on the GPU); logged.

        Raises:
            ValueError: the mamba pool cannot hold the budget (names the flags to change).
        """
        given = self.requested_budget is not None
        bound = budget_bound(mamba_slots, max_running_requests)
        budget = self.requested_budget if given else default_budget(
            mamba_slots, max_running_requests)
        if budget < 1 or budget > bound:
            raise ValueError(
                f"--enable-freetoken: {budget} anchor states do not fit the mamba pool of "
                f"{mamba_slots} states with {max_running_requests} running requests (at most "
                f"{bound}): lower --freetoken-anchor-states or --max-running-requests, raise "
                "--max-mamba-cache-size, or pass --freetoken-anchors off"
            )
        self.states = AnchorStates(tree_cache, budget, kv_tokens // 2)
        self.cuts_on = cuts_enabled(self.cuts_mode, experts_on_gpu)
        shown = ", ".join(f"{m!r}={list(i)}" for m, i in zip(self.markers, self.ids))
        if self.cuts_on:
            how = f"a prefill chunk ends at each (merged within {self.min_distance} tokens)"
        else:
            why = "" if experts_on_gpu else "experts are not all on the GPU: "
            how = (f"no chunk ends at them ({why}--freetoken-anchor-cuts {self.cuts_mode}); "
                   f"the matched prefix and the prompt end are kept when one lies within "
                   f"{self.min_distance} tokens")
        logger.info(
            "FreeToken anchors: %s; %s; at most %d anchor states%s (mamba pool of %d states, "
            "%d running requests) pinning at most %d KV tokens (half the pool)",
            shown, how, budget, "" if given else " (default)", mamba_slots,
            max_running_requests, kv_tokens // 2,
        )

    def positions(self, ids: Sequence[int]):
        """Marker positions of the prompt ``ids``."""
        return find_markers(ids, self.ids)

    def plan_for(self, req, prefix_len: int) -> AnchorPlan:
        """The plan of an admitted SGLang ``Req`` with ``prefix_len`` matched tokens (stored on
        the request for its later chunks)."""
        prompt = req.origin_input_ids
        p = plan(self.positions(prompt), prefix_len, len(prompt), self.min_distance,
                 self.cuts_on)
        setattr(req, PLAN_ATTR, p)
        return p

    def snapshot(self):
        out = {"markers": list(self.markers), "min_distance": self.min_distance,
               "cuts": self.cuts_on}
        if self.states is not None:
            out.update(self.states.snapshot())
        return out
