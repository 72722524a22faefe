"""benchmarks/train_router.py on a tiny config on the CPU: a loss curve with the stated
tokens, and routing traces in the routing-trace format, labelled a small model's routing."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import torch

from freetoken_sglang.observe.routing_trace import PHASES, RoutingTrace

from test_replay import REPO, _load  # noqa: E402


def test_train_router_tiny_cpu(tmp_path):
    tr = _load("ft_bench_train_router", "benchmarks/train_router.py")
    out = tmp_path / "run"
    E, k, L, tokens, seq, batch = 8, 2, 2, 512, 64, 2
    argv = [
        "--out", str(out), "--device", "cpu", "--dtype", "fp32", "--seed", "0",
        "--experts", str(E), "--top-k", str(k), "--layers", str(L), "--hidden", "32",
        "--moe-intermediate", "16", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--seq-len", str(seq), "--batch", str(batch), "--tokens", str(tokens), "--vocab", "400",
        "--corpus-max-bytes", "200000", "--session-seeds", "1", "--session-scale", "0.02",
        "--log-every", "2", "--val-batches", "1", "--time-budget-s", "20",
        "--trace-sessions", "W2", "--trace-scale", "0.01", "--max-requests", "2",
        "--decode-cap", "4", "--prefill-chunk", "1024",
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tr.main(argv)
    finally:
        torch.set_num_threads(threads)

    curve = json.loads((out / "loss_curve.json").read_text())
    assert curve["tokens_trained"] == tokens == curve["steps"] * batch * seq
    pts = curve["points"]
    assert len(pts) >= 2 and pts[-1]["tokens"] == tokens
    for p in pts[1:]:
        for key in ("train_loss", "val_loss", "aux_loss", "load_entropy", "experts_for_90pct"):
            assert p[key] is not None and math.isfinite(p[key]), (key, p)
        assert 0 < p["load_entropy"] <= 1 and 0 < p["experts_for_90pct"] <= 1
    assert math.isfinite(curve["final_val_loss"])
    assert "not Qwen3" in curve["note"]

    trace = RoutingTrace.load(str(out / "trace_W2.npz"))
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (L, E, k)
    assert trace.num_steps >= 4
    phases = set()
    for phase, ids in trace:
        phases.add(phase)
        assert ids.shape[1:] == (L, k) and ids.shape[0] >= 1
        assert ids.min() >= 0 and ids.max() < E
        if phase == "decode":
            assert ids.shape[0] == 1
        # a token's k experts are distinct at every layer
        assert (np.sort(ids, axis=-1)[..., 1:] != np.sort(ids, axis=-1)[..., :-1]).all()
    assert phases == set(PHASES)
    m = trace.meta
    assert m["small_model"] is True and m["synthetic"] is False
    assert "small model's routing" in m["note"] and "not Qwen3's" in m["note"]
    assert m["tokens_trained"] == tokens and math.isfinite(m["final_val_loss"])
    assert m["config"]["num_experts"] == E and m["workload"] == "W2"
    reqs = m["requests"]
    assert len(reqs) == 2 and reqs[1]["cached_prefix"] > 0  # turn 2 reuses turn 1's prefix
    assert int(trace.num_tokens[trace.phase == 0].sum()) == sum(r["prefill_tokens"] for r in reqs)
    assert int((trace.phase == 1).sum()) == sum(r["decode_steps"] for r in reqs) == 2 * 3

    # benchmarks/replay.py reads it
    replay = _load("ft_bench_replay_tr", "benchmarks/replay.py")
    calls = replay.build_calls(trace)
    assert calls.num_experts == E

    report = (out / "report.md").read_text()
    assert "not Qwen3's" in report and "trace_W2.npz" in report and f"{tokens:,}" in report
    assert not (out / "model").exists()  # no weights without --save-weights
