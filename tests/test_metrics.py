"""FreeToken's Prometheus series (``observe/metrics.py``, ``patches/metrics.py``): with
``--enable-metrics``, SGLang's ``/metrics`` carries them with SGLang's own scheduler labels, and
their values are those of ``/freetoken/stats``."""

from __future__ import annotations

import functools
import math

import requests
import torch

from freetoken_sglang.observe.metrics import PREFIX, FreeTokenMetrics, counter_values, gauge_values


def _doc(reads=0, hits=0, fills=0, evictions=0, cpu=0, streamed=0, restores=None):
    def phase(scale):
        r = reads * scale
        return dict(reads=r, hits=hits * scale, fills=fills * scale,
                    evictions=evictions * scale, cpu=cpu * scale,
                    hit_rate=hits * scale / r if r else None)

    doc = {"decode": phase(1), "prefill": phase(2), "total": phase(3),
           "cache": {"slots": 40, "lru_slots": 40, "bytes": 4096},
           "prefill_stream": {"experts_streamed": streamed, "bytes_streamed": 64 * streamed},
           "anchors": None}
    if restores is not None:
        doc["anchors"] = {"restores": restores}
    return doc


def _samples(text: str) -> dict:
    """``{(sample name, labels): value}`` of the FreeToken samples of a Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # (``_created``: not in multiprocess mode, as SGLang serves them)
            if s.name.startswith(PREFIX) and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _expected(doc, labels) -> dict:
    """The samples ``doc`` should give: counters ``<name>_total``, gauges ``<name>``."""
    base = tuple(sorted((k, str(v)) for k, v in labels.items()))
    out = {}
    for suffix, values in (("_total", counter_values(doc)), ("", gauge_values(doc))):
        for (name, extra), value in values.items():
            out[(name + suffix, tuple(sorted(base + extra)))] = float(value)
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
    )


def test_series_follow_the_document_by_deltas():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    registry = CollectorRegistry()
    labels = {"model_name": "m", "tp_rank": 0}
    m = FreeTokenMetrics(labels, functools.partial(Counter, registry=registry),
                         functools.partial(Gauge, registry=registry))
    for doc in (_doc(), _doc(reads=10, hits=4, fills=6, evictions=2, streamed=3, restores=1),
                _doc(reads=10, hits=4, fills=6, evictions=2, streamed=3, restores=1),
                _doc(reads=25, hits=12, fills=11, evictions=9, cpu=2, streamed=8, restores=4)):
        m.update(doc)
        got = _samples(generate_latest(registry).decode())
        assert _same(got, _expected(doc, labels)), (got, _expected(doc, labels))
    assert got[(PREFIX + "expert_reads_total", (("model_name", "m"), ("phase", "prefill"),
                                                 ("tp_rank", "0")))] == 50
    assert (PREFIX + "cache_resizes_total", (("model_name", "m"), ("tp_rank", "0"))) not in got
    # A document with a ``resizes`` counter gets its series; the runtime's counters zeroed:
    # the series go on (Prometheus counters never go down) by the new totals.
    doc = _doc(reads=5, hits=5)
    doc["cache"]["resizes"] = 2
    m.update(doc)
    got = _samples(generate_latest(registry).decode())
    assert got[(PREFIX + "cache_resizes_total", (("model_name", "m"), ("tp_rank", "0")))] == 2
    assert got[(PREFIX + "expert_reads_total", (("model_name", "m"), ("phase", "decode"),
                                                 ("tp_rank", "0")))] == 25 + 5


def test_metrics_carry_the_freetoken_stats(tiny_checkpoint, tmp_path):
    from sglang_cpu import start_server

    path = tiny_checkpoint("qwen3_moe", num_layers=10, num_experts=16, top_k=4)
    server = start_server(
        path,
        ["--enable-freetoken", "--freetoken-cache-ratio", "0.25", "--enable-metrics",
         # every decode step reports its stats (and so pushes the series), so the series
         # are current once the requests are done, before /freetoken/stats is read
         "--decode-log-interval", "1",
         # a 90-token prefill goes through the LRU (its "prefill" phase), a 150-token one
         # streams
         "--freetoken-stream-min-tokens", "100"],
        log_path=str(tmp_path / "server.log"),
    )
    try:
        before = _samples(requests.get(server.url + "/metrics", timeout=60).text)
        for prompt, n in (([5, 6, 7, 8], 8), (list(range(40, 130)), 6),
                          (list(range(200, 350)), 4), ([9, 10, 11], 5)):
            r = requests.post(
                server.url + "/generate",
                json={"input_ids": prompt,
                      "sampling_params": {"max_new_tokens": n, "temperature": 0.0,
                                          "ignore_eos": True}},
                timeout=300,
            )
            r.raise_for_status()
        import time

        time.sleep(2.0)  # the last step's report follows its output to the client
        pushed_text = requests.get(server.url + "/metrics", timeout=60).text
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
        read_text = requests.get(server.url + "/metrics", timeout=60).text
    finally:
        server.stop()

    # SGLang's own scheduler labels, read off one of its own series.
    from prometheus_client.parser import text_string_to_metric_families

    labels = next(
        s.labels for f in text_string_to_metric_families(read_text)
        for s in f.samples if s.name == "sglang:num_running_reqs"
    )
    assert {"model_name", "tp_rank", "pp_rank", "engine_type", "moe_ep_rank"} <= labels.keys()

    expected = _expected(stats, labels)
    names = {name for name, _ in expected}
    assert names == {PREFIX + n for n in (
        "expert_reads_total", "expert_hits_total", "expert_fills_total",
        "expert_evictions_total", "expert_cpu_executed_total", "streamed_experts_total",
        "streamed_bytes_total", "cache_slots", "cache_lru_slots", "cache_bytes",
        "expert_hit_rate", "cache_resizes_total")}  # no anchors (not hybrid)
    # the series exist before the requests (SGLang's /health probes have run a request or
    # two by then), and the counters only grew since
    assert before.keys() == expected.keys()
    assert all(v <= expected[k] for k, v in before.items() if k[0].endswith("_total"))
    # traffic went through both phases and streamed prefill
    assert stats["decode"]["reads"] > 0 and stats["prefill"]["reads"] > 0
    assert stats["prefill_stream"]["bytes_streamed"] > 0

    read = _samples(read_text)
    assert _same(read, expected), {k: (read.get(k), v) for k, v in expected.items()
                                   if read.get(k) != v}
    # the values SGLang's own push (its scheduler reports) left, before the stats were read
    pushed = _samples(pushed_text)
    assert _same(pushed, expected), {k: (pushed.get(k), v) for k, v in expected.items()
                                     if pushed.get(k) != v}


def test_decode_log_line_windows():
    from freetoken_sglang.observe.counters import ExpertCounters

    c = ExpertCounters([1, 3], "cpu")
    c.of_phase("decode")[:, 0] += torch.tensor([8, 6, 2, 1, 0])  # reads hits fills evictions cpu
    first = c.log_line()
    assert first.startswith("FreeToken expert cache: hit rate 0.750 over the last 8 reads")
    assert "total reads 8, hits 6, fills 2, evictions 1, cpu 0" in first
    # a window with no LRU layer call (waves, streaming) says so instead of "nan"
    second = c.log_line()
    assert "no layer call went through the LRU" in second and "nan" not in second
    assert second.endswith("total reads 8, hits 6, fills 2, evictions 1, cpu 0")
