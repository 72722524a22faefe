"""``--freetoken-record-routing``: a CPU-run server writes every step's routing to a trace,
and replaying the steps that went through the LRU (the executor choice of each step) through
the cache's own decision reproduces the server's counters exactly (so the recorded ids are
the ones the layers routed)."""

from __future__ import annotations

import requests
import torch

from freetoken_sglang.cache.residency import ResidencyState, decide
from freetoken_sglang.execute.choice import ExecutorChoice
from freetoken_sglang.observe.routing_trace import RoutingTrace
from sglang_cpu import start_server


def test_recorded_trace_replays_to_the_server_counters(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("olmoe", num_layers=4, num_experts=16, top_k=4)
    trace_path = str(tmp_path / "routing.npz")
    server = start_server(
        path,
        ["--enable-freetoken", "--freetoken-cache-ratio", "0.25", "--freetoken-miss-policy",
         "fill", "--freetoken-record-routing", trace_path],
        log_path=str(tmp_path / "server.log"),
    )
    try:
        for prompt, n in (([5, 6, 7, 8], 10), (list(range(40, 130)), 6)):
            r = requests.post(
                server.url + "/generate",
                json={"input_ids": prompt,
                      "sampling_params": {"max_new_tokens": n, "ignore_eos": True}},
                timeout=300,
            )
            r.raise_for_status()
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    trace = RoutingTrace.load(trace_path)
    assert (trace.num_layers, trace.num_experts, trace.top_k) == (4, 16, 4)
    steps = [(p, ids.shape[0]) for p, ids in trace]
    # The two requests (SGLang's /health probes add 1-token requests of their own).
    assert ("prefill", 4) in steps and ("prefill", 90) in steps
    first = steps.index(("prefill", 4))
    assert steps[first + 1 : first + 10] == [("decode", 1)] * 9
    second = steps.index(("prefill", 90))
    assert steps[second + 1 : second + 6] == [("decode", 1)] * 5
    # Replay the LRU's layer calls through the device decision with the server's LRU size;
    # the other calls ran in waves (a quarter of this pool is less than two layers + k).
    L, E = trace.num_layers, trace.num_experts
    cache = stats["cache"]
    assert cache["layout"] == "waves" and stats["prefill_stream"]["wave_calls"] > 0
    choice = ExecutorChoice("gpu", cache["layout"], cache["lru_slots"], E, trace.top_k,
                            stats["prefill_mode"]["stream_min_tokens"])
    state = ResidencyState(L * E, cache["lru_slots"], "cpu")
    counters = torch.zeros(5, L, dtype=torch.int64)
    replayed = 0
    for phase, ids in trace:
        forward = "decode" if phase == "decode" else "extend"
        if choice.executor_for(ids.shape[0], forward) != "decode":
            continue
        replayed += 1
        nv = torch.tensor([ids.shape[0]], dtype=torch.int32)
        for layer in range(L):
            layer_ids = torch.from_numpy(ids[:, layer, :].astype("int64"))
            decide(state, counters, layer, E, layer_ids, torch.ones(layer_ids.shape), nv)
    assert replayed >= 14  # the decode steps at least
    for i, field in enumerate(("reads", "hits", "fills", "evictions", "cpu")):
        assert counters[i].tolist() == [layer[field] for layer in stats["layers"]], field
