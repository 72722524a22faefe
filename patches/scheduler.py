"""Hooks into SGLang 0.5.17's scheduler (``sglang.srt.managers``): the FreeToken counters.

- ``scheduler.Scheduler.get_internal_state`` (after): adds the runtime's stats under
  ``"freetoken"``, which is how ``GET /freetoken/stats`` and ``Engine.get_server_info()``
  reach the scheduler process.
- ``scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats``
  (after): on the steps SGLang logs decode stats, logs the cache's hit rate and counts.
"""

from __future__ import annotations

import logging

from freetoken_sglang.patches import Hook

logger = logging.getLogger(__name__)


def get_internal_state(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    state = getattr(result, "internal_state", None)  # GetInternalStateReqOutput
    if rt is not None and isinstance(state, dict):
        state["freetoken"] = rt.stats()
    return result


def report_decode_stats(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or rt.counters is None:
        return None
    if self.forward_ct_decode % self.decode_log_interval != 0:
        return None
    if getattr(self, "is_stats_logging_rank", True):
        logger.info(rt.counters.log_line())
    return None


HOOKS = [
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
