"""Hooks into SGLang 0.5.17's hybrid radix cache (``sglang.srt.mem_cache.unified_radix_cache``):
anchor states are kept (paper §3.1).

- ``UnifiedRadixCache.cache_unfinished_req`` (around): first the anchor states the request
  took inside its forward enter the tree as if chunks had ended there
  (``anchors.inside.insert``); then, when a prefill chunk or the prompt ended at a position
  the request's anchor plan keeps, the radix node SGLang just gave that state
  (``req.last_node``) is pinned as an anchor (``anchors.states``). Both pin.
- ``UnifiedRadixCache.cache_finished_req`` (before): a request that finishes in its prefill
  step keeps no prompt-end anchor; the states it took inside the forward enter the tree
  first (or are freed when SGLang inserts nothing).
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


def cache_unfinished_req(original, self, req, *args, **kwargs):
    an = _anchors_of(self)
    if an is None:
        return original(self, req, *args, **kwargs)
    from freetoken_sglang.anchors import inside

    inside.insert(self, original, req, an.linear_layers, an)  # states taken inside the forward
    result = original(self, req, *args, **kwargs)
    an.keep_if_planned(req, len(req.get_fill_ids()))
    return result


def cache_finished_req(self, req, *args, **kwargs):
    an = _anchors_of(self)
    if an is not None:
        from freetoken_sglang.anchors import inside

        if kwargs.get("is_insert", args[0] if args else True):
            # finished in its prefill step: its states enter the tree first, through the
            # wrapped cache_unfinished_req (which pins), as for a request that decodes on
            inside.insert(self, type(self).cache_unfinished_req, req, an.linear_layers, an,
                          pin=False)
        else:
            inside.release(req, self.req_to_token_pool, an)
    return None


def reset(result, self, *args, **kwargs):
    an = _anchors_of(self)
    if an is not None:
        an.states.reset()
    return None


HOOKS = [
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.cache_unfinished_req",
         cache_unfinished_req, "around"),
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.cache_finished_req",
         cache_finished_req, "before"),
    Hook("sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.reset", reset, "after"),
]
