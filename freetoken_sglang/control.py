"""Resize requests for the GPU expert cache, from ``POST /freetoken/cache`` and ``sglang.Engine`` to the scheduler, over SGLang's ``set_internal_state`` round trip.

The request travels as numeric ``SetInternalStateReq.server_args`` keys (SGLang 0.5.17's
``sglang.srt.managers.io_struct``) that only FreeToken's hook on
``Scheduler.set_internal_state`` reads (``patches/scheduler.py``); the scheduler resizes at
that safe point (``FreeTokenRuntime.resize_cache``) and keeps the answer as the stats'
``cache.last_resize``, which the caller then reads back with ``get_internal_state``.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Optional

KEY_ID = "freetoken_resize_id"
KEY_SLOTS = "freetoken_cache_slots"
KEY_GB = "freetoken_cache_gb"


def parse_body(body) -> dict:
    """``{"slots": N}`` or ``{"gb": G}`` of a request body, validated.

    Raises:
        ValueError: not an object, unknown keys, both or neither size, or a size that is not
            a positive number (slots: a whole number).
    """
    if not isinstance(body, Mapping):
        raise ValueError('the body must be a JSON object: {"gb": G} or {"slots": N}')
    unknown = sorted(set(body) - {"gb", "slots"})
    if unknown:
        raise ValueError(f'unknown keys {unknown}: give {{"gb": G}} or {{"slots": N}}')
    if ("gb" in body) == ("slots" in body):
        raise ValueError('give exactly one of "gb" and "slots"')
    if "slots" in body:
        n = body["slots"]
        if isinstance(n, float) and math.isfinite(n) and n.is_integer():
            n = int(n)  # (JSON parsers read very large integers as floats)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f'"slots" must be a positive whole number, got {n!r}')
        return {"slots": n}
    g = body["gb"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
        raise ValueError(f'"gb" must be a positive number of GiB, got {g!r}')
    return {"gb": float(g)}


ANSWERS_KEPT = 16  # answers the scheduler keeps for their callers, by request id


def serve(rt, args: Mapping) -> dict:
    """Scheduler side: carry out the request in ``args`` (``set_internal_state``'s
    ``server_args``) on the runtime ``rt``; the answer is kept under its id in
    ``rt.resize_answers`` (the last few) and as ``rt.last_resize``."""
    rid = int(args[KEY_ID])
    unknown = sorted(set(args) - {KEY_ID, KEY_SLOTS, KEY_GB})
    if rt is None:
        return {"id": rid, "ok": False, "error": "FreeToken is not serving"}
    try:
        if unknown:
            raise ValueError(f"a FreeToken resize carries only its size, got {unknown} too")
        size = parse_body({k: args[key] for k, key in (("slots", KEY_SLOTS), ("gb", KEY_GB))
                           if key in args})
        report = rt.resize_cache(**size)
        answer = {"id": rid, "ok": True, **report.as_dict()}
    except (ValueError, TypeError, OverflowError) as e:
        answer = {"id": rid, "ok": False, "error": str(e)}
    rt.last_resize = answer
    rt.resize_answers[rid] = answer
    while len(rt.resize_answers) > ANSWERS_KEPT:
        rt.resize_answers.pop(next(iter(rt.resize_answers)))
    return answer


async def request_resize(tokenizer_manager, slots: Optional[int] = None,
                         gb: Optional[float] = None) -> dict:
    """Send one resize to the scheduler and return its answer (``serve``'s dict: ``ok``, and
    the ``ResizeReport`` fields or ``error``)."""
    from sglang.srt.managers.io_struct import SetInternalStateReq

    rid = random.randrange(1, 2**31)
    args = {KEY_ID: rid, **({KEY_SLOTS: int(slots)} if slots is not None else {KEY_GB: gb})}
    await tokenizer_manager.set_internal_state(SetInternalStateReq(server_args=args))
    states = await tokenizer_manager.get_internal_state()
    for state in states:
        doc = state.get("freetoken") if isinstance(state, dict) else None
        answer = ((doc or {}).get("cache") or {}).get("resize_answers", {}).get(str(rid))
        if answer:
            return answer
    return {"id": rid, "ok": False, "error": "FreeToken is not serving (no answer from the "
            "scheduler)"}


def resize_cache(engine, slots: Optional[int] = None, gb: Optional[float] = None) -> dict:
    """Resize the GPU expert cache of an ``sglang.Engine(..., enable_freetoken=True)``, as
    ``POST /freetoken/cache`` does: exactly one of ``slots`` and ``gb`` (GiB).

    Returns:
        The ``ResizeReport`` fields (old and new slots and bytes, experts kept and dropped,
        the new layout, CUDA graphs captured again, seconds).

    Raises:
        ValueError: a bad size, or the scheduler refused it (the message says why).
    """
    size = parse_body({k: v for k, v in (("slots", slots), ("gb", gb)) if v is not None})
    answer = engine.loop.run_until_complete(
        request_resize(engine.tokenizer_manager, **size))
    if not answer.get("ok"):
        raise ValueError(f"FreeToken cache resize refused: {answer.get('error')}")
    return answer
