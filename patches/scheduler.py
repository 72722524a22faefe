"""Hooks into SGLang 0.5.17's scheduler (``sglang.srt.managers``): the FreeToken counters.

- ``scheduler.Scheduler.get_internal_state`` (after): adds the runtime's stats under
  ``"freetoken"``, which is how ``GET /freetoken/stats`` and ``Engine.get_server_info()``
  reach the scheduler process; with ``--enable-metrics`` the Prometheus series then follow
  that document (``observe.metrics.follow``, ``patches/metrics.py``).
- ``scheduler.Scheduler.__init__`` (around): gives the semantic anchors (hybrid models) the
  scheduler's radix cache and sizes their state budget from its mamba pool
  (``anchors.book.Anchors.attach``) and records the free device memory SGLang starts
  serving with (``FreeTokenRuntime.note_serving_start``); a FreeToken refusal while the
  scheduler builds ends the process with its one-line message for the launcher
  (``freetoken_sglang.errors``), no traceback.
- ``scheduler.Scheduler.run_batch`` (around): an extend whose anchors take their states
  inside the forward reserves their mamba slots first (``anchors.inside.reserve``).
- ``scheduler.Scheduler.set_internal_state`` (around): serves a GPU expert cache resize
  (``freetoken_sglang.control``: ``POST /freetoken/cache``, ``control.resize_cache(engine)``)
  at this safe point between batches; other requests go to SGLang.
- ``scheduler.Scheduler.process_input_requests`` (after): ``--freetoken-min-free-gb``'s
  free-memory watch (``FreeTokenRuntime.watch_free_memory``), once a second at most.
- ``scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats``
  (after): on the steps SGLang logs decode stats, logs the cache's hit rate and counts.
"""

from __future__ import annotations

import logging
import os

from freetoken_sglang.errors import RefusedError
from freetoken_sglang.patches import Hook

logger = logging.getLogger(__name__)


def get_internal_state(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    state = getattr(result, "internal_state", None)  # GetInternalStateReqOutput
    if rt is not None and isinstance(state, dict):
        state["freetoken"] = rt.stats()
        # --- Prometheus (--enable-metrics): /metrics follows the document just read
        from freetoken_sglang.observe.metrics import follow

        follow(state["freetoken"])
        # --- (observe/metrics.py, patches/metrics.py)
    return result


def scheduler_init(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        rt.note_serving_start()  # the free memory a resize leaves SGLang's runtime
    an = getattr(rt, "anchors", None) if rt is not None else None
    if an is None:
        return None
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    cache = self.tree_cache
    pool = getattr(self.req_to_token_pool, "mamba_pool", None)
    if not isinstance(cache, UnifiedRadixCache) or pool is None:
        raise RefusedError(
            f"--enable-freetoken: semantic anchors need SGLang's hybrid radix cache "
            f"(UnifiedRadixCache with a mamba pool), got {type(cache).__name__}; pass "
            "--freetoken-anchors off"
        )
    strategy = self.server_args.mamba_radix_cache_strategy
    if strategy != "no_buffer":
        raise RefusedError(
            f"--enable-freetoken: semantic anchors need --mamba-radix-cache-strategy "
            f"no_buffer (a state at each chunk end), the server resolved {strategy}: pass "
            "--mamba-radix-cache-strategy no_buffer --disable-overlap-schedule, or "
            "--freetoken-anchors off"
        )
    an.attach(cache, pool.size, self.max_running_requests, int(self.max_total_num_tokens),
              experts_on_gpu=rt.experts_on_gpu,
              linear_layers=len(self.req_to_token_pool.mamba_map))
    return None


def scheduler_init_refusal(original, self, server_args, *args, **kwargs):
    """A FreeToken refusal while the scheduler builds (model, format, cache size) ends this
    process with the message left for the launcher (``patches/engine.py``), not SGLang's
    traceback and SIGQUIT (kept with ``--log-level debug``)."""
    from freetoken_sglang import errors

    try:
        original(self, server_args, *args, **kwargs)
        scheduler_init(None, self)
    except errors.RefusedError as e:
        if (getattr(server_args, "freetoken", None) is None
                or getattr(server_args, "log_level", None) == "debug"):
            raise
        errors.leave_note(str(e))  # the launcher prints it, once
        logging.shutdown()
        os._exit(errors.EXIT_REFUSED)


def run_batch(original, self, batch, *args, **kwargs):
    """Reserve the anchor states an extend takes inside its forward (``anchors.inside``) for
    the gated-DeltaNet hook (``patches/gdn_backend.py``) while the forward runs."""
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    an = getattr(rt, "anchors", None) if rt is not None else None
    mode = batch.forward_mode if batch is not None else None
    if (an is None or an.states is None or an.mode != "inside" or mode is None
            or not mode.is_extend() or mode.is_target_verify()):
        return original(self, batch, *args, **kwargs)
    from freetoken_sglang.anchors import inside

    rt.anchor_snaps = inside.reserve(batch, self.req_to_token_pool, self.tree_cache, an)
    try:
        return original(self, batch, *args, **kwargs)
    finally:
        rt.anchor_snaps = None


def set_internal_state(original, self, recv_req, *args, **kwargs):
    """A FreeToken cache resize (``freetoken_sglang.control``) is served here, at the
    scheduler's safe point between batches; every other request goes to SGLang."""
    from freetoken_sglang import control

    server_args = getattr(recv_req, "server_args", None)
    ours = isinstance(server_args, dict) and any(k.startswith("freetoken_") for k in server_args)
    if not ours:
        return original(self, recv_req, *args, **kwargs)
    if control.KEY_ID not in server_args:  # e.g. SGLang's own /set_internal_state
        logger.warning("FreeToken: a cache resize goes through POST /freetoken/cache or "
                       "freetoken_sglang.resize_cache, not /set_internal_state: refused")
        from sglang.srt.managers.io_struct import SetInternalStateReqOutput

        return SetInternalStateReqOutput(updated=False)
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    from freetoken_sglang.runtime import get_runtime

    answer = control.serve(get_runtime(), server_args)
    return SetInternalStateReqOutput(updated=bool(answer["ok"]))


def process_input_requests(result, self, *args, **kwargs):
    """``--freetoken-min-free-gb``: the free-memory watch runs at this safe point of every
    scheduler loop iteration (at most once a second)."""
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None and rt.config.min_free_gb is not None:
        rt.watch_free_memory()
    return None


def report_decode_stats(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.counters is None:
        return None
    if self.forward_ct_decode % self.decode_log_interval != 0:
        return None
    if getattr(self, "is_stats_logging_rank", True):
        logger.info(rt.counters.log_line(rt.cache is not None and rt.cache.all_resident))
    return None


HOOKS = [
    Hook("sglang.srt.managers.scheduler.Scheduler.__init__", scheduler_init_refusal, "around"),
    Hook("sglang.srt.managers.scheduler.Scheduler.run_batch", run_batch, "around"),
    Hook("sglang.srt.managers.scheduler.Scheduler.set_internal_state", set_internal_state,
         "around"),
    Hook("sglang.srt.managers.scheduler.Scheduler.process_input_requests",
         process_input_requests, "after"),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        get_internal_state,
        "after",
    ),
    Hook(
        "sglang.srt.managers.scheduler_components.metrics_reporter."
        "SchedulerMetricsReporter.report_decode_stats",
        report_decode_stats,
        "after",
    ),
]
