"""Hooks into SGLang 0.5.17's hybrid radix cache (``sglang.srt.mem_cache.unified_radix_cache``):
anchor states are kept (paper §3.1).

- ``UnifiedRadixCache.cache_unfinished_req`` (after): when a prefill chunk or the prompt
  ended at a position the request's anchor plan keeps, the radix node SGLang just gave that
  state (``req.last_node``) is pinned as an anchor (``anchors.states``). (A request that
  finishes in its prefill step caches through ``cache_finished_req`` and keeps no
  prompt-end anchor.)
- ``UnifiedRadixCache.reset`` (after): the anchors of the old tree are forgotten.
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook


def _anchors_of(cache):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    an = getattr(rt, "anchors", None) if rt is not None else None
    if an is None or an.states is None or an.states.cache is not cache:
        return None
    return an


def cache_unfinished_req(result, self, req, *args, **kwargs):
    from freetoken_sglang.anchors.book import PLAN_ATTR

    an = _anchors_of(self)
    plan = getattr(req, PLAN_ATTR, None)
    if an is None or plan is None:
        return None
    pos = len(req.get_fill_ids())
    if pos in plan.keep and an.states.depth(req.last_node) == pos:
        an.states.keep(req.last_node)
    return None


def reset(result, self, *args, **kwargs):
    an = _anchors_of(self)
    if an is not None:
        an.states.reset()
    return None


HOOKS = [
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.cache_unfinished_req",
         cache_unfinished_req, "after"),
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset", reset, "after"),
]
