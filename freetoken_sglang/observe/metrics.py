"""FreeToken's Prometheus series, through SGLang's own metrics machinery (``--enable-metrics``).

SGLang 0.5.17's scheduler process writes its series with ``prometheus_client`` in
multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the launcher) and the HTTP server
process serves ``/metrics`` from that directory. The series here are created the same way, in
the scheduler process, with the labels of SGLang's ``SchedulerMetricsCollector``
(``model_name``, ``engine_type``, ``tp_rank``, ``pp_rank``, ``moe_ep_rank``, and ``dp_rank``,
``priority`` or ``--extra-metric-labels`` where SGLang adds them), plus ``phase`` where the
stats split by phase. They are read off the ``/freetoken/stats`` document itself
(``observe/document.py``), so a series never disagrees with it:

counters (monotonic totals; each update adds the document's increase since the last one):

- ``sglang:freetoken_expert_reads_total{phase}``, ``..._hits_total``, ``..._fills_total``,
  ``..._evictions_total``, ``sglang:freetoken_expert_cpu_executed_total{phase}``: the LRU
  counters of ``decode`` and ``prefill`` (``stats[phase][field]``);
- ``sglang:freetoken_streamed_experts_total``, ``sglang:freetoken_streamed_bytes_total``:
  ``stats["prefill_stream"]["experts_streamed"]`` and ``["bytes_streamed"]``;
- ``sglang:freetoken_anchor_restores_total``: ``stats["anchors"]["restores"]`` (hybrid models
  with anchors on only);
- ``sglang:freetoken_cache_resizes_total``: a ``resizes`` counter of the document (top level
  or under ``cache``), only where the document has one (none today: resizing is not built);

gauges (``multiprocess_mode="mostrecent"``, as SGLang's own):

- ``sglang:freetoken_cache_slots``, ``sglang:freetoken_cache_lru_slots``,
  ``sglang:freetoken_cache_bytes``: ``stats["cache"]``;
- ``sglang:freetoken_expert_hit_rate{phase="total"|"decode"|"prefill"}``: ``stats[phase]
  ["hit_rate"]``, NaN while the phase has no reads.

Prometheus counters never go down: if the runtime's counters are zeroed while serving
(nothing does that after start-up today), the series go on from their value and add the new
totals, so they then exceed the document by what was counted before the reset.
"""

from __future__ import annotations

import math
import threading
from typing import Dict, Mapping, Optional, Tuple

from freetoken_sglang.observe.counters import FIELDS, PHASES

PREFIX = "sglang:freetoken_"

# (stats field, metric name without prefix, documentation) of the per-phase LRU counters.
EXPERT_COUNTERS = (
    ("reads", "expert_reads", "Routed expert reads (unique experts per MoE layer call) "
     "through the expert cache's LRU."),
    ("hits", "expert_hits", "Routed expert reads already resident in the expert cache."),
    ("fills", "expert_fills", "Routed experts copied from the host pool into the expert cache "
     "before their layer call computed (late fills are counted as cpu)."),
    ("evictions", "expert_evictions", "Expert-cache fills, late fills included, that displaced "
     "a resident expert."),
    ("cpu", "expert_cpu_executed", "Missed routed experts run in place on the CPU (late "
     "fills included: they run on the CPU, then are copied in)."),
)
assert tuple(f for f, _, _ in EXPERT_COUNTERS) == FIELDS

HIT_RATE_PHASES = ("total",) + PHASES


def _resizes(doc: Mapping) -> Optional[float]:
    """The document's ``resizes`` counter (top level or under ``cache``), if it has one."""
    value = doc.get("resizes")
    if value is None and isinstance(doc.get("cache"), Mapping):
        value = doc["cache"].get("resizes")
    return value if isinstance(value, (int, float)) else None


def _restores(doc: Mapping) -> Optional[float]:
    anchors = doc.get("anchors")
    if isinstance(anchors, Mapping) and isinstance(anchors.get("restores"), (int, float)):
        return anchors["restores"]
    return None


def counter_values(doc: Mapping) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """``{(name, extra labels): total}`` of every counter series the document ``doc`` (a
    ``/freetoken/stats`` document) carries; names are without the ``_total`` suffix."""
    out: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
    for phase in PHASES:
        counts = doc.get(phase)
        if not isinstance(counts, Mapping):
            continue
        for field, name, _ in EXPERT_COUNTERS:
            out[(PREFIX + name, (("phase", phase),))] = counts[field]
    stream = doc.get("prefill_stream")
    if isinstance(stream, Mapping):
        out[(PREFIX + "streamed_experts", ())] = stream["experts_streamed"]
        out[(PREFIX + "streamed_bytes", ())] = stream["bytes_streamed"]
    restores = _restores(doc)
    if restores is not None:
        out[(PREFIX + "anchor_restores", ())] = restores
    resizes = _resizes(doc)
    if resizes is not None:
        out[(PREFIX + "cache_resizes", ())] = resizes
    return out


def gauge_values(doc: Mapping) -> Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float]:
    """``{(name, extra labels): value}`` of every gauge series of the document ``doc``."""
    out: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
    cache = doc.get("cache")
    if isinstance(cache, Mapping):
        out[(PREFIX + "cache_slots", ())] = cache["slots"]
        out[(PREFIX + "cache_lru_slots", ())] = cache["lru_slots"]
        out[(PREFIX + "cache_bytes", ())] = cache["bytes"]
    for phase in HIT_RATE_PHASES:
        counts = doc.get(phase)
        if isinstance(counts, Mapping):
            rate = counts.get("hit_rate")
            out[(PREFIX + "expert_hit_rate", (("phase", phase),))] = (
                math.nan if rate is None else rate
            )
    return out


_DOCS = {
    PREFIX + "streamed_experts": "Routed experts sent over PCIe by streamed (and wave) prefill.",
    PREFIX + "streamed_bytes": "Bytes of routed experts sent over PCIe by streamed (and wave) "
    "prefill.",
    PREFIX + "anchor_restores": "Admitted requests that started from a semantic-anchor "
    "recurrent state.",
    PREFIX + "cache_resizes": "Resizes of the GPU expert cache.",
    PREFIX + "cache_slots": "Slots of the GPU expert cache (one slot holds one (layer, expert)).",
    PREFIX + "cache_lru_slots": "Slots of the GPU expert cache managed by the decode LRU.",
    PREFIX + "cache_bytes": "Bytes of the GPU expert cache.",
    PREFIX + "expert_hit_rate": "Expert-cache hit rate since start (hits / reads; NaN "
    "without reads).",
    **{PREFIX + name: doc for _, name, doc in EXPERT_COUNTERS},
}


class FreeTokenMetrics:
    """The FreeToken series of one scheduler process, with SGLang's scheduler ``labels``.

    Args:
        labels: the ``labels`` of SGLang's ``SchedulerMetricsCollector``.
        counter_cls, gauge_cls: the collector's metric classes (``prometheus_client``'s, or
            the ones a ``--stat-loggers`` collector substitutes, e.g. Ray's).
    """

    def __init__(self, labels: Mapping[str, object], counter_cls=None, gauge_cls=None):
        # prometheus_client is imported here, after SGLang set PROMETHEUS_MULTIPROC_DIR.
        from prometheus_client import Counter, Gauge

        self._counter_cls = counter_cls or Counter
        self._gauge_cls = gauge_cls or Gauge
        self.labels = {k: str(v) for k, v in labels.items()}
        self._metrics: Dict[str, object] = {}
        self._last: Dict[Tuple[str, Tuple[Tuple[str, str], ...]], float] = {}
        self._lock = threading.Lock()
        self.updates = 0

    def _metric(self, name: str, extra: Tuple[Tuple[str, str], ...], counter: bool):
        m = self._metrics.get(name)
        if m is None:
            labelnames = [*self.labels, *(k for k, _ in extra)]
            if counter:
                m = self._counter_cls(name=name, documentation=_DOCS[name],
                                      labelnames=labelnames)
            else:
                m = self._gauge_cls(name=name, documentation=_DOCS[name],
                                    labelnames=labelnames, multiprocess_mode="mostrecent")
            self._metrics[name] = m
        return m.labels(**self.labels, **dict(extra))

    def update(self, doc: Mapping) -> None:
        """Bring every series to the ``/freetoken/stats`` document ``doc``: counters by the
        increase of the document's totals since the previous update, gauges set."""
        with self._lock:
            for key, total in counter_values(doc).items():
                child = self._metric(*key, counter=True)
                last = self._last.get(key, 0)
                delta = total - last if total >= last else total  # the runtime reset
                if delta > 0:
                    child.inc(delta)
                self._last[key] = total
            for key, value in gauge_values(doc).items():
                self._metric(*key, counter=False).set(value)
            self.updates += 1


_METRICS: Optional[FreeTokenMetrics] = None


def get_metrics() -> Optional[FreeTokenMetrics]:
    """This process's FreeToken series, or None (FreeToken or ``--enable-metrics`` off, or
    not a rank that records SGLang's scheduler metrics)."""
    return _METRICS


def start(collector) -> FreeTokenMetrics:
    """The FreeToken series for SGLang's ``SchedulerMetricsCollector`` ``collector``, created
    once per process (``prometheus_client`` refuses a name registered twice)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = FreeTokenMetrics(
            collector.labels,
            counter_cls=getattr(collector, "_counter_cls", None),
            gauge_cls=getattr(collector, "_gauge_cls", None),
        )
    return _METRICS


def follow(doc: Mapping) -> None:
    """Bring this process's series (if any) to the ``/freetoken/stats`` document ``doc``."""
    if _METRICS is not None:
        _METRICS.update(doc)
