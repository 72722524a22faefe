"""Bandwidth profiling: ``python -m freetoken_sglang.profile`` measures B_P and B_H for a
model's expert shape and caches them; ``--freetoken-bandwidth`` and the cache are what a
server uses, in that order."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from freetoken_sglang import bandwidth
from freetoken_sglang.miss_policy import SPLIT_MAX_TOKENS, MissPolicy
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
    stored = json.loads(cache.read_text())
    assert stored[result["key"]]["B_H"] == result["B_H"]
    assert "threads=1" in result["key"] and "expert=64x64:float32" in result["key"]
    assert f"isa={result['isa']}" in result["key"]


def test_flag_parsing():
    assert bandwidth.parse_flag("55, 90.5") == (55.0, 90.5)
    assert bandwidth.parse_flag("55,90,4,0") == (55.0, 90.0, 4.0, 0.0)
    for bad in ("55", "a,b", "0,4", "1,2,3", "-1,4", "5,9,-1,2", "1,2,3,4,5"):
        with pytest.raises(ValueError, match="B_P,B_H"):
            bandwidth.parse_flag(bad)


def test_resolve_prefers_flag_then_cache(tmp_path):
    class Pool:
        specs = {"w13_weight": type("S", (), {"shape": (8, 4), "dtype": torch.bfloat16})()}

    class Executor:
        num_threads = 3
        isa = "avx2"

    cache = str(tmp_path / "bw.json")
    got = bandwidth.resolve((10.0, 40.0), Pool(), Executor(), torch.device("cpu"), 4,
                            torch.bfloat16, cache)
    assert (got.b_p, got.b_h, got.ratio) == (10.0, 40.0, 0.25) and "flag" in got.source
    assert got.fixed_us is None  # a flag without fixed costs: no lone-miss rule
    got = bandwidth.resolve((10.0, 40.0, 3.0, 20.0), Pool(), Executor(), torch.device("cpu"),
                            4, torch.bfloat16, cache)
    assert got.fixed_us == (3.0, 20.0)
    key = bandwidth.machine_key(torch.device("cpu"), 3, "8x4:bfloat16", "avx2")
    bandwidth.store_cached(cache, key, {"B_P": 50.0, "B_H": 100.0, "F_P_us": 2.0,
                                        "F_H_us": 9.0})
    got = bandwidth.resolve(None, Pool(), Executor(), torch.device("cpu"), 4, torch.bfloat16, cache)
    assert (got.b_p, got.b_h) == (50.0, 100.0) and got.source == f"cache {cache}"
    assert got.fixed_us == (2.0, 9.0)


def test_intercept_of_two_sizes():
    assert bandwidth.intercept(1, 30.0, 4, 60.0) == pytest.approx(20.0)  # 20 + 10 n
    assert bandwidth.intercept(1, 10.0, 8, 80.0) == 0.0  # no fixed cost
    assert bandwidth.intercept(1, 10.0, 8, 100.0) == 0.0  # noise below zero: none


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
