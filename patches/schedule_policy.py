"""Hooks into SGLang 0.5.17's prefill scheduling (``sglang.srt.managers.schedule_policy``):
semantic anchors end prefill chunks (paper §3.1).

- ``PrefillAdder.add_one_req`` (around): plans the anchors of a request being admitted
  (``anchors.plan``); when its extend would run past its next anchor cut, the chunk budget
  (``rem_chunk_tokens``) is lowered to end the chunk exactly there, and no later request
  joins that prefill batch (as when SGLang's own chunk budget runs out). An admitted request's
  matched-prefix state is kept as an anchor when its plan says so, and its re-prefilled
  tokens are counted.
- ``PrefillAdder.add_chunked_req`` (around): the same cut for the next chunk of a request
  already being chunked.
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook

COUNTED_ATTR = "_freetoken_anchor_counted"


def _anchors():
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    an = getattr(rt, "anchors", None) if rt is not None else None
    return an if an is not None and an.states is not None else None


def _with_cut(adder, req, plan, run):
    """Run ``run()`` with the chunk budget ending at ``req``'s next anchor cut."""
    from freetoken_sglang.anchors.plan import next_cut

    saved = adder.rem_chunk_tokens
    done = len(req.prefix_indices)
    cut = next_cut(plan.cuts, done)
    if not _anchors().ends_chunks or saved is None or cut is None or cut - done >= saved:
        return run()  # (anchors inside the forward take their states without a cut)
    adder.rem_chunk_tokens = cut - done
    try:
        result = run()
    except BaseException:
        adder.rem_chunk_tokens = saved
        raise
    if not (adder.can_run_list and adder.can_run_list[-1] is req):
        adder.rem_chunk_tokens = saved  # not admitted: the budget is untouched
    return result  # admitted up to the cut: the chunk budget is spent (0)


def add_one_req(original, self, req, *args, **kwargs):
    an = _anchors()
    if an is None:
        return original(self, req, *args, **kwargs)
    prefix_len = len(req.prefix_indices)
    plan = an.plan_for(req, prefix_len)
    result = _with_cut(self, req, plan, lambda: original(self, req, *args, **kwargs))
    if self.can_run_list and self.can_run_list[-1] is req:
        prefix_len = len(req.prefix_indices)
        node = req.best_match_node  # the node whose state the request starts from
        restored = an.states.touch(node)
        if prefix_len in plan.keep and prefix_len > 0 and an.states.depth(node) == prefix_len:
            an.states.keep(node)
        if not getattr(req, COUNTED_ATTR, False):  # a retracted request comes back: once
            setattr(req, COUNTED_ATTR, True)
            an.states.admitted(len(req.full_untruncated_fill_ids) - prefix_len, restored)
    return result


def add_chunked_req(original, self, req, *args, **kwargs):
    from freetoken_sglang.anchors.book import PLAN_ATTR

    an = _anchors()
    plan = getattr(req, PLAN_ATTR, None)
    if an is None or plan is None:
        return original(self, req, *args, **kwargs)
    return _with_cut(self, req, plan, lambda: original(self, req, *args, **kwargs))


HOOKS = [
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req", add_one_req,
         "around"),
    Hook("sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req", add_chunked_req,
         "around"),
]
