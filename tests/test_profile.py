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


def test_flag_parsing():
    assert bandwidth.parse_flag("55, 90.5") == (55.0, 90.5)
    for bad in ("55", "a,b", "0,4", "1,2,3", "-1,4"):
        with pytest.raises(ValueError, match="B_P,B_H"):
            bandwidth.parse_flag(bad)


def test_resolve_prefers_flag_then_cache(tmp_path):
    class Pool:
        specs = {"w13_weight": type("S", (), {"shape": (8, 4), "dtype": torch.bfloat16})()}

    class Executor:
        num_threads = 3

    cache = str(tmp_path / "bw.json")
    got = bandwidth.resolve((10.0, 40.0), Pool(), Executor(), torch.device("cpu"), 4,
                            torch.bfloat16, cache)
    assert (got.b_p, got.b_h, got.ratio) == (10.0, 40.0, 0.25) and "flag" in got.source
    key = bandwidth.machine_key(torch.device("cpu"), 3, "8x4:bfloat16")
    bandwidth.store_cached(cache, key, {"B_P": 50.0, "B_H": 100.0})
    got = bandwidth.resolve(None, Pool(), Executor(), torch.device("cpu"), 4, torch.bfloat16, cache)
    assert (got.b_p, got.b_h) == (50.0, 100.0) and got.source == f"cache {cache}"


def test_miss_policies():
    q = MissPolicy("qstar", (55.0, 110.0))
    assert q.decode_split == MissSplit(0.5, 1)
    assert q.split_for(SPLIT_MAX_TOKENS) == MissSplit(0.5, 1)
    assert q.split_for(SPLIT_MAX_TOKENS + 1) == FILL_ALL  # prefill-sized calls fill
    assert MissPolicy("fill").decode_split == FILL_ALL
    assert MissPolicy("cpu").decode_split == MissSplit(0.0, 0)
    with pytest.raises(ValueError, match="positive B_P and B_H"):
        MissPolicy("qstar")
    with pytest.raises(ValueError, match="miss policy must be one of"):
        MissPolicy("lru")
