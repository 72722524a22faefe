"""Resize requests for the GPU expert cache (and miss-policy changes), from ``POST /freetoken/cache`` and ``sglang.Engine`` to the scheduler, over SGLang's ``set_internal_state`` round trip.

The request travels as numeric ``SetInternalStateReq.server_args`` keys (SGLang 0.5.17's
``sglang.srt.managers.io_struct`` accepts numbers only: a policy key's value goes as its
index in ``POLICY_KEYS``' list of values) that only FreeToken's hook on
``Scheduler.set_internal_state`` reads (``patches/scheduler.py``); the scheduler resizes at
that safe point (``FreeTokenRuntime.resize_cache``) and keeps the answer as the stats'
``cache.last_resize``, which the caller then reads back with ``get_internal_state``.
"""

from __future__ import annotations

import math
import random
from typing import Mapping, Optional

from freetoken_sglang.config import RULE_WORDS

KEY_ID = "freetoken_resize_id"
KEY_SLOTS = "freetoken_cache_slots"
KEY_GB = "freetoken_cache_gb"
KEY_POLICY = "freetoken_miss_policy"
KEY_ADMISSION = "freetoken_admission"
KEY_FILL_REUSED = "freetoken_fill_reused"
KEY_RETURN_RULE = "freetoken_return_rule"
KEY_LATE_FILL = "freetoken_late_fill"
KEY_HOST_RATES = "freetoken_host_rates"

# The policy keys of a body, their values, and the server_args key each travels as.
POLICY_KEYS = {
    "miss_policy": (("fill", "qstar", "cpu"), KEY_POLICY),
    "admission": (RULE_WORDS["admission"], KEY_ADMISSION),
    "fill_reused": (RULE_WORDS["fill_reused"], KEY_FILL_REUSED),
    "return_rule": (RULE_WORDS["return_rule"], KEY_RETURN_RULE),
    "late_fill": (RULE_WORDS["late_fill"], KEY_LATE_FILL),
    "host_rates": (RULE_WORDS["host_rates"], KEY_HOST_RATES),
}
BODIES = ('{"gb": G} or {"slots": N}, and/or {"miss_policy": "fill"|"qstar"|"cpu"} '
          'with "admission": "off"|"reuse"|"useful" and/or "fill_reused": "off"|"on"|"valued", '
          'and/or '
          '"return_rule": "off"|"on", "late_fill": "off"|"on"|"all", "host_rates": '
          '"alone"|"beside"')


def parse_body(body) -> dict:
    """``{"slots": N}`` or ``{"gb": G}`` of a request body, and/or a miss policy
    (``"miss_policy"``, ``"admission"``, ``"fill_reused"``, ``"return_rule"``, ``"late_fill"``,
    ``"host_rates"``, the values of the
    ``--freetoken-*`` flags of those names), validated. A body with a policy and no size
    keeps the cache's size.

    Raises:
        ValueError: not an object, unknown keys, both sizes, nothing to do, a size that is
            not a positive number (slots: a whole number), or a policy value not listed.
    """
    if not isinstance(body, Mapping):
        raise ValueError(f"the body must be a JSON object: {BODIES}")
    unknown = sorted(set(body) - {"gb", "slots", *POLICY_KEYS})
    if unknown:
        raise ValueError(f"unknown keys {unknown}: give {BODIES}")
    out = {}
    for key, (values, _) in POLICY_KEYS.items():
        if key in body:
            if body[key] not in values:
                raise ValueError(f'"{key}" must be one of {list(values)}, got {body[key]!r}')
            out[key] = body[key]
    if "gb" in body and "slots" in body:
        raise ValueError('give exactly one of "gb" and "slots"')
    if "gb" not in body and "slots" not in body:
        if not out:
            raise ValueError(f"nothing to do: give {BODIES}")
        return out
    if "slots" in body:
        n = body["slots"]
        if isinstance(n, float) and math.isfinite(n) and n.is_integer():
            n = int(n)  # (JSON parsers read very large integers as floats)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f'"slots" must be a positive whole number, got {n!r}')
        return {"slots": n, **out}
    g = body["gb"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
        raise ValueError(f'"gb" must be a positive number of GiB, got {g!r}')
    return {"gb": float(g), **out}


def to_args(request: Mapping) -> dict:
    """``parse_body``'s dict as numeric ``server_args`` (without the id)."""
    args = {}
    if "slots" in request:
        args[KEY_SLOTS] = int(request["slots"])
    if "gb" in request:
        args[KEY_GB] = float(request["gb"])
    for key, (values, arg) in POLICY_KEYS.items():
        if request.get(key) is not None:
            args[arg] = values.index(request[key])
    return args


def from_args(args: Mapping) -> dict:
    """The request of ``server_args`` (``to_args``' inverse), validated by ``parse_body``.

    Raises:
        ValueError: keys that are not a FreeToken request's, or bad values.
    """
    unknown = sorted(set(args) - {KEY_ID, KEY_SLOTS, KEY_GB,
                                  *(arg for _, arg in POLICY_KEYS.values())})
    if unknown:
        raise ValueError(f"a FreeToken resize carries only its size and policy, got {unknown} "
                         "too")
    body = {k: args[key] for k, key in (("slots", KEY_SLOTS), ("gb", KEY_GB)) if key in args}
    for key, (values, arg) in POLICY_KEYS.items():
        if arg in args:
            i = args[arg]
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(values):
                raise ValueError(f"{arg} must be an index into {list(values)}, got {i!r}")
            body[key] = values[i]
    return parse_body(body)


ANSWERS_KEPT = 16  # answers the scheduler keeps for their callers, by request id


def serve(rt, args: Mapping) -> dict:
    """Scheduler side: carry out the request in ``args`` (``set_internal_state``'s
    ``server_args``) on the runtime ``rt``; the answer is kept under its id in
    ``rt.resize_answers`` (the last few) and as ``rt.last_resize``."""
    rid = int(args[KEY_ID])
    if rt is None:
        return {"id": rid, "ok": False, "error": "FreeToken is not serving"}
    try:
        report = rt.resize_cache(**from_args(args))
        answer = {"id": rid, "ok": True, **report.as_dict()}
    except (ValueError, TypeError, OverflowError) as e:
        answer = {"id": rid, "ok": False, "error": str(e)}
    rt.last_resize = answer
    rt.resize_answers[rid] = answer
    while len(rt.resize_answers) > ANSWERS_KEPT:
        rt.resize_answers.pop(next(iter(rt.resize_answers)))
    return answer


async def request_resize(tokenizer_manager, **request) -> dict:
    """Send one resize (``parse_body``'s dict) to the scheduler and return its answer
    (``serve``'s dict: ``ok``, and the ``ResizeReport`` fields or ``error``)."""
    from sglang.srt.managers.io_struct import SetInternalStateReq

    rid = random.randrange(1, 2**31)
    args = {KEY_ID: rid, **to_args(request)}
    await tokenizer_manager.set_internal_state(SetInternalStateReq(server_args=args))
    states = await tokenizer_manager.get_internal_state()
    for state in states:
        doc = state.get("freetoken") if isinstance(state, dict) else None
        answer = ((doc or {}).get("cache") or {}).get("resize_answers", {}).get(str(rid))
        if answer:
            return answer
    return {"id": rid, "ok": False, "error": "FreeToken is not serving (no answer from the "
            "scheduler)"}


def resize_cache(engine, slots: Optional[int] = None, gb: Optional[float] = None,
                 miss_policy: Optional[str] = None, admission: Optional[str] = None,
                 fill_reused: Optional[str] = None,
                 return_rule: Optional[str] = None,
                 late_fill: Optional[str] = None,
                 host_rates: Optional[str] = None) -> dict:
    """Resize the GPU expert cache of an ``sglang.Engine(..., enable_freetoken=True)``, or
    change its miss policy, as ``POST /freetoken/cache`` does: at most one of ``slots`` and
    ``gb`` (GiB); ``miss_policy`` (``fill``, ``qstar``, ``cpu``) with ``admission``
    (``off``, ``reuse``, ``useful``) and/or ``fill_reused`` (``off``, ``on``, ``valued``), and
    ``return_rule`` (``off``, ``on``) or ``late_fill`` (``off``, ``on``, ``all``), and
    ``host_rates`` (``alone``, ``beside``), as the flags of those names.

    Returns:
        The ``ResizeReport`` fields (old and new slots and bytes, experts kept and dropped,
        the new layout, CUDA graphs captured again, seconds, the miss policy).

    Raises:
        ValueError: a bad size or policy, or the scheduler refused it (the message says why).
    """
    given = (("slots", slots), ("gb", gb), ("miss_policy", miss_policy),
             ("admission", admission), ("fill_reused", fill_reused),
             ("return_rule", return_rule), ("late_fill", late_fill),
             ("host_rates", host_rates))
    request = parse_body({k: v for k, v in given if v is not None})
    answer = engine.loop.run_until_complete(
        request_resize(engine.tokenizer_manager, **request))
    if not answer.get("ok"):
        raise ValueError(f"FreeToken cache resize refused: {answer.get('error')}")
    return answer
