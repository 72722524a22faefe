"""The anchors of one scheduler process: the markers in use, each request's plan, the states."""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Tuple

from freetoken_sglang.anchors.markers import find_markers, marker_ids
from freetoken_sglang.anchors.plan import AnchorPlan, plan
from freetoken_sglang.anchors.states import AnchorStates
from freetoken_sglang.errors import RefusedError

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


MODES = ("auto", "on", "inside", "off")


def resolve_mode(mode: str, experts_on_gpu: bool) -> str:
    """How anchors keep exact states (``--freetoken-anchor-cuts``): ``on`` (a prefill chunk
    ends at each anchor), ``inside`` (the recurrent layers replay their inputs up to each
    anchor inside the forward: ``anchors.inside``), ``off`` (no anchor state of its own), or
    ``auto``: ``on`` when every routed expert is resident on the GPU, else ``inside``. An
    extra chunk pays a fixed cost per forward, whatever its length, unless every expert is on
    the GPU: a streamed pass over the pool's non-resident experts, their fills, or the CPU
    executor reading them (0.7-1.0 s per cut on the H200 at 25% cache for the Qwen3.6-35B-A3B
    shape: benchmarks/RESULTS.md, Session 9).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"--freetoken-anchor-cuts: choose one of {', '.join(MODES)}, "
                         f"not {mode!r}")
    if mode == "auto":
        return "on" if experts_on_gpu else "inside"
    return mode


class Anchors:
    """Anchor markers ``markers`` (strings) encoded as ``ids``, merged within ``min_distance``
    tokens (``plan.plan``); ``cuts`` is ``--freetoken-anchor-cuts`` (``mode``, resolved by
    ``attach``: ``resolve_mode``); ``states`` is set by ``attach`` once the scheduler's radix
    cache exists; ``linear_layers`` is the model's recurrent layer count."""

    def __init__(self, markers: Sequence[str], ids: Sequence[Tuple[int, ...]],
                 min_distance: int, budget: Optional[int], cuts: str = "auto"):
        self.markers = tuple(markers)
        self.ids = [tuple(m) for m in ids]
        self.min_distance = int(min_distance)
        self.requested_budget = budget
        self.cuts_mode = cuts
        self.mode = cuts if cuts != "auto" else "on"  # resolved by attach
        self.linear_layers = 0
        self.states: Optional[AnchorStates] = None

    @classmethod
    def from_tokenizer(cls, tokenizer, markers, min_distance, budget,
                       cuts: str = "auto") -> "Anchors":
        return cls(markers, marker_ids(tokenizer, markers), min_distance, budget, cuts)

    def attach(self, tree_cache, mamba_slots: int, max_running_requests: int,
               kv_tokens: int, experts_on_gpu: bool, linear_layers: int = 0) -> None:
        """Keep anchor states in ``tree_cache`` (a ``UnifiedRadixCache`` with a mamba
        component); the budget is the flag's or ``default_budget``, their KV at most half of
        the ``kv_tokens``-token KV pool; how anchors keep their states follows ``resolve_mode``
        (``experts_on_gpu``: every routed expert is resident on the GPU); logged.

        Raises:
            RefusedError: the mamba pool cannot hold the budget (names the flags to change).
        """
        given = self.requested_budget is not None
        bound = budget_bound(mamba_slots, max_running_requests)
        budget = self.requested_budget if given else default_budget(
            mamba_slots, max_running_requests)
        if budget < 1 or budget > bound:
            raise RefusedError(
                f"--enable-freetoken: {budget} anchor states do not fit the mamba pool of "
                f"{mamba_slots} states with {max_running_requests} running requests (at most "
                f"{bound}): lower --freetoken-anchor-states or --max-running-requests, raise "
                "--max-mamba-cache-size, or pass --freetoken-anchors off"
            )
        self.states = AnchorStates(tree_cache, budget, kv_tokens // 2)
        self.mode = resolve_mode(self.cuts_mode, experts_on_gpu)
        self.linear_layers = int(linear_layers)
        shown = ", ".join(f"{m!r}={list(i)}" for m, i in zip(self.markers, self.ids))
        merged = f"merged within {self.min_distance} tokens"
        why = f"--freetoken-anchor-cuts {self.cuts_mode}" + (
            "" if experts_on_gpu or self.cuts_mode != "auto" else ", experts not all on the GPU")
        how = {
            "on": f"a prefill chunk ends at each ({merged}; {why})",
            "inside": f"the state at each is taken inside the prefill forward, no chunk ends "
                      f"there ({merged}; {why})",
            "off": f"no state of their own ({why}); the matched prefix and the prompt end are "
                   f"kept when one lies within {self.min_distance} tokens",
        }[self.mode]
        logger.info(
            "FreeToken anchors: %s; %s; at most %d anchor states%s (mamba pool of %d states, "
            "%d running requests) pinning at most %d KV tokens (half the pool)",
            shown, how, budget, "" if given else " (default)", mamba_slots,
            max_running_requests, kv_tokens // 2,
        )

    def follow_experts(self, experts_on_gpu: bool) -> None:
        """Resolve ``--freetoken-anchor-cuts auto`` again after a cache resize moved the
        experts onto or off the GPU (``FreeTokenRuntime.resize_cache``); applies from the next
        batch (both modes keep the same positions, ``plan_for``). Logged when it changes."""
        if self.states is None or self.cuts_mode != "auto":
            return
        mode = resolve_mode(self.cuts_mode, experts_on_gpu)
        if mode != self.mode:
            logger.info(
                "FreeToken anchors: every routed expert %s the GPU after the resize: anchor "
                "states now %s", "on" if experts_on_gpu else "no longer all on",
                "at prefill chunk ends" if mode == "on" else "taken inside the prefill forward")
            self.mode = mode

    def positions(self, ids: Sequence[int]):
        """Marker positions of the prompt ``ids``."""
        return find_markers(ids, self.ids)

    def plan_for(self, req, prefix_len: int) -> AnchorPlan:
        """The plan of an admitted SGLang ``Req`` with ``prefix_len`` matched tokens (stored on
        the request for its later chunks)."""
        prompt = req.origin_input_ids
        p = plan(self.positions(prompt), prefix_len, len(prompt), self.min_distance,
                 self.mode != "off")
        setattr(req, PLAN_ATTR, p)
        return p

    @property
    def ends_chunks(self) -> bool:
        """Whether a prefill chunk ends at each anchor cut."""
        return self.mode == "on"

    def keep_if_planned(self, req, pos: int) -> None:
        """Pin ``req.last_node`` as an anchor if SGLang just gave it the state at ``pos`` and
        the request's plan keeps that position."""
        plan = getattr(req, PLAN_ATTR, None)
        if plan is not None and pos in plan.keep and self.states.depth(req.last_node) == pos:
            self.states.keep(req.last_node)

    def snapshot(self):
        out = {"markers": list(self.markers), "min_distance": self.min_distance,
               "cuts": self.mode}
        if self.states is not None:
            out.update(self.states.snapshot())
        return out
