"""``--freetoken-replay-routing`` (benchmarks only): the MoE layers route to a trace's ids, row
after row, and the server's counters are then exactly ``benchmarks/replay.py``'s on that
routing."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch

from freetoken_sglang.errors import RefusedError
from freetoken_sglang.observe.routing_replay import RoutingReplay, layer_map
from freetoken_sglang.observe.routing_trace import RoutingTrace
from sglang_cpu import start_server
from test_replay import R as REPLAY

E, K = 16, 4


def _synthetic(path, rows=50, layers=2, seed=3, **meta):
    """A trace unlike any router's: random distinct ids, one 20-row prefill, then decode."""
    rng = np.random.default_rng(seed)
    ids = np.stack([[rng.permutation(E)[:K] for _ in range(layers)] for _ in range(rows)])
    phase, ntok = [0] + [1] * (rows - 20), [20] + [1] * (rows - 20)
    RoutingTrace(phase, ntok, ids, E, meta={"synthetic": True, "note": "test", **meta}).save(path)
    return ids


def test_layer_map_spreads_trace_layers_evenly():
    assert layer_map(2, 4) == [0, 0, 1, 1]
    assert layer_map(4, 48)[::12] == [0, 1, 2, 3] and layer_map(4, 48)[-1] == 3
    assert layer_map(6, 6) == list(range(6))


def test_ids_follow_the_cursor_cyclically(tmp_path):
    ids = _synthetic(str(tmp_path / "t.npz"))
    rp = RoutingReplay(str(tmp_path / "t.npz"), 4, E, K, "cpu")
    like = torch.zeros(3, K, dtype=torch.int32)
    assert torch.equal(rp.ids_for(3, like), torch.from_numpy(ids[0:3, 1]).int())
    rp.advance(48)
    got = rp.ids_for(0, like)
    assert torch.equal(got, torch.from_numpy(ids[[48, 49, 0], 0]).int())
    rp.reset()
    assert torch.equal(rp.ids_for(0, like[:1]), torch.from_numpy(ids[0:1, 0]).int())
    dec = RoutingReplay(str(tmp_path / "t.npz"), 4, E, K, "cpu", phase="decode")
    assert dec.num_rows == 30 and torch.equal(dec.ids_for(0, like[:1]),
                                              torch.from_numpy(ids[20:21, 0]).int())


@pytest.mark.parametrize("experts,top_k", [(8, K), (E, K + 1)])
def test_a_trace_of_other_experts_or_smaller_top_k_is_refused(tmp_path, experts, top_k):
    _synthetic(str(tmp_path / "t.npz"))
    with pytest.raises(RefusedError, match="record or train the trace with the model's"):
        RoutingReplay(str(tmp_path / "t.npz"), 4, experts, top_k, "cpu")


def test_a_larger_top_k_replays_its_highest_ranked_ids(tmp_path):
    _synthetic(str(tmp_path / "u.npz"))  # ids_ranked not claimed: its top-2 is unknown
    with pytest.raises(RefusedError, match="not marked as in rank order"):
        RoutingReplay(str(tmp_path / "u.npz"), 2, E, 2, "cpu")
    ids = _synthetic(str(tmp_path / "t.npz"), ids_ranked=True)
    rp = RoutingReplay(str(tmp_path / "t.npz"), 2, E, 2, "cpu")
    got = rp.ids_for(1, torch.zeros(3, 2, dtype=torch.int32))
    assert torch.equal(got, torch.from_numpy(ids[0:3, 1, :2]).int())
    assert "2 highest-ranked of the trace's top-4" in rp.describe()
    assert (rp.snapshot()["trace_top_k"], rp.snapshot()["top_k"]) == (K, 2)


def test_replayed_ids_reach_the_layers_and_the_counters_equal_replay_py(tiny_checkpoint,
                                                                        tmp_path):
    path = tiny_checkpoint("olmoe", num_layers=4, num_experts=E, top_k=K)
    synth = str(tmp_path / "synthetic.npz")
    ids = _synthetic(synth)
    rec = str(tmp_path / "recorded.npz")
    server = start_server(
        path,
        ["--enable-freetoken", "--freetoken-cache-ratio", "0.25", "--freetoken-prefill", "lru",
         "--freetoken-replay-routing", synth, "--freetoken-record-routing", rec],
        log_path=str(tmp_path / "server.log"),
    )
    try:
        for prompt, n in (([5, 6, 7, 8], 30), (list(range(40, 70)), 6), (None, 0), ([9, 10], 3)):
            if prompt is None:  # a resize to the same size: the replay starts again at row 0
                before = requests.get(server.url + "/freetoken/stats", timeout=60).json()
                r = requests.post(server.url + "/freetoken/cache", json={"slots": 16},
                                  timeout=300)
                r.raise_for_status()
                continue
            r = requests.post(server.url + "/generate", json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": n,
                                                         "ignore_eos": True}}, timeout=300)
            r.raise_for_status()
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    assert "ROUTING REPLAYED (benchmark only" in server.log()
    trace = RoutingTrace.load(rec)
    n = trace.ids.shape[0]
    first = before["routing_replay"]["rows_used"]  # the rows before the resize
    assert first >= 4 + 29 + 30 + 5 > ids.shape[0]  # round the trace at least once
    assert n - first >= 2 + 2  # the last request's prompt and decode steps
    # what the layers routed to: the trace's rows in order, trace layer l*2//4 for layer l,
    # and from row 0 again after the resize
    rows = np.concatenate([np.arange(first) % ids.shape[0], np.arange(n - first)])
    want = ids[rows][:, [0, 0, 1, 1]]
    assert np.array_equal(trace.ids, want)
    assert stats["routing_replay"]["rows_used"] == n
    assert stats["routing_replay"]["layer_map"] == [0, 0, 1, 1]
    # every layer call went through the LRU (--freetoken-prefill lru, 16 slots >= any call):
    # the device LRU's counters are replay.py's global LRU on that routing
    assert stats["cache"]["layout"] == "lru" and stats["cache"]["lru_slots"] == 16
    counts = REPLAY.run_policy(REPLAY.build_calls(trace), "global-lru", 16)
    # (the server's phases split layer calls at 64 rows, replay.py's by step phase: totals)
    assert counts.decode_reads + counts.prefill_reads == stats["total"]["reads"] > 0
    assert counts.decode_misses + counts.prefill_misses == stats["total"]["fills"] > 0
    for field in ("reads", "hits", "fills", "evictions"):
        assert counts.per_layer[field].tolist() == [l[field] for l in stats["layers"]], field
