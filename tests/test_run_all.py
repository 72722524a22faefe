"""A CPU smoke run of ``benchmarks/run_all.py``: two systems (stock and FreeToken q*) serve
the same scaled-down workload in turn; the combined report, ratios, roofline rows, serving
plot, routing trace and replay plot are all written. Without a server: the ratios against
the best baseline, the request budget of ``serve_bench`` and ``run_all``'s driver (``--append``,
a failing system, the decode benchmark, the flags of ``run_all.sh``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BENCH = os.path.join(ROOT, "benchmarks")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)

import run_all  # noqa: E402
import serve_bench  # noqa: E402  (the module run_all uses)


def test_run_all_cpu_smoke(tiny_checkpoint, tmp_path):
    from sglang_cpu import cpu_env

    path = tiny_checkpoint("qwen3_moe", num_layers=4, num_experts=16, top_k=4)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "run_all.py"), "--model-path", path,
         "--cpu", "--systems", "stock-gpu,ft-qstar", "--workloads", "W1,W2", "--scale", "0.01",
         "--decode-cap", "3", "--bandwidth", "20,40", "--budget-s", "3000",
         "--decode-bench", "4", "--out-dir", str(out)],
        env=cpu_env(), capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((out / "runs.json").read_text())["runs"]
    assert [r["label"] for r in runs] == ["stock-gpu", "ft-qstar"]
    ft = runs[1]
    assert ft["freetoken"]["delta"]["total"]["reads"] > 0
    assert ft["freetoken"]["after"]["miss_policy"] == "qstar"
    for r in runs:
        assert r["summary"]["errors"] == 0
        assert r["summary"]["mean_decode_tok_s"] > 0
        assert r["budget_s"] == 3000 and r["summary"]["truncated"] is False
        assert r["summary"]["planned"] == r["summary"]["requests"] == 1 + 17
        d = r["decode_bench"]  # a real measure_decode against the CPU server
        assert d["bs1_rated"] == 2 and d["bs1_decode_tok_s"] > 0 and d["bs4_total_tok_s"] > 0
        assert d["cut_requests"] == 0 and d["warmup_cut_requests"] == 0 and d["new_tokens"] == 4
    w1 = ft["decode_bench"]["bs1_decode_counts"]
    assert w1["reads"] > 0 and w1["hits"] + w1["fills"] + w1["cpu"] == w1["reads"]
    roof = json.loads((out / "roofline.json").read_text())
    assert {row["workload"] for row in roof} == {"W1", "W2"}
    assert all(0 < row["achieved_over_bound"] for row in roof)
    assert (out / "serving.png").stat().st_size > 0
    assert (out / "traces" / "ft-qstar.npz").exists()
    assert any(f.endswith(".png") for f in os.listdir(out / "replay"))
    report = (out / "report.md").read_text()
    assert "Roofline" in report
    assert "Failed systems" not in report
    assert report.index("| ft-qstar | all |") < report.index(
        "Ratios against the best baseline in this run") < report.index("Roofline")
    assert "| stock-gpu | W2 | 1.00 (stock-gpu) | 1.00 (stock-gpu) | 1.00 (stock-gpu) |" in report
    ratios = json.loads((out / "ratios.json").read_text())["workloads"]
    assert {(r["system"], r["workload"]) for r in ratios} == {
        (s, w) for s in ("stock-gpu", "ft-qstar") for w in ("W1", "W2")}
    doc = json.loads((out / "runs.json").read_text())
    by_label = {r["label"]: r for r in doc["runs"]}

    def rates(label, workload):
        return {q["index"]: q["decode_tok_s"] for q in by_label[label]["requests"]
                if q["workload"] == workload and not q.get("error")
                and q.get("decode_tok_s") is not None}

    for r in ratios:  # over the requests both finished, from the records in runs.json
        assert r["mean_decode_tok_s"]["baseline"] == "stock-gpu"
        a, b = rates(r["system"], r["workload"]), rates("stock-gpu", r["workload"])
        common = sorted(a.keys() & b.keys())
        want = (sum(a[i] for i in common) / len(common)) / (sum(b[i] for i in common) / len(common))
        assert r["mean_decode_tok_s"]["compared"] == len(common) > 0
        assert abs(r["mean_decode_tok_s"]["ratio"] - want) < 1e-12


# ---------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------


def _summary(requests=5, planned=None, decode=None, mean_ttft=None, worst_ttft=None):
    planned = requests if planned is None else planned
    return {"requests": requests, "planned": planned, "truncated": requests < planned,
            "errors": 0, "mean_ttft_s": mean_ttft, "worst_ttft_s": worst_ttft,
            "mean_decode_tok_s": decode, "mean_tpot_ms": 1e3 / decode if decode else None,
            "prompt_tokens": 100, "cached_tokens": 50, "prefill_tokens": 50,
            "completion_tokens": 10 * requests, "cached_fraction": 0.5}


def _run(label, workloads, decode_bench=None):
    """A hand-made run: ``workloads`` maps a name to ``_summary`` kwargs."""
    ws = {n: {"title": n, "edits": [], "summary": _summary(**kw), "freetoken": None}
          for n, kw in workloads.items()}
    run = {"label": label, "base_url": "http://x", "workloads": ws, "requests": [],
           "summary": _summary(requests=sum(w["summary"]["requests"] for w in ws.values()),
                               planned=sum(w["summary"]["planned"] for w in ws.values())),
           "freetoken": None}
    if decode_bench is not None:
        run["decode_bench"] = decode_bench
    return run


def _hand_made_runs():
    return [
        _run("stock-gpu", {"W1": dict(decode=20.0, mean_ttft=0.5, worst_ttft=4.0),
                           "W2": dict(decode=10.0, mean_ttft=2.0, worst_ttft=8.0)},
             {"bs1_decode_tok_s": 50.0, "bs4_total_tok_s": 100.0, "new_tokens": 64, "input_len": 128}),
        # slower decode but a lower mean TTFT on W1; no W2 numbers
        _run("stock-offload", {"W1": dict(decode=5.0, mean_ttft=0.25, worst_ttft=5.0),
                               "W2": dict(requests=0, planned=17)},
             {"bs1_decode_tok_s": 10.0, "bs4_total_tok_s": 200.0, "new_tokens": 64, "input_len": 128}),
        _run("ft-qstar", {"W1": dict(decode=15.0, mean_ttft=1.0, worst_ttft=2.0),
                          "W2": dict(requests=3, planned=17, decode=12.0, mean_ttft=1.0, worst_ttft=1.0)},
             {"bs1_decode_tok_s": 25.0, "bs4_total_tok_s": float("nan"), "new_tokens": 64,
              "input_len": 128, "bs1_decode_counts": {"reads": 10, "hits": 8, "fills": 1,
                                                      "evictions": 1, "cpu": 1, "hit_rate": 0.8},
              "bs4_decode_counts": {"reads": 20, "hits": 10, "fills": 5, "evictions": 5,
                                    "cpu": 5, "hit_rate": 0.5}}),
    ]


def test_ratios_against_best_baseline():
    runs = _hand_made_runs()
    rows = {(r["system"], r["workload"]): r for r in run_all.ratios(runs)}
    assert len(rows) == 6
    ft1, ft2 = rows["ft-qstar", "W1"], rows["ft-qstar", "W2"]
    # W1: best decode stock-gpu (20), best mean TTFT stock-offload (0.25), best worst TTFT stock-gpu (4)
    assert (ft1["mean_decode_tok_s"]["baseline"], ft1["mean_decode_tok_s"]["ratio"]) == ("stock-gpu", 0.75)
    assert (ft1["mean_ttft_s"]["baseline"], ft1["mean_ttft_s"]["ratio"]) == ("stock-offload", 4.0)
    assert (ft1["worst_ttft_s"]["baseline"], ft1["worst_ttft_s"]["ratio"]) == ("stock-gpu", 0.5)
    off1 = rows["stock-offload", "W1"]
    assert off1["mean_decode_tok_s"]["ratio"] == 0.25 and off1["mean_ttft_s"]["ratio"] == 1.0
    # W2: stock-offload has no numbers, so stock-gpu is the best for all three
    assert {ft2[k]["baseline"] for k in ("mean_decode_tok_s", "mean_ttft_s", "worst_ttft_s")} == {"stock-gpu"}
    assert (ft2["mean_decode_tok_s"]["ratio"], ft2["mean_ttft_s"]["ratio"], ft2["worst_ttft_s"]["ratio"]) == (1.2, 0.5, 0.125)
    assert ft2["mean_ttft_s"]["unequal_requests"] and not ft1["mean_ttft_s"]["unequal_requests"]
    assert rows["stock-offload", "W2"]["mean_decode_tok_s"]["ratio"] is None
    md = run_all.ratios_markdown(list(rows.values()))
    assert "| ft-qstar | W1 | 0.75 (stock-gpu) | 4.00 (stock-offload) | 0.50 (stock-gpu) |" in md
    assert "| ft-qstar | W2 | 1.20 (stock-gpu) † | 0.50 (stock-gpu) † | 0.12 (stock-gpu) † |" in md
    assert "| stock-offload | W2 | - | - | - |" in md
    assert run_all.UNEQUAL_NOTE in md
    # no baseline at all: every cell is "-"
    only_ft = run_all.ratios([runs[2]])
    assert all(r[k]["ratio"] is None and r[k]["baseline"] is None for r in only_ft
               for k in ("mean_decode_tok_s", "mean_ttft_s", "worst_ttft_s"))


def _rec(workload, index, ttft, rate, error=None):
    return {"workload": workload, "index": index, "ttft_s": ttft, "decode_tok_s": rate,
            "error": error}


def test_ratios_compare_the_same_requests():
    """With request records, each ratio covers the requests both runs finished: the system's
    3 of 5 against the same 3 of the baseline's 5, errors left out, and the best baseline is
    chosen on those shared requests."""
    gpu = _run("stock-gpu", {"W2": dict(requests=5, decode=30.0, mean_ttft=1.0, worst_ttft=3.0)})
    # stock-gpu: requests 0-2 are slow to start (2 s), 3-4 fast; its full-set mean hides that
    gpu["requests"] = [_rec("W2", 0, 2.0, 10.0), _rec("W2", 1, 2.0, 20.0), _rec("W2", 2, 2.0, 30.0),
                       _rec("W2", 3, 0.1, 40.0), _rec("W2", 4, 0.1, 50.0)]
    off = _run("stock-offload", {"W2": dict(requests=2, planned=5, decode=1.0, mean_ttft=0.5,
                                            worst_ttft=0.5)})
    off["requests"] = [_rec("W2", 0, 0.5, 1.0), _rec("W2", 1, 0.5, 1.0)]
    ft = _run("ft-fill", {"W2": dict(requests=4, planned=5, decode=9.0, mean_ttft=3.0,
                                     worst_ttft=4.0)})
    ft["requests"] = [_rec("W2", 0, 3.0, 5.0), _rec("W2", 1, 4.0, 10.0), _rec("W2", 2, 2.0, 12.0),
                      _rec("W2", 3, 0.01, 999.0, error="cut by the budget after 9.0 s")]
    rows = {(r["system"], r["workload"]): r for r in run_all.ratios([gpu, off, ft])}
    f = rows["ft-fill", "W2"]
    # decode: stock-gpu over requests 0-2 = 20 (not its full 30); stock-offload over 0-1 = 1
    d = f["mean_decode_tok_s"]
    assert (d["baseline"], d["compared"], d["value"], d["baseline_value"]) == ("stock-gpu", 3, 9.0, 20.0)
    assert d["ratio"] == 0.45 and not d["unequal_requests"]
    # mean TTFT: stock-offload's 0.5 over requests 0-1 beats stock-gpu's 2.0 over 0-2
    m = f["mean_ttft_s"]
    assert (m["baseline"], m["compared"], m["value"], m["baseline_value"]) == ("stock-offload", 2, 3.5, 0.5)
    assert m["ratio"] == 7.0
    w = f["worst_ttft_s"]
    assert (w["baseline"], w["compared"], w["value"]) == ("stock-offload", 2, 4.0)
    md = run_all.ratios_markdown(list(rows.values()))
    assert "| ft-fill | W2 | 0.45 (stock-gpu; 3 of 5) | 7.00 (stock-offload; 2 of 5) | 8.00 (stock-offload; 2 of 5) |" in md
    # stock-gpu against itself (all 5) for decode; its first 2 against stock-offload for TTFT
    assert "| stock-gpu | W2 | 1.00 (stock-gpu) | 4.00 (stock-offload; 2 of 5) | 4.00 (stock-offload; 2 of 5) |" in md
    assert run_all.SAME_REQUESTS_NOTE in md and run_all.UNEQUAL_NOTE not in md
    # no shared finished request with any baseline: no ratio
    ft["requests"] = [_rec("W2", 4, 1.0, 9.0)]
    off["requests"], gpu["requests"] = off["requests"], gpu["requests"][:4]
    lone = {(r["system"], r["workload"]): r for r in run_all.ratios([gpu, off, ft])}["ft-fill", "W2"]
    assert all(lone[k]["ratio"] is None and lone[k]["compared"] is None
               for k in ("mean_decode_tok_s", "mean_ttft_s", "worst_ttft_s"))


def test_best_baseline_is_the_one_the_system_compares_worst_against(tmp_path):
    """stock-gpu is faster than stock-offload on every request, but stock-offload finished only
    request 1, an easy one: over its shared requests its mean TTFT (0.3 s) is lower than
    stock-gpu's over all five (0.36 s). The best baseline is chosen by the ratio, so the
    system is compared with stock-gpu (3.89x), not with stock-offload (1.67x)."""
    gpu = _run("stock-gpu", {"W2": dict(requests=5, decode=30.0, mean_ttft=0.36, worst_ttft=1.0)})
    gpu["requests"] = [_rec("W2", i, t, 30.0) for i, t in enumerate([1.0, 0.2, 0.2, 0.2, 0.2])]
    off = _run("stock-offload", {"W2": dict(requests=1, planned=5, decode=1.0, mean_ttft=0.3,
                                            worst_ttft=0.3)})
    off["requests"] = [_rec("W2", 1, 0.3, 1.0)]
    ft = _run("ft-fill", {"W2": dict(requests=5, decode=10.0, mean_ttft=1.4, worst_ttft=5.0)})
    ft["requests"] = [_rec("W2", i, t, 10.0) for i, t in enumerate([5.0, 0.5, 0.5, 0.5, 0.5])]
    row = {(r["system"], r["workload"]): r for r in run_all.ratios([gpu, off, ft])}["ft-fill", "W2"]
    m = row["mean_ttft_s"]
    assert (m["baseline"], m["compared"]) == ("stock-gpu", 5)
    assert abs(m["ratio"] - 1.4 / 0.36) < 1e-12
    d = row["mean_decode_tok_s"]  # 10/30 against stock-gpu, 10/1 against stock-offload
    assert (d["baseline"], d["ratio"]) == ("stock-gpu", 10.0 / 30.0)
    # a request with other max_tokens is another request: not compared
    off["requests"] = [dict(_rec("W2", 1, 0.3, 1.0), max_tokens=7)]
    for r in ft["requests"] + gpu["requests"]:
        r["max_tokens"] = 64
    assert run_all._pair(ft, off, "W2", "mean_ttft_s") is None
    off["requests"] = [dict(_rec("W2", 1, 0.3, 1.0), max_tokens=64)]  # now the same request
    assert run_all._pair(ft, off, "W2", "mean_ttft_s")["compared"] == 1
    # a workload that ran twice in one run is refused, not merged
    ft["requests"].append(dict(ft["requests"][0]))
    with pytest.raises(ValueError, match="a workload must run once per system"):
        run_all.ratios([gpu, off, ft])
    with pytest.raises(SystemExit, match="a workload is named twice"):
        run_all.main(["--model-path", "unused", "--workloads", "W2,W2", "--out-dir", str(tmp_path)])


def test_a_summary_only_baseline_does_not_outrank_a_same_request_one():
    """Two baselines with the same numbers, one with request records and one without: the
    same-request comparison (2.0) is chosen, not the summary one of different request sets."""
    gpu = _run("stock-gpu", {"W2": dict(requests=5, decode=30.0, mean_ttft=0.3, worst_ttft=1.0)})
    gpu["requests"] = [_rec("W2", i, 0.5, 30.0) for i in range(5)]
    summ = _run("stock-offload", {"W2": dict(requests=5, decode=30.0, mean_ttft=0.15, worst_ttft=1.0)})
    ft = _run("ft-fill", {"W2": dict(requests=2, planned=5, decode=10.0, mean_ttft=1.0, worst_ttft=1.0)})
    ft["requests"] = [_rec("W2", i, 1.0, 10.0) for i in range(2)]
    m = {(r["system"], r["workload"]): r for r in run_all.ratios([gpu, summ, ft])}["ft-fill", "W2"]["mean_ttft_s"]
    assert (m["baseline"], m["compared"], m["ratio"], m["unequal_requests"]) == ("stock-gpu", 2, 2.0, False)
    # with only the summary baseline, the summary comparison is made and marked
    m = {(r["system"], r["workload"]): r for r in run_all.ratios([summ, ft])}["ft-fill", "W2"]["mean_ttft_s"]
    assert (m["baseline"], m["compared"], m["unequal_requests"]) == ("stock-offload", None, True)
    assert abs(m["ratio"] - 1.0 / 0.15) < 1e-12


def test_nothing_to_run_or_report_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="nothing to run or report"):
        run_all.main(["--model-path", "unused", "--systems", "", "--out-dir", str(tmp_path)])


def test_replay_takes_the_traces_of_this_call_and_of_the_appended_ones(monkeypatch, tmp_path):
    import subprocess as sp

    for d, names in (("a/traces", ["ft-qstar.npz"]), ("b/traces", ["ft-fill.npz", "ft-cpu.npz", "x.txt"])):
        (tmp_path / d).mkdir(parents=True)
        for n in names:
            (tmp_path / d / n).write_bytes(b"")
    calls = []
    monkeypatch.setattr(sp, "run", lambda cmd, check: calls.append(cmd))
    out = run_all.replay_traces([str(tmp_path / "a/traces"), str(tmp_path / "b/traces"),
                                 str(tmp_path / "missing")], str(tmp_path / "replay"))
    assert out == str(tmp_path / "replay") and len(calls) == 1
    want = sorted(os.path.realpath(str(tmp_path / f)) for f in
                  ("a/traces/ft-qstar.npz", "b/traces/ft-fill.npz", "b/traces/ft-cpu.npz"))
    assert calls[0][2:-2] == want
    assert run_all.replay_traces([str(tmp_path / "missing")], str(tmp_path / "r2")) is None
    # a trace reached twice (a relative and an absolute folder, and a recorded path) and a
    # recorded trace of an older call's folder: each replayed once
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "ft-old.npz").write_bytes(b"")
    calls.clear()
    monkeypatch.chdir(tmp_path)
    run_all.replay_traces(["a/traces", str(tmp_path / "a/traces")], "r3",
                          [str(tmp_path / "a/traces/ft-qstar.npz"), str(tmp_path / "c/ft-old.npz"),
                           str(tmp_path / "c/gone.npz")])
    assert calls[0][2:-2] == sorted([os.path.realpath(str(tmp_path / "a/traces/ft-qstar.npz")),
                                     os.path.realpath(str(tmp_path / "c/ft-old.npz"))])


def test_decode_bench_table_and_ratios():
    runs = _hand_made_runs()
    runs.append(_run("ft-cpu", {"W1": dict(decode=1.0, mean_ttft=1.0, worst_ttft=1.0)},
                     {"error": "HTTPError: 400", "new_tokens": 64, "input_len": 128}))
    runs.append(_run("ft-fill", {"W1": dict(decode=1.0, mean_ttft=1.0, worst_ttft=1.0)}))
    rows = {r["system"]: r for r in run_all.decode_ratios(runs)}
    assert set(rows) == {"stock-gpu", "stock-offload", "ft-qstar", "ft-cpu"}
    ft = rows["ft-qstar"]
    assert (ft["bs1_decode_tok_s"]["baseline"], ft["bs1_decode_tok_s"]["ratio"]) == ("stock-gpu", 0.5)
    assert ft["bs4_total_tok_s"]["baseline"] == "stock-offload" and ft["bs4_total_tok_s"]["ratio"] is None
    assert rows["stock-gpu"]["bs4_total_tok_s"]["ratio"] == 0.5
    md = run_all.decode_markdown(runs)
    assert md.startswith("Decode (random 128-token prompts, 64 tokens, batch 1 and 4):")
    assert ("| system | bs1 tok/s | bs4 total tok/s | hit rate bs1 | hit rate bs4 | CPU share bs1 "
            "| CPU share bs4 | bs1 ratio (best baseline) | bs4 ratio (best baseline) |") in md
    assert "| ft-qstar | 25.00 | - | 0.800 | 0.500 | 0.100 | 0.250 | 0.50 (stock-gpu) | - |" in md
    assert "| stock-gpu | 50.00 | 100.00 | - | - | - | - | 1.00 (stock-gpu) | 0.50 (stock-offload) |" in md
    assert "| ft-cpu | failed: HTTPError: 400 |" in md
    assert "| ft-fill | not measured |" in md
    assert run_all.decode_markdown([_run("x", {})]) == ""


class _FakeClock:
    def __init__(self):
        self.t = 1000.0

    def perf_counter(self):
        return self.t

    def time(self):
        return self.t


def _fake_stream_chat(clock, calls, seconds=1.0):
    """Each request takes ``seconds`` on ``clock``, or is cut at its ``max_s``."""
    def stream_chat(client, body, max_s=None):
        calls.append((body, max_s))
        if max_s is not None and seconds > max_s:
            clock.t += max_s
            return {"ttft_s": None, "ttft_text_s": None, "decode_s": None, "decode_tok_s": None,
                    "tpot_ms": None, "e2e_s": max_s, "prompt_tokens": None,
                    "cached_tokens": None, "completion_tokens": None, "output_chunks": 0,
                    "finish_reason": None, "error": f"cut by the budget after {max_s:.1f} s"}
        clock.t += seconds
        return {"ttft_s": 0.1, "ttft_text_s": 0.1, "decode_s": 0.5, "decode_tok_s": 4.0,
                "tpot_ms": 250.0, "e2e_s": 1.0, "prompt_tokens": 10, "cached_tokens": 0,
                "completion_tokens": 3, "output_chunks": 3, "finish_reason": "length",
                "error": None}
    return stream_chat


def test_run_session_deadline_passed_issues_no_request(monkeypatch):
    calls = []
    monkeypatch.setattr(serve_bench, "stream_chat", lambda c, b, m=None: calls.append(b) or {})
    reqs = serve_bench.wl.build("W2", scale=0.01).requests()
    import time
    recs = serve_bench.run_session(None, "m", reqs, deadline=time.perf_counter() - 1.0)
    assert recs == [] and calls == []


def test_run_system_budget_truncates_and_marks(monkeypatch):
    clock, calls = _FakeClock(), []
    monkeypatch.setattr(serve_bench, "time", clock)
    monkeypatch.setattr(serve_bench, "stream_chat", _fake_stream_chat(clock, calls))
    monkeypatch.setattr(serve_bench, "server_info", lambda url: {"enable_cache_report": True})
    monkeypatch.setattr(serve_bench, "freetoken_stats", lambda url: None)
    monkeypatch.setattr(serve_bench, "flush_cache", lambda url: True)
    monkeypatch.setattr(serve_bench, "_client", lambda url, timeout: None)
    # one request a second; W1 has 1, W2 17, W4 20. Cumulative shares of 5.5 s: W1 until
    # 1.83 s (t=0), W2 until 3.67 s (t=1, 2, 3), W4 until 5.5 s (t=4, 5).
    run = serve_bench.run_system("http://x", "m", ["W1", "W2", "W4"], scale=0.01, label="sys",
                                 budget_s=5.5)
    assert len(calls) == 6
    w = {n: run["workloads"][n]["summary"] for n in ("W1", "W2", "W4")}
    assert (w["W1"]["requests"], w["W1"]["planned"], w["W1"]["truncated"]) == (1, 1, False)
    assert (w["W2"]["requests"], w["W2"]["planned"], w["W2"]["truncated"]) == (3, 17, True)
    assert (w["W4"]["requests"], w["W4"]["planned"], w["W4"]["truncated"]) == (2, 20, True)
    assert (run["summary"]["requests"], run["summary"]["planned"], run["summary"]["truncated"]) == (6, 38, True)
    assert run["budget_s"] == 5.5
    md = serve_bench.markdown([run], per_request=False)
    assert "| sys | W1 | – | 1 |" in md
    assert "| sys | W2 | placeholder | 3/17 (budget) |" in md
    assert "| sys | W4 | drop_thinking | 2/20 (budget) |" in md
    assert "| sys | all | – | 6/38 (budget) |" in md
    # no budget: everything runs, nothing marked
    calls.clear()
    run = serve_bench.run_system("http://x", "m", ["W1", "W2"], scale=0.01, label="sys")
    assert len(calls) == 18 and run["summary"]["truncated"] is False
    assert "(budget)" not in serve_bench.markdown([run], per_request=False)
    assert all(m is None for _, m in calls)  # no budget: no request is cut


def test_run_system_budget_cuts_a_request_in_flight(monkeypatch):
    """A request still running one share after the budget's end is cut and shown failed."""
    clock, calls = _FakeClock(), []
    monkeypatch.setattr(serve_bench, "time", clock)
    monkeypatch.setattr(serve_bench, "stream_chat", _fake_stream_chat(clock, calls, seconds=10.0))
    monkeypatch.setattr(serve_bench, "server_info", lambda url: {"enable_cache_report": True})
    monkeypatch.setattr(serve_bench, "freetoken_stats", lambda url: None)
    monkeypatch.setattr(serve_bench, "flush_cache", lambda url: True)
    monkeypatch.setattr(serve_bench, "_client", lambda url, timeout: None)
    # budget 6 s over W1, W2: shares end at 3 s and 6 s; requests are cut at 6 + 3 = 9 s.
    run = serve_bench.run_system("http://x", "m", ["W1", "W2"], scale=0.01, label="sys",
                                 budget_s=6.0)
    assert [m for _, m in calls] == [9.0]  # W1's request, cut at 9 s; W2 never starts
    w1, w2 = run["workloads"]["W1"]["summary"], run["workloads"]["W2"]["summary"]
    assert (w1["requests"], w1["errors"]) == (1, 1)
    assert (w2["requests"], w2["planned"], w2["truncated"]) == (0, 17, True)
    assert run["summary"]["wall_s"] == 9.0
    md = serve_bench.markdown([run], per_request=True)
    assert "| sys | W1 | – | 1 (1 failed) |" in md
    assert "cut by the budget after 9.0 s" in md


class _FakeServer:
    """Stands in for ``servers.Server``: fails to start for labels in ``fail``."""

    fail = ()

    def __init__(self, model, flags, log_path, cpu=False, timeout=0):
        name = os.path.basename(log_path)[:-4]
        if name in self.fail:
            raise RuntimeError(f"server exited (1):\nlog of {name} | tail")
        self.url, self.startup_s = f"http://{name}", 1.5

    def weights_gb(self):
        return 2.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


class _FakeSampler:
    def reset(self):
        pass

    def peak_gib(self):
        return 0.0

    def close(self):
        pass


def _patch_driver(monkeypatch, fail=()):
    """run_all.main without servers: each system's run is hand-made, its W1 decode tok/s
    (and bs1 decode tok/s) the value in ``speeds``."""
    speeds = {"stock-gpu": 20.0, "stock-offload": 8.0, "ft-qstar": 10.0, "ft-fill": 5.0,
              "ft-cpu": 4.0}
    seen = {"budget": [], "decode": []}
    monkeypatch.setattr(run_all, "Server", type("S", (_FakeServer,), {"fail": fail}))
    monkeypatch.setattr(run_all, "GpuMemorySampler", _FakeSampler)
    monkeypatch.setattr(run_all, "expert_pool_gib", lambda model: 1.0)
    monkeypatch.setattr(run_all, "vocab_size", lambda model: 32000)

    def run_system(url, workloads, scale, label, decode_cap, budget_s):
        seen["budget"].append(budget_s)
        return _run(label, {w: dict(decode=speeds[label], mean_ttft=1.0, worst_ttft=2.0)
                            for w in workloads})

    def measure_decode(url, input_len, new_tokens, repeats, seed=0, max_request_s=None,
                       vocab_size=None):
        seen["decode"].append((url, input_len, new_tokens, repeats, max_request_s, vocab_size))
        label = url.split("//")[1]
        return {"bs1_decode_tok_s": speeds[label], "bs4_total_tok_s": 2 * speeds[label]}

    monkeypatch.setattr(run_all.serve_bench, "run_system", run_system)
    monkeypatch.setattr(run_all.bench_decode, "measure_decode", measure_decode)
    return seen


def test_run_all_append_failure_and_decode_bench(monkeypatch, tmp_path, capsys):
    seen = _patch_driver(monkeypatch, fail=("stock-offload",))
    out1 = tmp_path / "out1"
    rc = run_all.main(["--model-path", "unused", "--systems", "stock-gpu,stock-offload,ft-qstar",
                       "--workloads", "W1", "--decode-bench", "64", "--budget-s", "60",
                       "--out-dir", str(out1)])
    assert rc == 1  # a system failed
    assert seen["budget"] == [60.0, 60.0]
    assert seen["decode"] == [("http://stock-gpu", 128, 64, 2, 20.0, 32000),
                              ("http://ft-qstar", 128, 64, 2, 20.0, 32000)]
    doc = json.loads((out1 / "runs.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["stock-gpu", "ft-qstar"]
    assert doc["errors"][0]["label"] == "stock-offload" and "server exited" in doc["errors"][0]["error"]
    assert doc["runs"][1]["decode_bench"]["new_tokens"] == 64
    report = (out1 / "report.md").read_text()
    assert "| stock-offload | RuntimeError: server exited (1): log of stock-offload \\| tail |" in report
    assert "| ft-qstar | W1 | 0.50 (stock-gpu) | 1.00 (stock-gpu) | 1.00 (stock-gpu) |" in report
    assert "Decode (random 128-token prompts, 64 tokens, batch 1 and 4):" in report
    assert "| ft-qstar | 10.00 | 20.00 | - | - | - | - | 0.50 (stock-gpu) | 0.50 (stock-gpu) |" in report

    # second call, same settings: stock-offload fails again, ft-fill runs; the first
    # call's runs and failure come first
    same = ["--model-path", "unused", "--workloads", "W1", "--decode-bench", "64",
            "--budget-s", "60"]
    out2 = tmp_path / "out2"
    rc = run_all.main(same + ["--systems", "stock-gpu,stock-offload,ft-qstar",
                              "--systems", "stock-offload,ft-fill",
                              "--append", str(out1 / "runs.json"), "--out-dir", str(out2)])
    assert rc == 1  # stock-offload failed in this call
    doc = json.loads((out2 / "runs.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["stock-gpu", "ft-qstar", "ft-fill"]
    assert [r.get("appended_from") for r in doc["runs"]] == [str(out1 / "runs.json")] * 2 + [None]
    assert [e["label"] for e in doc["errors"]] == ["stock-offload", "stock-offload"]
    report = (out2 / "report.md").read_text()
    assert "| ft-fill | W1 | 0.25 (stock-gpu) |" in report
    assert "| ft-qstar | W1 | 0.50 (stock-gpu) |" in report
    assert "| ft-fill | 5.00 | 10.00 |" in report
    assert "Runs of other calls (`--append`)" in report
    assert (out2 / "serving.png").stat().st_size > 0

    # third call: only ft-cpu, which runs; the appended failures do not fail this call
    out3 = tmp_path / "out3"
    rc = run_all.main(same + ["--systems", "ft-cpu", "--append", str(out2 / "runs.json"),
                              "--out-dir", str(out3)])
    assert rc == 0
    assert [r["label"] for r in json.loads((out3 / "runs.json").read_text())["runs"]] == [
        "stock-gpu", "ft-qstar", "ft-fill", "ft-cpu"]

    # report only: no system, no server; the appended runs and their failures are re-rendered
    class _NoServer:
        def __init__(self, *a, **k):
            raise AssertionError("a report-only call started a server")

    monkeypatch.setattr(run_all, "Server", _NoServer)
    out4 = tmp_path / "out4"
    rc = run_all.main(same + ["--systems", "", "--append", str(out3 / "runs.json"),
                              "--out-dir", str(out4), "--no-replay"])
    assert rc == 0
    doc = json.loads((out4 / "runs.json").read_text())
    assert [r["label"] for r in doc["runs"]] == ["stock-gpu", "ft-qstar", "ft-fill", "ft-cpu"]
    assert [e["label"] for e in doc["errors"]] == ["stock-offload", "stock-offload"]
    assert "| ft-cpu | W1 | 0.20 (stock-gpu) |" in (out4 / "report.md").read_text()

    # other settings, a system twice, an unknown system, a file that is no runs.json
    for extra, message in [
        (["--systems", "ft-cpu", "--decode-bench", "32"], "--decode-bench 64"),
        (["--systems", "ft-qstar"], "would appear twice"),
    ]:
        with pytest.raises(SystemExit, match=message):
            run_all.main(same + extra + ["--append", str(out1 / "runs.json"),
                                         "--out-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="unknown ft-xyz"):
        run_all.main(same + ["--systems", "ft-xyz", "--out-dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="--budget-s must be a positive"):
        run_all.main(same[:-1] + ["0", "--systems", "ft-cpu", "--out-dir", str(tmp_path / "x")])
    junk = tmp_path / "junk.json"
    junk.write_text('{"a": 1}')
    with pytest.raises(SystemExit, match="not a runs.json"):
        run_all.load_appended([str(junk)])

    # appending a single-run file (serve_bench's format for one run) and a runs.json
    single = tmp_path / "single.json"
    single.write_text(json.dumps(_run("stock-offload", {"W1": dict(decode=40.0, mean_ttft=0.5, worst_ttft=1.0)})))
    runs, errors = run_all.load_appended([str(single), str(out1 / "runs.json")])
    assert [r["label"] for r in runs] == ["stock-offload", "stock-gpu", "ft-qstar"]
    assert [e["label"] for e in errors] == ["stock-offload"]
    rows = {(r["system"], r["workload"]): r for r in run_all.ratios(runs)}
    assert rows["ft-qstar", "W1"]["mean_decode_tok_s"]["ratio"] == 0.25  # against the 40 tok/s run
    assert rows["ft-qstar", "W1"]["mean_decode_tok_s"]["baseline"] == "stock-offload"


def test_runs_json_written_after_each_system(monkeypatch, tmp_path):
    _patch_driver(monkeypatch)
    out = tmp_path / "out"
    written = []
    real = run_all.write_outputs

    def spy(runs, errors, out_dir):
        written.append([r["label"] for r in json.loads(
            open(os.path.join(out_dir, "runs.json")).read())["runs"]] if os.path.exists(
            os.path.join(out_dir, "runs.json")) else None)
        return real(runs, errors, out_dir)

    monkeypatch.setattr(run_all, "write_outputs", spy)
    assert run_all.main(["--model-path", "unused", "--systems", "stock-gpu,ft-qstar",
                         "--workloads", "W1,W2", "--out-dir", str(out)]) == 0
    # before each write: nothing, then the first system's run, then both
    assert written == [None, ["stock-gpu"], ["stock-gpu", "ft-qstar"]]
    assert "Failed systems" not in (out / "report.md").read_text()


def test_run_all_sh_flags_and_override():
    """run_all.sh's defaults, and a later --systems in its extra flags wins."""
    text = open(os.path.join(BENCH, "run_all.sh")).read().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("exec python3"))
    args = shlex.split(line.split('run_all.py"', 1)[1])
    assert args[-3:] == ["--out-dir", "$out", "$@"]
    base = args[:-1]
    a = run_all.parser().parse_args(base)
    assert a.systems == "stock-gpu,ft-qstar,ft-fill"
    assert (a.decode_bench, a.decode_bench_max_s, a.budget_s, a.scale, a.decode_cap) == (32, 10.0, 30.0, 0.1, 64)
    a = run_all.parser().parse_args(base + ["--systems", "ft-cpu,stock-offload", "--append", "OUT/runs.json"])
    assert a.systems == "ft-cpu,stock-offload" and a.append == ["OUT/runs.json"]


@pytest.mark.parametrize("b_p,b_h", [(20.0, 40.0), (40.0, 20.0)])
def test_roofline_uses_the_better_bandwidth(b_p, b_h):
    """Under q* (paper Eq. 2-4: the CPU gets the residual B_H - B_P while fills run), a layer's
    m misses take m S / max(B_P, B_H)."""
    bw, expected = {"B_P": b_p, "B_H": b_h}, 40.0
    ft = _run("ft-qstar", {"W1": dict(requests=2, decode=10.0, mean_ttft=1.0, worst_ttft=1.0)})
    ft["workloads"]["W1"]["freetoken"] = {"decode": {"fills": 6, "cpu": 12}}
    ft["freetoken"] = {"after": {"bandwidth": bw, "pool": {"expert_bytes": 3e9}}}
    base = _run("stock-gpu", {"W1": dict(decode=100.0, mean_ttft=1.0, worst_ttft=1.0)})
    (row,) = run_all.roofline([base, ft])
    tokens = 20 - 2  # completion tokens - requests
    t = 10e-3 + (18 / tokens) * 3e9 / (expected * 1e9)
    assert row["misses_per_token"] == 1.0
    assert abs(row["bound_tok_s"] - 1 / t) < 1e-9


def test_every_system_s_flags_parse_with_sglang_s_own_parser(tmp_path):
    """Each system's launch flags, with run_all.sh's common flags, are accepted by SGLang
    0.5.17's ``ServerArgs.add_cli_args`` plus FreeToken's flags: on the H200 (2026-11-30)
    stock-offload's ``--cpu-offload-gb 40.50`` was refused (SGLang wants an int) and that
    server exited at start."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from freetoken_sglang import config as ft_config

    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    ft_config.add_cli_args(p)
    text = open(os.path.join(BENCH, "run_all.sh")).read().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("exec python3"))
    a = run_all.parser().parse_args(shlex.split(line.split('run_all.py"', 1)[1])[:-3]
                                    + ["--out-dir", str(tmp_path)])
    # the flags run_one adds itself, then run_all.sh's common flags, then the system's
    own = ["--enable-cache-report", "--skip-server-warmup", "--load-format", "dummy",
           "--tokenizer-path", "tok"]
    common = shlex.split(a.common)
    seen = {}
    for name in run_all.SYSTEMS:
        flags = run_all.system_flags(name, a, 54.0, str(tmp_path))  # Qwen3-30B-A3B's pool, GiB
        seen[name] = p.parse_args(["--model-path", "m"] + own + common + flags)
    assert seen["stock-offload"].cpu_offload_gb == 40  # 40.5 GiB, to the nearest whole GiB
    nearest = p.parse_args(["--model-path", "m"] + run_all.system_flags("stock-offload", a, 55.6, "t"))
    assert nearest.cpu_offload_gb == 42  # 41.7 GiB: rounded, not truncated
    with pytest.raises(ValueError, match="0 whole GiB for SGLang's --cpu-offload-gb"):
        run_all.system_flags("stock-offload", a, 0.6, "t")  # 0.45 GiB off the GPU
    assert seen["stock-gpu"].cpu_offload_gb == 0
    assert seen["ft-qstar"].freetoken_miss_policy == "qstar"
    assert seen["ft-qstar"].freetoken_cache_ratio == 0.25
    assert seen["ft-allhit"].freetoken_cache_ratio == 1.0


def test_h200_session4_ratios_from_its_runs_json():
    """The committed H200 run (benchmarks/results/h200-2026-11-30/session4/runs.json) gives
    the ratios RESULTS.md quotes: ft-fill's 5 W2 requests against stock-gpu's first 5."""
    path = os.path.join(BENCH, "results", "h200-2026-11-30", "session4", "runs.json")
    runs = json.loads(open(path).read())["runs"]
    rows = {(r["system"], r["workload"]): r for r in run_all.ratios(runs)}
    f2 = rows["ft-fill", "W2"]
    assert [f2[k]["compared"] for k in ("mean_decode_tok_s", "mean_ttft_s", "worst_ttft_s")] == [5, 5, 5]
    assert {f2[k]["baseline"] for k in ("mean_decode_tok_s", "mean_ttft_s", "worst_ttft_s")} == {"stock-gpu"}
    assert round(f2["mean_ttft_s"]["ratio"], 2) == 1.49 and round(f2["mean_decode_tok_s"]["ratio"], 2) == 0.16
    assert round(rows["ft-qstar", "W4"]["mean_ttft_s"]["ratio"], 2) == 13.99
    assert rows["ft-cpu", "W4"]["worst_ttft_s"]["compared"] == 1
    # stock-offload finished no request: no ratio of its own
    assert all(rows["stock-offload", w]["mean_ttft_s"]["ratio"] is None for w in ("W1", "W2", "W4"))
    roof = {(r["system"], r["workload"]): r for r in run_all.roofline(runs)}
    assert roof["ft-fill", "W2"]["allhit_compared"] == 5
    assert round(roof["ft-fill", "W2"]["achieved_over_bound"], 3) == 0.197


def test_measure_decode_counts_cut_warm_ups_and_the_report_shows_them(monkeypatch):
    """A warm-up request cut at max_request_s is counted apart from the measured ones and
    named in the decode table."""
    import bench_decode

    calls = []

    def fake(url, prompt, n, max_s):
        calls.append(n)
        cut = len(calls) == 2  # the first request of the batch-4 warm-up
        return {"tokens": n, "ttft_s": 0.1, "decode_tok_s": 50.0, "cut": cut}

    monkeypatch.setattr(bench_decode, "stream_generate", fake)
    monkeypatch.setattr(bench_decode, "freetoken_stats", lambda url: None)
    d = bench_decode.measure_decode("http://x", 8, 4, 2, max_request_s=1.0)
    assert calls == [16] * 5 + [4] * 6  # 1 + 4 warm-up, 2 at batch 1, 4 at batch 4
    assert (d["warmup_cut_requests"], d["cut_requests"]) == (1, 0)
    run = _run("ft-fill", {"W1": dict(decode=5.0, mean_ttft=1.0, worst_ttft=1.0)},
               dict(d, new_tokens=4, input_len=8, max_request_s=1.0))
    assert "| ft-fill (1 warm-up requests cut) |" in run_all.decode_markdown([run])


def test_roofline_gives_no_bound_without_a_shared_request():
    """Both runs have request records but share no finished request: no all-hit step is
    taken from other requests, so no bound."""
    gpu = _run("stock-gpu", {"W2": dict(requests=1, decode=30.0, mean_ttft=0.3, worst_ttft=0.3)})
    gpu["requests"] = [dict(_rec("W2", 0, 0.3, 30.0), tpot_ms=33.0)]
    ft = _run("ft-fill", {"W2": dict(requests=1, planned=2, decode=10.0, mean_ttft=1.0, worst_ttft=1.0)})
    ft["requests"] = [dict(_rec("W2", 1, 1.0, 10.0), tpot_ms=100.0)]
    ft["freetoken"] = {"after": {"pool": {"expert_bytes": 1 << 20}, "bandwidth": {"B_P": 10.0, "B_H": 20.0}}}
    ft["workloads"]["W2"]["freetoken"] = {"decode": {"fills": 5, "cpu": 5}}
    (row,) = run_all.roofline([gpu, ft])
    assert "bound_tok_s" not in row
    ft["requests"].append(dict(_rec("W2", 0, 1.0, 10.0), tpot_ms=100.0))  # now request 0 is shared
    (row,) = run_all.roofline([gpu, ft])
    assert (row["allhit_tpot_ms"], row["allhit_compared"]) == (33.0, 1)


def test_concurrently_waits_on_errors_but_not_on_sigterm():
    """bench_decode.concurrently: an ordinary error is raised after the other requests ended
    (run_all then drives workloads on the same server, which must be idle); SIGTERM's
    SystemExit is raised at once, so that the server is stopped next."""
    done, release = [], threading.Event()

    def slow_or_fail(i, exc):
        if i == 0:
            raise exc
        if exc is SystemExit:
            release.wait(30)
        else:
            time.sleep(0.3)
        done.append(i)

    with pytest.raises(ValueError):
        run_all.bench_decode.concurrently(lambda i: slow_or_fail(i, ValueError), [0, 1, 2, 3])
    assert sorted(done) == [1, 2, 3]
    done.clear()
    t0 = time.perf_counter()
    with pytest.raises(SystemExit):
        run_all.bench_decode.concurrently(lambda i: slow_or_fail(i, SystemExit), [0, 1, 2, 3])
    assert time.perf_counter() - t0 < 5 and done == []
    release.set()
    assert run_all.bench_decode.concurrently(lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_bench_decode_refuses_a_bad_max_request_s(value, tmp_path):
    with pytest.raises(SystemExit, match="--max-request-s must be a positive number"):
        run_all.bench_decode.main(["--system", "x:", "--max-request-s", value,
                                   "--out-dir", str(tmp_path)])


def test_expert_pool_gib_counts_fp8_codes_and_scales(tmp_path):
    """The FP8 shape's pool: one byte a weight plus fp32 scales per 128x128 block."""
    from servers import write_shape

    bf16 = run_all.expert_pool_gib(write_shape("qwen3-30b-a3b", str(tmp_path)))
    fp8 = run_all.expert_pool_gib(write_shape("qwen3-30b-a3b-fp8", str(tmp_path)))
    assert bf16 == 48 * 128 * 3 * 2048 * 768 * 2 / (1 << 30)
    scales = 2 * 6 * 16 + 16 * 6  # w13 [2I/128, H/128], w2 [H/128, I/128]
    assert fp8 == 48 * 128 * (3 * 2048 * 768 + 4 * scales) / (1 << 30)


def test_bench_decode_roofline_takes_the_all_hit_step_from_stock_only():
    """bench_decode.roofline without a 100% cell: the all-hit step is stock's (not a FreeToken
    server's without cells, not --cpu-offload-gb's), and the bound adds the missed bytes."""
    import bench_decode

    def server(label, flags, bs1, bs4, cells=None):
        return {"label": label, "flags": flags, "bs1_decode_tok_s": bs1, "bs4_total_tok_s": bs4,
                "by_ratio": cells}

    counts = {"reads": 100, "hits": 90}  # 10 misses over 2 * (5 - 1) = 8 steps at bs1
    cell = {"ratio": 0.25, "resize_status": 200, "bs1_decode_tok_s": 40.0,
            "bs1_decode_counts": counts, "bs4_decode_tok_s": None}
    ft = server("ft", "--enable-freetoken", None, None, [cell])
    results = [server("offload", "--cpu-offload-gb 40", 5.0, 9.0),
               server("ft-nocells", "--enable-freetoken", 70.0, 90.0), ft,
               server("stock", "--load-format dummy", 100.0, 300.0)]
    bw = {"B_P": 50.0, "B_H": 100.0}
    rows = [r for r in bench_decode.roofline(results, 5, 2, 1e6, bw).splitlines()
            if r.startswith("| ft |")]
    t_step = 1 / 100.0 + (10 / 8) * 1e6 / 100e9
    assert rows == [f"| ft | 0.25 | 40.00 | {1 / t_step:.2f} | {40.0 * t_step:.3f} | - | - | - "
                    f"| stock |"]
    assert bench_decode.roofline(results[:3], 5, 2, 1e6, bw).count("| ft |") == 0


def test_bench_decode_then_changes_the_policy_of_one_server(monkeypatch, tmp_path):
    """--then: after the ratios of the policy a server started with, it goes back to its
    starting size in each new policy (POST /freetoken/cache) and measures the ratios again,
    one result per policy; a flag that cannot change while serving is refused."""
    bd = run_all.bench_decode
    state, posts = {"slots": 64, "policy": "qstar"}, []

    class FakeServer:
        url, startup_s = "http://ft", 1.0

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def log(self):
            return ""

        def weights_gb(self):
            return 1.0

    class Answer:
        status_code, headers = 200, {"content-type": "application/json"}

        def __init__(self, body):
            self.body = body

        def json(self):
            return self.body

    def post(url, json, timeout):
        posts.append(json)
        state.update(slots=json["slots"], policy=json.get("miss_policy", state["policy"]))
        return Answer({"ok": True, "miss_policy": state["policy"]})

    def stats(url):
        return {"pool": {"experts": 64}, "cache": {"slots": state["slots"]}, "total": {},
                "miss_policy": state["policy"], "load": {}}

    def measure(url, input_len, new_tokens, repeats, max_request_s=None):
        rate = {"qstar": 3.0, "fill": 2.0}[state["policy"]] * state["slots"]
        return {"bs1_decode_tok_s": rate, "bs4_total_tok_s": 4 * rate}

    monkeypatch.setattr(bd, "Server", FakeServer)
    monkeypatch.setattr(bd, "GpuMemorySampler", lambda: type(
        "S", (), {"reset": lambda s: None, "peak_gib": lambda s: 0.0, "close": lambda s: None})())
    monkeypatch.setattr(bd, "write_shape", lambda shape, out: "model")
    monkeypatch.setattr(bd, "freetoken_stats", stats)
    monkeypatch.setattr(bd.requests, "post", post)
    monkeypatch.setattr(bd, "measure_decode", measure)
    with pytest.raises(SystemExit):  # no FreeToken system to change
        bd.main(["--system", "stock:", "--cache-ratios", "0.5", "--then", "f=fill",
                 "--out-dir", str(tmp_path)])
    bd.main(["--system", "ft-qstar:--enable-freetoken", "--cache-ratios", "0.5,0.25",
             "--then", "ft-fill=fill", "--then", "ft-admit=qstar,--freetoken-admission,reuse",
             "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [r["label"] for r in doc["results"]] == ["ft-qstar", "ft-fill", "ft-admit"]
    assert posts == [{"slots": 32}, {"slots": 32}, {"slots": 16},  # the first: warm-up
                     {"slots": 64, "miss_policy": "fill"}, {"slots": 32}, {"slots": 16},
                     {"slots": 64, "miss_policy": "qstar", "admission": "reuse"},
                     {"slots": 32}, {"slots": 16}]
    assert [c["bs1_decode_tok_s"] for c in doc["results"][1]["by_ratio"]] == [64.0, 32.0]
    assert doc["results"][2]["freetoken"]["miss_policy"] == "qstar"
    assert doc["results"][0]["warm_cell"]["slots"] == 32 and "warm_cell" not in doc["results"][1]
    assert "| ft-fill@0.25 | 32.00 | 128.00 | 0.333 |" in (tmp_path / "bench_decode.md").read_text()
    for spec, why in (("x=fill,--freetoken-cache-ratio,0.5", "cannot change while serving"),
                      ("x=lru", "must be one of"), ("=fill", "give LABEL=POLICY")):
        with pytest.raises(SystemExit, match=why):
            bd.parse_then(spec)
