"""Hooks into SGLang 0.5.17's scheduler metrics (``sglang.srt.observability.metrics_collector``
and ``sglang.srt.managers.scheduler``): FreeToken's Prometheus series
(``observe/metrics.py``), only with both ``--enable-freetoken`` and ``--enable-metrics``.

- ``managers.scheduler.Scheduler.init_metrics_reporter`` (after; the model, and with it the
  runtime, is loaded by then): on a scheduler that records SGLang's scheduler metrics
  (``metrics_collector_context.current_scheduler_metrics_enabled``), creates the series with
  the ``SchedulerMetricsCollector``'s labels and metric classes, at the runtime's start values.
- ``observability.metrics_collector.SchedulerMetricsCollector.log_stats`` (after): wherever
  SGLang pushes its own scheduler series (each prefill batch report, the decode report every
  ``--decode-log-interval`` steps, and the idle refresh, which runs once traffic stops and
  every 30 s while idle), brings FreeToken's to the ``/freetoken/stats`` document.
- And ``patches/scheduler.py``'s ``Scheduler.get_internal_state`` hook calls
  ``observe.metrics.follow`` with the document it returns, so ``/metrics`` read after
  ``/freetoken/stats`` (or ``Engine.get_server_info()``) shows the same values.
"""

from __future__ import annotations

from freetoken_sglang.patches import Hook


def metrics_reporter_init(result, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    context = getattr(self, "metrics_collector_context", None)
    collector = getattr(self, "metrics_collector", None)
    if (rt is None or context is None or collector is None
            or not context.current_scheduler_metrics_enabled):
        return None
    from freetoken_sglang.observe import metrics

    metrics.start(collector).update(rt.stats())
    return None


def log_stats(result, self, *args, **kwargs):
    from freetoken_sglang.observe.metrics import get_metrics

    m = get_metrics()
    if m is None:
        return None
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is not None:
        m.update(rt.stats())
    return None


HOOKS = [
    Hook("sglang.srt.managers.scheduler.Scheduler.init_metrics_reporter", metrics_reporter_init,
         "after"),
    Hook(
        "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats",
        log_stats,
        "after",
    ),
]
