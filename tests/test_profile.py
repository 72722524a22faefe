"""Bandwidth profiling: ``python -m freetoken_sglang.profile`` measures B_P and B_H for a
model's expert shape and caches them; ``--freetoken-bandwidth`` and the cache are what a
server uses, in that order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from freetoken_sglang.policy import rates
from freetoken_sglang.policy.miss import SPLIT_MAX_TOKENS, MissPolicy
from freetoken_sglang.cache.residency import FILL_ALL, MissSplit


def test_profile_cli_measures_and_caches(tiny_checkpoint, tmp_path):
    from sglang_cpu import cpu_env

    path = tiny_checkpoint("qwen3_moe")
    cache = tmp_path / "bw.json"
    out = subprocess.run(
        [sys.executable, "-m", "freetoken_sglang.profile", "--model-path", path,
         "--pool-gb", "0.01", "--threads", "1", "--cache", str(cache)],
        env=cpu_env(), capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout[out.stdout.index("{"):])
    assert result["B_P"] > 0 and result["B_H"] > 0 and result["seconds"] < 30
    assert result["B_P_beside"] > 0 and result["B_H_beside"] > 0
    assert result["q_star_per_miss_beside"] == pytest.approx(
        result["B_P_beside"] / (result["B_P_beside"] + result["B_H_beside"]))
    stored = json.loads(cache.read_text())
    assert stored[result["key"]]["B_H"] == result["B_H"]
    assert "threads=1" in result["key"] and "expert=64x64:float32" in result["key"]
    assert f"isa={result['isa']}" in result["key"]


def test_flag_parsing():
    assert rates.parse_flag("55, 90.5") == (55.0, 90.5)
    assert rates.parse_flag("55,90,4,0") == (55.0, 90.0, 4.0, 0.0)
    assert rates.parse_flag("55,90,4,0,50,80") == (55.0, 90.0, 4.0, 0.0, 50.0, 80.0)
    for bad in ("55", "a,b", "0,4", "1,2,3", "-1,4", "5,9,-1,2", "1,2,3,4,5", "1,2,3,4,0,5",
                "1,2,3,4,5,0", "1,2,3,4,5,6,7"):
        with pytest.raises(ValueError, match="B_P,B_H"):
            rates.parse_flag(bad)


def test_resolve_prefers_flag_then_cache(tmp_path):
    class Pool:
        specs = {"w13_weight": type("S", (), {"shape": (8, 4), "dtype": torch.bfloat16})()}

    class Executor:
        num_threads = 3
        isa = "avx2"

    cache = str(tmp_path / "bw.json")
    got = rates.resolve((10.0, 40.0), Pool(), Executor(), torch.device("cpu"), 4,
                        torch.bfloat16, cache)
    assert (got.b_p, got.b_h, got.ratio) == (10.0, 40.0, 0.25) and "flag" in got.source
    assert got.fixed_us is None  # a flag without fixed costs: no lone-miss rule
    got = rates.resolve((10.0, 40.0, 3.0, 20.0), Pool(), Executor(), torch.device("cpu"),
                        4, torch.bfloat16, cache)
    assert got.fixed_us == (3.0, 20.0)
    key = rates.machine_key(torch.device("cpu"), 3, "8x4:bfloat16", "avx2")
    assert got.split_rates("alone") == (10.0, 40.0)
    with pytest.raises(ValueError, match="B_P,B_H,F_P,F_H,B_P',B_H'"):
        got.split_rates("beside")  # a flag without the rates beside each other
    got = rates.resolve((10.0, 40.0, 3.0, 20.0, 8.0, 30.0), Pool(), Executor(),
                        torch.device("cpu"), 4, torch.bfloat16, cache)
    assert (got.b_p_beside, got.b_h_beside) == (8.0, 30.0)
    assert got.split_rates("beside") == (8.0, 38.0)  # (B_P', B_P' + B_H')
    rates.store_cached(cache, key, {"B_P": 50.0, "B_H": 100.0, "F_P_us": 2.0,
                                    "F_H_us": 9.0, "B_P_beside": 45.0,
                                    "B_H_beside": 90.0})
    got = rates.resolve(None, Pool(), Executor(), torch.device("cpu"), 4, torch.bfloat16, cache)
    assert (got.b_p, got.b_h) == (50.0, 100.0) and got.source == f"cache {cache}"
    assert got.fixed_us == (2.0, 9.0) and got.split_rates("beside") == (45.0, 135.0)


def test_profile_cache_writers_use_their_own_temporary_files(tmp_path, monkeypatch):
    # two servers starting together each write the cache through a file of their own: a
    # path another writer holds (here a directory in the old shared ``.tmp`` name's place)
    # neither blocks the write nor is left behind by it
    cache = str(tmp_path / "bandwidth.json")
    (tmp_path / "bandwidth.json.tmp").mkdir()
    rates.store_cached(cache, "a", {"B_P": 1.0})
    rates.store_cached(cache, "b", {"B_P": 2.0})
    assert json.loads((tmp_path / "bandwidth.json").read_text()) == {
        "a": {"B_P": 1.0}, "b": {"B_P": 2.0}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bandwidth.json",
                                                         "bandwidth.json.tmp"]
    # a write that fails is logged and skipped, its temporary file removed
    import os

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    rates.store_cached(cache, "c", {"B_P": 3.0})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bandwidth.json",
                                                         "bandwidth.json.tmp"]
    assert "c" not in json.loads((tmp_path / "bandwidth.json").read_text())


def test_rates_beside_each_other_are_measured_at_once(monkeypatch):
    # measure_beside opens both timed windows together after each side's warm-up: a fill
    # side with a slow warm-up (a kernel compile) does not leave the executor's window alone
    import time

    t = {}

    def fill(*a, seconds=1.0, start=None, **k):
        time.sleep(0.2)  # warm-up
        start.wait()
        t["fill"] = time.perf_counter()
        return 7.0

    def executor(*a, seconds=1.0, start=None, **k):
        start.wait()
        t["cpu"] = time.perf_counter()
        return 70.0

    monkeypatch.setattr(rates, "measure_fill", fill)
    monkeypatch.setattr(rates, "measure_executor", executor)
    got = rates.measure_beside({}, {}, torch.device("cpu"), None, 4, torch.float32, 1,
                               seconds=0.05)
    assert got == (7.0, 70.0) and abs(t["fill"] - t["cpu"]) < 0.1

    # a failed side raises its own error on the caller's thread, and the other side stops
    def broken(*a, **k):
        raise RuntimeError("no fills")

    monkeypatch.setattr(rates, "measure_fill", broken)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="no fills"):
        rates.measure_beside({}, {}, torch.device("cpu"), None, 4, torch.float32, 1)
    monkeypatch.setattr(rates, "measure_fill", fill)
    monkeypatch.setattr(rates, "measure_executor", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        rates.measure_beside({}, {}, torch.device("cpu"), None, 4, torch.float32, 1)
    assert time.perf_counter() - t0 < 10


def test_a_cached_profile_gets_the_rates_beside_when_asked(monkeypatch, tmp_path):
    class Pool:
        specs = {"w13_weight": type("S", (), {"shape": (8, 4), "dtype": torch.bfloat16})()}
        banks = device_banks = {}
        expert_bytes = 64

    class Executor:
        num_threads = 3
        isa = "avx2"

    cache = str(tmp_path / "bw.json")
    key = rates.machine_key(torch.device("cpu"), 3, "8x4:bfloat16", "avx2")
    rates.store_cached(cache, key, {"B_P": 50.0, "B_H": 100.0, "F_P_us": 2.0,
                                    "F_H_us": 9.0})
    calls = []
    monkeypatch.setattr(rates, "measure_beside",
                        lambda *a, **k: calls.append(a) or (40.0, 80.0))
    got = rates.resolve(None, Pool(), Executor(), torch.device("cpu"), 4, torch.bfloat16,
                        cache)  # the paper's rates: nothing measured
    assert not calls and got.b_p_beside is None
    got = rates.resolve(None, Pool(), Executor(), torch.device("cpu"), 4, torch.bfloat16,
                        cache, beside=True)
    assert len(calls) == 1 and got.split_rates("beside") == (40.0, 120.0)
    assert (got.b_p, got.b_h, got.fixed_us) == (50.0, 100.0, (2.0, 9.0))
    stored = rates.load_cached(cache, key)
    assert stored["B_H_beside"] == 80.0 and stored["F_H_us"] == 9.0 and stored[
        "beside_measured_at"]
    for need in (False, True):  # stored: not measured again
        got = rates.resolve(None, Pool(), Executor(), torch.device("cpu"), 4,
                            torch.bfloat16, cache, beside=need)
        assert len(calls) == 1 and (got.b_p_beside, got.b_h_beside) == (40.0, 80.0)


def test_intercept_of_two_sizes():
    assert rates.intercept(1, 30.0, 4, 60.0) == pytest.approx(20.0)  # 20 + 10 n
    assert rates.intercept(1, 10.0, 8, 80.0) == 0.0  # no fixed cost
    assert rates.intercept(1, 10.0, 8, 100.0) == 0.0  # noise below zero: none


def test_miss_policies():
    q = MissPolicy("qstar", (55.0, 110.0))
    assert q.decode_split == MissSplit(0.5, 1)
    assert q.split_for(SPLIT_MAX_TOKENS) == MissSplit(0.5, 1)
    assert q.split_for(SPLIT_MAX_TOKENS + 1) == FILL_ALL  # prefill-sized calls fill
    assert MissPolicy("fill").decode_split == FILL_ALL
    assert MissPolicy("cpu").decode_split == MissSplit(0.0, 0)
    with pytest.raises(ValueError, match="positive B_P and B_H"):
        MissPolicy("qstar")
    assert MissPolicy("qstar", (55.0, 110.0), admission=True).decode_split == MissSplit(
        0.5, 1, admit_reuse=True)
    assert "admission rule" in MissPolicy("qstar", (55.0, 110.0), admission=True).describe()
    # where B_H <= B_P Eq. 4 fills every miss, but the admission rule's rejects still run on
    # the CPU, and the log says so
    slow_cpu = MissPolicy("qstar", (40.0, 20.0), (10.0, 1.0), 9 << 20, admission=True)
    assert slow_cpu.cpu_count(8) == 0 and slow_cpu.decode_split.may_run_cpu
    assert "the admission rule does not admit run on the CPU" in slow_cpu.describe()
    assert not MissPolicy("qstar", (40.0, 20.0), (10.0, 1.0), 9 << 20).decode_split.may_run_cpu
    with pytest.raises(ValueError, match="needs the qstar miss policy"):
        MissPolicy("fill", admission=True)
    remiss = MissPolicy("qstar", (55.0, 110.0), fill_reused=True)
    assert remiss.decode_split == MissSplit(0.5, 1, fill_reused=True)
    assert "re-miss rule" in remiss.describe()
    both = MissPolicy("qstar", (55.0, 110.0), (10.0, 20.0), 1, admission=True, fill_reused=True)
    split = both.decode_split
    assert (split.fill_ratio, split.admit_reuse, split.fill_reused) == (0.5, True, True)
    assert both.label == "qstar+admission+fill_reused"
    assert both.describe().startswith("qstar with the admission rule (reuse) and the re-miss")
    assert both.describe().endswith("every reused miss filled, the others on the CPU)")
    useful = MissPolicy("qstar", (55.0, 110.0), (10.0, 20.0), 1, admission=True,
                        admit_useful=True)
    assert useful.decode_split.admit_reuse and useful.decode_split.admit_useful
    assert useful.label == "qstar+admission_useful"
    assert useful.describe().startswith("qstar with the admission rule (useful) (B_P 55.0")
    with pytest.raises(ValueError, match="a form of the admission rule"):
        MissPolicy("qstar", (55.0, 110.0), admit_useful=True)
    with pytest.raises(ValueError, match="re-miss rule needs the qstar miss policy"):
        MissPolicy("cpu", fill_reused=True)
    with pytest.raises(ValueError, match="expert's bytes"):
        MissPolicy("qstar", (55.0, 110.0), (1.0, 2.0))
    # the return rule: the per-expert times and fixed costs in the split, its label and text
    ret = MissPolicy("qstar", (50.0, 150.0), (10.0, 20.0), 1_000_000, return_rule=True)
    assert ret.decode_split == MissSplit(1 / 3, 1, 20.0, 10.0, 10.0, 20.0, return_rule=True)
    assert ret.label == "qstar+return_rule"
    assert ret.describe().startswith("qstar and the return rule (B_P 50.0 GB/s")
    remiss_ret = MissPolicy("qstar", (50.0, 150.0), (10.0, 20.0), 1, fill_reused=True,
                            return_rule=True)
    assert remiss_ret.label == "qstar+fill_reused+return_rule"
    for change, why in (({"admission": True}, "give one of them"),
                        ({"fixed_us": None}, "needs the branches' fixed costs"),
                        ({"expert_bytes": 0}, "expert's bytes")):
        args = dict(bandwidth=(50.0, 150.0), fixed_us=(10.0, 20.0), expert_bytes=1,
                    return_rule=True)
        with pytest.raises(ValueError, match=why):
            MissPolicy("qstar", **{**args, **change})
    with pytest.raises(ValueError, match="return rule needs the qstar miss policy"):
        MissPolicy("fill", return_rule=True)
    # the late fill: q* without the at-least-one fill, and decode forwards only
    late = MissPolicy("qstar", (50.0, 150.0), (10.0, 5.0), 1_000_000, late_fill=True)
    assert late.decode_split == MissSplit(1 / 3, 0, 20.0, 10.0, 10.0, 5.0, late_fill=True)
    assert late.split_for(1, decode=False) == MissSplit(1 / 3, 1, 20.0, 10.0, 10.0, 5.0)
    assert late.split_for(1) == late.decode_split and late.label == "qstar+late_fill"
    assert late.cpu_count(1) == 1 and "and the late fill (" in late.describe()
    assert MissPolicy("qstar", (50.0, 150.0), admission=True,
                      late_fill=True).label == "qstar+admission+late_fill"
    every = MissPolicy("qstar", (50.0, 150.0), admission=True, late_fill=True, late_all=True)
    assert every.decode_split == MissSplit(1 / 3, 0, admit_reuse=True, late_fill=True,
                                           late_all=True)
    assert every.label == "qstar+admission+late_fill_all"
    assert "late fill of every admitted CPU run" in every.describe()
    assert every.split_for(1, decode=False) == MissSplit(1 / 3, 1, admit_reuse=True)
    with pytest.raises(ValueError, match="give late_fill too"):
        MissPolicy("qstar", (50.0, 150.0), late_all=True)
    with pytest.raises(ValueError, match="late fill needs the qstar miss policy"):
        MissPolicy("cpu", late_fill=True)
    with pytest.raises(ValueError, match="removes: give one of them"):
        MissPolicy("qstar", (50.0, 150.0), (10.0, 20.0), 1, return_rule=True, late_fill=True)


def test_policy_words_complete_and_build_a_change():
    # a served change in the flags' words: a rule given alone keeps the current policy's other
    # rules, a new miss_policy resets the rules it does not give; words <-> MissPolicy
    from freetoken_sglang.policy.words import PolicyWords

    bw = rates.Bandwidth(50.0, 150.0, "flag", 10.0, 20.0, 40.0, 80.0)
    cand = PolicyWords("qstar", "useful", "valued", "off", "off", "beside").policy(bw, 1 << 20)
    assert cand == MissPolicy("qstar", (40.0, 120.0), (10.0, 20.0), 1 << 20, admission=True,
                              admit_useful=True, fill_reused=True, fill_reused_valued=True,
                              host_rates="beside")
    assert cand.words == PolicyWords("qstar", "useful", "valued", "off", "off", "beside")
    assert PolicyWords(late_fill="all").over(cand) == PolicyWords(
        "qstar", "useful", "valued", "off", "all", "beside")
    assert PolicyWords("qstar", admission="reuse").over(cand) == PolicyWords(
        "qstar", "reuse", "off", "off", "off", "alone")
    assert PolicyWords("fill").over(cand).policy() == MissPolicy("fill")
    for words in (("qstar", "reuse", "on", "off", "all", "alone"),
                  ("qstar", "off", "off", "on", "off", "alone"),
                  ("qstar", "reuse", "off", "off", "on", "beside")):
        assert PolicyWords(*words).policy(bw, 1).words == PolicyWords(*words)
    for policy in (MissPolicy("fill"), MissPolicy("cpu"), cand):
        assert policy.words.policy(bw, policy.expert_bytes) == policy
    assert not PolicyWords().given and PolicyWords(host_rates="alone").given
    with pytest.raises(ValueError, match="late_fill must be one of"):
        PolicyWords(late_fill="maybe")
    with pytest.raises(ValueError, match="miss policy must be one of"):
        PolicyWords("auto")
    with pytest.raises(ValueError, match=r"\['admission'"):
        PolicyWords("qstar").policy(bw, 1)
    with pytest.raises(ValueError, match="needs B_P and B_H"):
        PolicyWords("qstar").over(MissPolicy("fill")).policy()
    with pytest.raises(ValueError, match="B_P,B_H,F_P,F_H,B_P',B_H'"):  # beside not measured
        PolicyWords("qstar", host_rates="beside").over(MissPolicy("fill")).policy(
            rates.Bandwidth(50.0, 150.0, "flag"), 1)


def test_lone_miss_rule_from_measured_costs():
    # S = 10 MB: a fill takes 200 us at B_P = 50 GB/s; beside it the CPU reads at
    # B_H - B_P = 100 GB/s, 100 us per expert; F_H = 250 us, F_P = 10 us.
    S = 10_000_000
    q = MissPolicy("qstar", (50.0, 150.0), (10.0, 250.0), S)
    split = q.decode_split
    assert split.fill_us == pytest.approx(200.0) and split.cpu_us == pytest.approx(100.0)
    # q* = round(m / 3), at least 1. The c = m - q CPU experts stay only if
    # 250 + 100 c < 10 + 200 m:
    #   m=1: q=1, c=0;  m=2: q=1, c=1: 350 < 410 -> kept;  m=3: q=1, c=2: 450 < 610 -> kept.
    assert [q.cpu_count(m) for m in (0, 1, 2, 3, 4)] == [0, 0, 1, 2, 3]
    # A larger fixed cost, F_H = 500 us: m=2 (600 >= 410) and m=3 (700 >= 610) fill all;
    # m=4: q=1, c=3: 800 < 810 -> kept.
    q = MissPolicy("qstar", (50.0, 150.0), (10.0, 500.0), S)
    assert [q.cpu_count(m) for m in (1, 2, 3, 4)] == [0, 0, 0, 3]
    assert "first CPU expert at 4 misses" in q.describe()
    # No residual host bandwidth (B_H = B_P): no division by zero, every miss is filled.
    q = MissPolicy("qstar", (50.0, 50.0), (0.0, 0.0), S)
    assert [q.cpu_count(m) for m in (1, 5, 64)] == [0, 0, 0]
    # A tie (the CPU branch ends exactly when filling all would): fill them all.
    # m=4: q=1, c=3: 510 + 300 = 810 = 10 + 800.
    assert MissPolicy("qstar", (50.0, 150.0), (10.0, 510.0), S).cpu_count(4) == 0
    assert MissPolicy("qstar", (50.0, 150.0), (10.0, 509.0), S).cpu_count(4) == 3
    # Unknown fixed costs: the paper's q* alone.
    assert MissPolicy("qstar", (50.0, 150.0)).cpu_count(2) == 1
    with pytest.raises(ValueError, match="miss policy must be one of"):
        MissPolicy("lru")


def test_host_rates_beside_balance_the_measured_rates():
    # B_P' = 30, B_H' = 90 GB/s beside each other: q*/m = 30 / 120 = 1/4, and Eq. 3's CPU
    # rate beside the fills is B_H' (the lone-miss rule's per-expert time); the valued re-miss
    # rule's B_H/B_P - 1 becomes B_H'/B_P' = 3
    S = 9_000_000
    bw = rates.Bandwidth(40.0, 100.0, "flag", 10.0, 20.0, 30.0, 90.0)
    beside = MissPolicy("qstar", bw.split_rates("beside"), bw.fixed_us, S, admission=True,
                        fill_reused=True, fill_reused_valued=True, host_rates="beside")
    split = beside.decode_split
    assert split.fill_ratio == pytest.approx(0.25)
    assert split.cpu_us == pytest.approx(S / 90e3) and split.fill_us == pytest.approx(S / 30e3)
    assert beside.label == "qstar+admission+fill_reused_valued+beside"
    assert "B_P' 30.0 GB/s, B_H' 90.0 GB/s, q*/m = B_P'/(B_P' + B_H') = 0.250" in (
        beside.describe())
    assert "reach B_H'/B_P' = 3.00" in beside.describe()
    # where the measured rates are what Eq. 3 assumes (B_H' = B_H - B_P, B_P' = B_P), the
    # split is the paper's
    paper = rates.Bandwidth(40.0, 100.0, "flag", 10.0, 20.0, 40.0, 60.0)
    assert (MissPolicy("qstar", paper.split_rates("beside"), paper.fixed_us, S).decode_split
            == MissPolicy("qstar", paper.split_rates("alone"), paper.fixed_us, S).decode_split)
    with pytest.raises(ValueError, match="need the qstar miss policy"):
        MissPolicy("cpu", host_rates="beside")
    with pytest.raises(ValueError, match="alone or beside"):
        MissPolicy("qstar", (1.0, 2.0), host_rates="both")
