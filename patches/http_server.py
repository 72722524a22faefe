"""Hooks into SGLang 0.5.17's HTTP server (``sglang.srt.entrypoints.http_server``).

- ``http_server.launch_server`` (before): adds ``GET /freetoken/stats`` to SGLang's FastAPI
  ``app`` when the server runs with ``--enable-freetoken``. The route reads the scheduler's
  counters through SGLang's own ``get_internal_state`` round trip; and ``POST
  /freetoken/cache``, a resize of the GPU expert cache (``freetoken_sglang.control``).
"""

from __future__ import annotations

from fastapi import Request
from sglang.srt.utils.auth import AuthLevel, auth_level

from freetoken_sglang.patches import Hook

ROUTE = "/freetoken/stats"
CACHE_ROUTE = "/freetoken/cache"


async def freetoken_stats():
    """JSON: per MoE layer and in total, routed expert reads, hits, fills and evictions,
    plus the pool and cache sizes (one entry per data-parallel rank under ``ranks``)."""
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints import http_server

    states = await http_server.get_global_state().tokenizer_manager.get_internal_state()
    ranks = [s.get("freetoken") for s in states if isinstance(s, dict)]
    ranks = [r for r in ranks if r is not None]
    if not ranks:
        return JSONResponse({"error": "FreeToken is not serving"}, status_code=404)
    body = dict(ranks[0])
    body["ranks"] = ranks
    return JSONResponse(body)


@auth_level(AuthLevel.ADMIN_OPTIONAL)  # as SGLang's own /set_internal_state
async def freetoken_cache(request: Request):
    """``POST /freetoken/cache`` with ``{"gb": G}`` or ``{"slots": N}``: resize the GPU
    expert cache at the scheduler's next safe point; with ``"miss_policy"`` (``"admission"``,
    ``"fill_reused"``, ``"return_rule"``, ``"late_fill"``, ``"host_rates"``), change the decode
    miss policy there too
    (``control.parse_body``).
    200 with the ``ResizeReport`` fields; 400 with ``error`` for a bad body, or a size or
    policy the scheduler refused (404: FreeToken is not serving). SGLang's admin auth level (``--admin-api-key``), as ``/set_internal_state``."""
    from fastapi.responses import JSONResponse
    from sglang.srt.entrypoints import http_server

    from freetoken_sglang import control

    try:
        body = await request.json()
    except ValueError as e:  # (json.JSONDecodeError, an empty body)
        return JSONResponse({"ok": False, "error": f"the body is not JSON ({e}): send "
                             f"{control.BODIES}"}, status_code=400)
    try:
        parsed = control.parse_body(body)
    except ValueError as e:
        return JSONResponse({"ok": False, "error": str(e)}, status_code=400)
    answer = await control.request_resize(
        http_server.get_global_state().tokenizer_manager, **parsed)
    if answer.get("ok"):
        return JSONResponse(answer)
    return JSONResponse(answer, status_code=404 if "not serving" in answer["error"] else 400)


def launch_server(server_args, *args, **kwargs):
    from freetoken_sglang.runtime import config_of
    from sglang.srt.entrypoints.http_server import app

    if config_of(server_args) is None:
        return None
    if not any(getattr(r, "path", None) == ROUTE for r in app.routes):
        app.add_api_route(ROUTE, freetoken_stats, methods=["GET"])
    if not any(getattr(r, "path", None) == CACHE_ROUTE for r in app.routes):
        app.add_api_route(CACHE_ROUTE, freetoken_cache, methods=["POST"])
    return None


HOOKS = [
    Hook("sglang.srt.entrypoints.http_server.launch_server", launch_server, "before"),
]
