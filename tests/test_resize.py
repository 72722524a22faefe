"""Resizing the GPU expert cache while serving (``cache/resize.py``,
``FreeTokenRuntime.resize_cache``, ``POST /freetoken/cache``): what a resize keeps, the
free-memory rule, and a CPU-run server that shrinks and grows its cache three times under 8
concurrent streaming requests, token for token with stock SGLang."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests
import torch

from freetoken_sglang.cache.residency import ResidencyState, decide
from freetoken_sglang.cache.resize import (check_invariants, install, kept_experts,
                                           kept_fill_clocks,
                                           min_free_target, resize_allowance,
                                           runtime_reserve, shrink_floor)
from freetoken_sglang.control import KEY_ID, from_args, parse_body, to_args
from freetoken_sglang.policy.miss import POLICIES
from test_e2e_families import _top2, assert_same_tokens


def _state_after_calls(num_slots=6, layers=2, experts=8, calls=((0, [1, 2]), (1, [3, 4]),
                                                                (0, [5, 1]), (1, [0, 7]))):
    st = ResidencyState(layers * experts, num_slots, "cpu")
    counters = torch.zeros(5, layers, dtype=torch.int64)
    for ordinal, ids in calls:
        t = torch.tensor([ids], dtype=torch.int32)
        decide(st, counters, ordinal, experts, t, torch.ones(1, len(ids)),
               torch.tensor([1], dtype=torch.int32))
    return st


def test_kept_experts_are_the_most_recently_used_in_lru_order():
    st = _state_after_calls()
    assert check_invariants(st) == []
    # 6 slots, 8 uses: the two oldest (layer 0: 2, layer 1: 3/4) were evicted. Stamps: the
    # call's clock value; within a call, the lower slot first in key order (descending: higher).
    kept = kept_experts(st, 10, 8)
    flats = [f for f, _ in kept]
    stamps = [s for _, s in kept]
    assert stamps == sorted(stamps, reverse=True)
    assert set(flats) == {int(x) for x in st.owner[:6] if x >= 0}
    assert set(flats[:2]) == {8 + 0, 8 + 7} and stamps[:2] == [4, 4]
    assert set(flats[2:4]) == {5, 1} and stamps[2:4] == [3, 3]
    assert kept_experts(st, 3, 8) == kept[:3]


def test_kept_experts_of_an_all_resident_cache_spread_over_the_layers():
    # every expert resident: no recency (all stamps equal), so a shrink keeps the same
    # experts of every layer rather than whole layers
    st = ResidencyState(3 * 4, 12, "cpu")
    st.make_all_resident()
    kept = [f for f, _ in kept_experts(st, 7, 4)]
    assert kept == [0, 4, 8, 1, 5, 9, 2]


def test_install_restores_the_lru_order_in_a_smaller_state():
    st = _state_after_calls()
    kept = kept_experts(st, 3, 8)
    small = ResidencyState(st.num_rows, 3, "cpu")
    filled = kept_fill_clocks(st, kept)
    assert filled == [int(st.filled_at[int(st.residency[f])]) for f, _ in kept]
    assert all(c >= 1 for c in filled)  # every kept expert came in by a fill here
    install(small, None, kept, int(st.clock), filled)
    assert check_invariants(small) == []
    assert int(small.clock) == int(st.clock)
    for slot, (flat, stamp) in enumerate(kept):
        assert int(small.residency[flat]) == slot and int(small.owner[slot]) == flat
        assert int(small.stamp[slot]) == stamp
    assert small.filled_at.tolist() == filled + [-2]  # the useful admission's history
    # the next miss evicts the least recently used of the kept ones (the last in ``kept``)
    counters = torch.zeros(5, 2, dtype=torch.int64)
    decide(small, counters, 0, 8, torch.tensor([[6]], dtype=torch.int32), torch.ones(1, 1),
           torch.tensor([1], dtype=torch.int32))
    assert int(small.residency[kept[-1][0]]) == -1 and int(small.residency[6]) >= 0
    assert check_invariants(small) == []
    with pytest.raises(ValueError, match="do not fit"):
        install(ResidencyState(16, 2, "cpu"), None, kept, 0)


def test_invariant_check_sees_a_broken_state():
    st = _state_after_calls()
    st.residency[int(st.owner[0])] = 5 if int(st.residency[int(st.owner[0])]) != 5 else 4
    assert check_invariants(st)


def test_resize_allowance():
    gib = 1 << 30
    # after start-up SGLang's KV pool leaves about its slack free: a shrink always fits, a
    # grow only into memory beyond the slack
    assert resize_allowance(10 * gib, 14 * gib, 14 * gib) == 10 * gib
    assert resize_allowance(10 * gib, 13 * gib, 14 * gib) == 10 * gib
    assert resize_allowance(10 * gib, 20 * gib, 14 * gib) == 16 * gib


def test_grow_back_after_shrink():
    # The H200 case: SGLang started serving with 21.7 GiB free against a 23.8 GiB slack.
    # After a shrink from 12 to 2 GiB, growing back to 12 GiB must fit; 12.5 must not.
    gib = 1 << 30
    slack, serving = int(23.8 * gib), int(21.7 * gib)
    reserve = runtime_reserve(slack, serving)
    assert reserve == serving and runtime_reserve(slack, None) == slack
    assert runtime_reserve(slack, 30 * gib) == slack
    free_after_shrink = serving + 10 * gib
    allowed = resize_allowance(2 * gib, free_after_shrink, reserve)
    assert allowed == 12 * gib
    assert resize_allowance(2 * gib, free_after_shrink, slack) < 12 * gib  # the old rule


def test_grow_back_after_the_runtime_took_memory_while_serving():
    # The H200 run of session 14 (bytes from its resize answer and nvidia-smi): serving began
    # with 23.51 GiB free; before the shrink 1536 -> 614 slots only 23.43 GiB was free (the
    # runtime had taken 0.08 GiB while serving), and the shrink gave back its 8.104 GiB less
    # 10 MiB that the re-captured graphs took. Growing back to 1536 slots was refused by
    # 0.09 GiB; with the shrink's floor it fits exactly, and one slot more does not.
    gib, mib = 1 << 30, 1 << 20
    slot = 9 * mib
    slack, serving = int(40 * gib), int(23.51 * gib)
    before = int(23.43 * gib)
    freed = (1536 - 614) * slot
    after = before + freed - 10 * mib
    floor = shrink_floor(before, after, freed)
    assert floor == before - 10 * mib
    old_rule = resize_allowance(614 * slot, after, runtime_reserve(slack, serving))
    assert old_rule < 1536 * slot
    allowed = resize_allowance(614 * slot, after, runtime_reserve(slack, serving, floor))
    assert allowed == 1536 * slot
    # another application took 1 GiB after the shrink: the grow back is refused again
    assert resize_allowance(614 * slot, after - gib,
                            runtime_reserve(slack, serving, floor)) < 1536 * slot
    # a floor above the other bounds changes nothing
    assert runtime_reserve(slack, serving, 30 * gib) == serving


def test_min_free_rule():
    gib = 1 << 30
    # 1 GiB slots; 2 GiB free, 5 wanted: shrink by 3, and a margin of one slot (a step of
    # 1 GiB, cut to 256 MiB, but never under a slot)
    assert min_free_target(10, 10, 2, 2 * gib, 5 * gib, gib, 1) == 6
    assert min_free_target(10, 10, 2, 2 * gib, 5 * gib, gib, 2) == 6
    # 64 MiB slots: the margin is one step (2 slots) or 256 MiB (4 slots), the smaller
    mib = 1 << 20
    assert min_free_target(100, 100, 2, 5 * gib - 64 * mib, 5 * gib, 64 * mib, 2) == 97
    assert min_free_target(100, 100, 2, 5 * gib - 64 * mib, 5 * gib, 64 * mib, 20) == 95
    # a few MiB short (what a graph capture keeps) shrinks by the margin, and what the
    # shrink frees is then neither short nor room to grow: no resize after resize
    step = 20
    shrunk = min_free_target(200, 200, 2, 5 * gib - 8 * mib, 5 * gib, 64 * mib, step)
    assert shrunk == 200 - 5
    free_after = 5 * gib - 8 * mib + (200 - shrunk) * 64 * mib - 8 * mib
    assert min_free_target(shrunk, 200, 2, free_after, 5 * gib, 64 * mib, step) is None
    # never below top-k
    assert min_free_target(4, 10, 2, 0, 50 * gib, gib, 1) == 2
    assert min_free_target(2, 10, 2, 0, 50 * gib, gib, 1) is None
    # enough free: stay at the configured size; grow back only by at least the step
    assert min_free_target(10, 10, 2, 50 * gib, 5 * gib, gib, 3) is None
    # grows only with room for two steps, and leaves one step free above the floor
    assert min_free_target(6, 10, 2, 10 * gib, 5 * gib, gib, 3) is None  # room for 5 < 6
    assert min_free_target(6, 10, 2, 11 * gib, 5 * gib, gib, 3) == 9
    assert min_free_target(9, 10, 2, 12 * gib, 5 * gib, gib, 3) == 10
    assert min_free_target(6, 10, 2, 90 * gib, 5 * gib, gib, 3) == 10
    # what a grow leaves free is not under the floor at once
    grown = min_free_target(6, 10, 2, 11 * gib, 5 * gib, gib, 3)
    assert min_free_target(grown, 10, 2, 11 * gib - (grown - 6) * gib, 5 * gib, gib, 3) is None


def test_min_free_watch_acts_on_the_free_memory_measured_after_empty_cache(monkeypatch):
    """The watch's cheap reading (``mem_get_info``) leaves out blocks torch's allocator holds
    unused; it resizes only by what ``_free_for_cache`` (after ``empty_cache``, as the
    reserve was measured) says."""
    from types import SimpleNamespace

    from freetoken_sglang.runtime import FreeTokenRuntime

    gib, mib = 1 << 30, 1 << 20
    reads = {"cheap": 0, "measured": 0}
    resized = []
    rt = SimpleNamespace(
        config=SimpleNamespace(min_free_gb=1.0), device=torch.device("cuda"),
        cache=SimpleNamespace(num_slots=100), _next_watch=0.0, configured_slots=100, top_k=2,
        runtime_reserve_bytes=10 * gib, pool=SimpleNamespace(expert_bytes=64 * mib),
        last_resize=None, _free_for_cache=lambda: reads["measured"],
        resize_cache=lambda slots, reason: resized.append((slots, reason)) or SimpleNamespace(
            as_dict=lambda: {"new_slots": slots}),
    )
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (reads["cheap"], 0))
    # the cheap reading is short (cached activations), the measured one is not: no resize
    reads.update(cheap=11 * gib - 100 * mib, measured=11 * gib + 10 * mib)
    assert FreeTokenRuntime.watch_free_memory(rt, now=1.0) is None and resized == []
    # at most once a second
    reads.update(cheap=0, measured=0)
    assert FreeTokenRuntime.watch_free_memory(rt, now=1.5) is None and resized == []
    # both short by 64 MiB: shrink by it and the margin (a step of 5 slots: 320 MiB, cut to
    # 256 MiB = 4 slots)
    reads.update(cheap=11 * gib - 64 * mib, measured=11 * gib - 64 * mib)
    FreeTokenRuntime.watch_free_memory(rt, now=2.5)
    assert resized == [(95, "min-free")] and rt.last_resize["new_slots"] == 95


def test_resize_bodies():
    assert parse_body({"slots": 1e30}) == {"slots": int(1e30)}  # a JSON parser's big integer
    assert parse_body({"gb": 2}) == {"gb": 2.0} and parse_body({"slots": 7}) == {"slots": 7}


def test_policy_bodies_travel_as_numbers():
    assert parse_body({"miss_policy": "cpu"}) == {"miss_policy": "cpu"}
    for body in ({"slots": 9, "miss_policy": "qstar", "admission": "reuse"},
                 {"gb": 1.5, "fill_reused": "on"}, {"miss_policy": "fill"},
                 {"return_rule": "on", "fill_reused": "on"}, {"late_fill": "on"},
                 {"late_fill": "all", "admission": "reuse"}):
        args = to_args(parse_body(body))
        assert all(type(v) in (int, float) for v in args.values())  # SetInternalStateReq
        assert from_args({KEY_ID: 1, **args}) == parse_body(body)
    assert set(POLICIES) == {"fill", "qstar", "cpu"}  # control's own list
    with pytest.raises(ValueError, match="carries only its size and policy"):
        from_args({KEY_ID: 1, "freetoken_other": 2})


@pytest.mark.parametrize("body", [[], {}, {"gb": 1, "slots": 2}, {"slots": 0}, {"slots": 1.5},
                                  {"gb": -1}, {"gb": "2"}, {"size": 3}, {"slots": True},
                                  {"gb": float("inf")}, {"gb": float("nan")},
                                  {"miss_policy": "lru"}, {"miss_policy": 1},
                                  {"admission": "on"}, {"fill_reused": True},
                                  {"return_rule": "yes"}, {"late_fill": 1},
                                  {"slots": 3, "gb": 1, "miss_policy": "fill"}])
def test_bad_resize_bodies_are_refused(body):
    with pytest.raises(ValueError):
        parse_body(body)


# ---- end to end on the CPU-run SGLang ------------------------------------------------------
SHAPE = dict(num_layers=4, num_experts=16, top_k=4)  # 64 experts in the pool
# shrink and grow three times: 8, 5, 24 and 4 run prefill in waves (less than two full
# layers + k), 40 streams full layers, 64 holds every expert (execute/resident.py), and the
# last 24 shrinks out of it
SIZES = [8, 40, 5, 24, 4, 64, 24]
STREAMED = [([(i * 11 + j * 7) % 300 + 20 for j in range(6 + 9 * i)], 64 + 4 * i)
            for i in range(8)]


def _stream_batch(url, out, marks):
    """The 8 requests as one streaming /generate (so that stock and FreeToken batch them
    alike), with each position's top-2 logprobs; ``out[index]`` gets each request's last
    chunk, ``marks`` the arrival times."""
    r = requests.post(
        url + "/generate",
        json={"input_ids": [p for p, _ in STREAMED],
              "sampling_params": [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                                  for _, n in STREAMED],
              "return_logprob": True, "top_logprobs_num": 2, "stream": True},
        stream=True, timeout=600,
    )
    r.raise_for_status()
    for line in r.iter_lines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        out[chunk.get("index", 0)] = chunk
        marks.append(time.monotonic())


def _run(url, resize):
    """``({"concurrent": ids, "top2": ...}, resize answers, time of the last chunk)``."""
    out, marks, answers = {}, [], []
    t = threading.Thread(target=_stream_batch, args=(url, out, marks))
    t.start()
    if resize:
        while len(marks) < 16 and t.is_alive():  # decode under way for every request
            time.sleep(0.01)
        for size in SIZES:
            r = requests.post(url + "/freetoken/cache", json={"slots": size}, timeout=300)
            stats = requests.get(url + "/freetoken/stats", timeout=60).json()
            answers.append((size, r.status_code, r.json(), time.monotonic(), stats))
    t.join()
    chunks = [out[i] for i in range(len(STREAMED))]
    got = {"concurrent": [c["output_ids"] for c in chunks],
           "top2": {"concurrent": [_top2(c) for c in chunks]}}
    return got, answers, marks[-1] if marks else None


def test_resize_under_load_matches_stock_sglang(tiny_checkpoint, tmp_path):
    from sglang_cpu import start_server

    path = tiny_checkpoint("qwen3_moe", **SHAPE)
    stock = start_server(path, log_path=str(tmp_path / "stock.log"))
    try:
        want, _, _ = _run(stock.url, resize=False)
    finally:
        stock.stop()
    ft = start_server(path, ["--enable-freetoken", "--freetoken-cache-slots", "16"],
                      log_path=str(tmp_path / "ft.log"))
    try:
        got, answers, last_chunk = _run(ft.url, resize=True)
        bad = requests.post(ft.url + "/freetoken/cache", json={"slots": 3}, timeout=60)
        no_branch = requests.post(ft.url + "/freetoken/cache", json={"miss_policy": "qstar"},
                                  timeout=60)
        no_qstar = requests.post(ft.url + "/freetoken/cache", json={"admission": "reuse"},
                                 timeout=60)
        not_json = requests.post(ft.url + "/freetoken/cache", data="slots=3", timeout=60)
        final = requests.get(ft.url + "/freetoken/stats", timeout=60).json()
        log = ft.log()
    finally:
        ft.stop()
    # one batch request: the same batches as stock's; token for token (fp32 near-ties aside)
    assert [len(g) for g in got["concurrent"]] == [n for _, n in STREAMED]
    assert_same_tokens(got, want, "resized under load")
    # every resize was done while the 8 requests were decoding, and said what it did
    assert answers[-1][3] < last_chunk, "the requests ended before the last resize"
    old = 16
    reads_before = 0
    for n, (size, status, body, _, stats) in enumerate(answers, 1):
        assert status == 200 and body["ok"], body
        assert (body["old_slots"], body["new_slots"]) == (old, size)
        assert body["invariant_problems"] == []  # the residency state is sound after it
        assert stats["cache"]["slots"] == size and stats["cache"]["resizes"] == n
        assert stats["cache"]["last_resize"]["id"] == body["id"]
        # a grow keeps every resident expert
        assert body["kept"] <= stats["cache"]["lru_slots"] or stats["cache"]["all_resident"]
        if size > old:
            assert body["dropped"] == 0
        assert body["graphs_recaptured"] == []  # no CUDA graphs on the CPU
        # counters go on across resizes (never reset), and add up for the fill policy
        tot = stats["total"]
        assert tot["reads"] >= reads_before and tot["reads"] == tot["hits"] + tot["fills"]
        assert tot["evictions"] <= tot["fills"]
        reads_before = tot["reads"]
        old = size
    shrink = [a[2] for a in answers if a[2]["new_slots"] < a[2]["old_slots"]]
    assert len(shrink) == 4 and shrink[0]["kept"] == 4  # 16 -> 8: 4 LRU slots + 4 for waves
    assert answers[-2][2]["layout"] == "every expert resident"
    # out of it: every LRU slot kept (by kept_experts' order: the same share of every layer)
    assert shrink[-1]["kept"] == answers[-1][4]["cache"]["lru_slots"] == 18
    # a size below top-k is refused with a one-line reason; the cache is unchanged
    assert bad.status_code == 400 and "top-4" in bad.json()["error"]
    # a policy that needs the CPU branch, or a rule without q*, is refused; nothing changed
    assert no_branch.status_code == 400
    assert "started without the CPU branch" in no_branch.json()["error"]
    assert no_qstar.status_code == 400
    assert no_qstar.json()["error"] == "the admission rule needs the qstar miss policy"
    assert final["miss_policy"] == "fill" and final["admission"] == "off"
    assert not_json.status_code == 400
    assert not_json.json()["error"].startswith("the body is not JSON (")
    assert not_json.json()["error"].endswith('send {"gb": G} or {"slots": N}, and/or '
                                             '{"miss_policy": "fill"|"qstar"|"cpu"} with '
                                             '"admission": "off"|"reuse"|"useful" and/or '
                                             '"fill_reused": "off"|"on"|"valued", and/or '
                                             '"return_rule": '
                                             '"off"|"on", '
                                             '"late_fill": "off"|"on"|"all", '
                                             '"host_rates": "alone"|"beside"')
    assert final["cache"]["slots"] == 24 and final["cache"]["resizes"] == len(SIZES)
    assert log.count("GPU expert cache resized (request)") == len(SIZES)


PROMPTS = [[(i * 13 + j * 5) % 300 + 20 for j in range(10 + 7 * i)] for i in range(3)]


def _generate(url):
    """Greedy tokens of ``PROMPTS`` (24 each, one batch) and the decode counters after."""
    r = requests.post(url + "/generate", json={
        "input_ids": PROMPTS,
        "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}},
        timeout=600)
    r.raise_for_status()
    stats = requests.get(url + "/freetoken/stats", timeout=60).json()
    return [o["output_ids"] for o in r.json()], stats


def test_miss_policy_changes_while_serving(tiny_checkpoint, tmp_path):
    """A server started with qstar serves cpu, qstar with the admission rule (and the re-miss
    rule, then its valued form, then with the host rates beside each other), the return rule,
    the late fill and fill after
    ``POST /freetoken/cache`` changes them, each with the tokens qstar gave (fp32: every
    policy is stock's, tests/test_e2e_families.py) and the counters each policy leaves.
    B_P / B_H = 0.1: q* rounds up to 4 misses to no fill; the late fill (all) fills every CPU
    run after its call."""
    from sglang_cpu import start_server

    path = tiny_checkpoint("qwen3_moe", **SHAPE)
    ft = start_server(path, ["--enable-freetoken", "--freetoken-cache-slots", "16",
                             "--freetoken-miss-policy", "qstar", "--freetoken-bandwidth",
                             "5,50,0,0,5,20"], log_path=str(tmp_path / "ft.log"))
    post = lambda body: requests.post(ft.url + "/freetoken/cache", json=body, timeout=300)
    try:
        want, s0 = _generate(ft.url)
        to_cpu = post({"miss_policy": "cpu"})
        got_cpu, s1 = _generate(ft.url)
        to_admit = post({"miss_policy": "qstar", "admission": "reuse"})
        got_admit, s2 = _generate(ft.url)
        both = post({"fill_reused": "on"})  # the admission rule kept: exactly reused fill
        got_both, s2b = _generate(ft.url)
        to_useful = post({"admission": "useful"})  # the re-miss rule kept
        got_useful, s2u = _generate(ft.url)
        to_valued = post({"fill_reused": "valued"})  # the useful admission kept
        got_valued, s2v = _generate(ft.url)
        to_beside = post({"host_rates": "beside"})  # q*/m = 5 / (5 + 20), the rules kept
        got_beside, s2h = _generate(ft.url)
        with_admit = post({"return_rule": "on"})  # the admission rule kept: refused
        # a new policy resets the rules not given, the host rates too
        to_return = post({"miss_policy": "qstar", "return_rule": "on"})
        got_return, s2r = _generate(ft.url)
        with_return = post({"late_fill": "on"})  # the return rule kept: refused
        to_late = post({"return_rule": "off", "late_fill": "all"})
        got_late, s2l = _generate(ft.url)
        to_fill = post({"miss_policy": "fill", "slots": 24})
        got_fill, s3 = _generate(ft.url)
        log = ft.log()
    finally:
        ft.stop()
    d = lambda a, b, k: b["decode"][k] - a["decode"][k]
    assert s0["miss_policy"] == "qstar" and d(s0, s0, "reads") == 0
    assert to_cpu.status_code == 200, to_cpu.text
    a = to_cpu.json()
    assert (a["miss_policy"], a["old_slots"], a["new_slots"]) == ("cpu", 16, 16)
    assert a["reason"] == "policy" and s1["cache"]["configured_slots"] == 16
    assert got_cpu == want and s1["miss_policy"] == "cpu"
    assert d(s0, s1, "cpu") > 0 and d(s0, s1, "fills") == 0  # decode never fills under cpu
    assert to_admit.status_code == 200 and to_admit.json()["miss_policy"] == "qstar+admission"
    assert got_admit == want and (s2["miss_policy"], s2["admission"]) == ("qstar", "reuse")
    assert d(s1, s2, "cpu") > 0
    assert both.status_code == 200 and both.json()["miss_policy"] == "qstar+admission+fill_reused"
    assert got_both == want and (s2b["admission"], s2b["fill_reused"]) == ("reuse", "on")
    assert d(s2, s2b, "reads") > 0
    assert to_useful.status_code == 200, to_useful.text
    assert to_useful.json()["miss_policy"] == "qstar+admission_useful+fill_reused"
    assert got_useful == want and (s2u["admission"], s2u["fill_reused"]) == ("useful", "on")
    assert d(s2b, s2u, "reads") > 0
    assert to_valued.status_code == 200, to_valued.text
    assert to_valued.json()["miss_policy"] == "qstar+admission_useful+fill_reused_valued"
    assert got_valued == want and (s2v["admission"], s2v["fill_reused"]) == ("useful", "valued")
    assert d(s2u, s2v, "reads") > 0
    assert to_beside.status_code == 200, to_beside.text
    assert to_beside.json()["miss_policy"] == "qstar+admission_useful+fill_reused_valued+beside"
    assert got_beside == want and (s2h["fill_reused"], s2h["host_rates"]) == ("valued", "beside")
    assert (s2v["host_rates"], s2h["bandwidth"]["B_H_beside"]) == ("alone", 20.0)
    assert (s2v["bandwidth"]["split_ratio"], s2h["bandwidth"]["split_ratio"]) == (0.1, 0.2)
    assert d(s2v, s2h, "reads") > 0
    s2 = s2h
    assert to_return.status_code == 200, to_return.text
    assert with_admit.status_code == 400 and "give one of them" in with_admit.json()["error"]
    assert to_return.json()["miss_policy"] == "qstar+return_rule"
    assert got_return == want and (s2r["admission"], s2r["return_rule"]) == ("off", "on")
    assert (s2r["fill_reused"], s2r["host_rates"]) == ("off", "alone")
    assert d(s2, s2r, "reads") > 0 and 0 <= s2r["cache"]["return_rate"] <= 1
    assert with_return.status_code == 400 and "give one of them" in with_return.json()["error"]
    assert to_late.status_code == 200
    assert to_late.json()["miss_policy"] == "qstar+late_fill_all"
    assert got_late == want and (s2l["return_rule"], s2l["late_fill"]) == ("off", "all")
    # CPU runs were filled after their calls: those of decode forwards (all, without the
    # admission rule; the prompts' short prefill is counted with decode but fills nothing late)
    late = s2l["cache"]["late_fills"] - s2r["cache"]["late_fills"]
    assert 0 < late <= d(s2r, s2l, "cpu")
    assert s2r["cache"]["late_fills"] == 0
    s2 = s2l
    assert to_fill.status_code == 200 and to_fill.json()["new_slots"] == 24
    assert to_fill.json()["reason"] == "request" and s3["cache"]["configured_slots"] == 24
    assert got_fill == want and (s3["miss_policy"], s3["admission"]) == ("fill", "off")
    assert d(s2, s3, "cpu") == 0 and d(s2, s3, "fills") > 0
    assert "decode misses now cpu (was qstar): " in log
    assert "decode misses now qstar+admission+fill_reused (was qstar+admission): " in log
    assert ("decode misses now qstar+admission_useful+fill_reused (was "
            "qstar+admission+fill_reused): ") in log
    assert ("decode misses now qstar+admission_useful+fill_reused_valued (was "
            "qstar+admission_useful+fill_reused): ") in log
    assert ("decode misses now qstar+admission_useful+fill_reused_valued+beside (was "
            "qstar+admission_useful+fill_reused_valued): " in log)
    assert "q*/m = B_P'/(B_P' + B_H') = 0.200" in log
    assert ("decode misses now qstar+return_rule (was "
            "qstar+admission_useful+fill_reused_valued+beside): " in log)
    assert "decode misses now qstar+late_fill_all (was qstar+return_rule): " in log
    assert "decode misses now fill (was qstar+late_fill_all): " in log


def test_a_failed_bandwidth_measurement_refuses_the_change():
    """A change to qstar that must measure B_P and B_H and cannot is a refusal (ValueError:
    the serving loop answers 400 and keeps the old policy), whatever the measurement raised."""
    from types import SimpleNamespace

    from freetoken_sglang.policy.miss import MissPolicy
    from freetoken_sglang.policy.words import PolicyWords
    from freetoken_sglang.runtime import FreeTokenRuntime

    asked = []

    def fail(beside=False):
        asked.append(beside)
        raise NotADirectoryError("/root/.cache/freetoken")

    rt = SimpleNamespace(policy=MissPolicy("cpu"), cpu_branch=object(), _resolve_bandwidth=fail,
                         pool=SimpleNamespace(expert_bytes=1024))
    with pytest.raises(ValueError, match="NotADirectoryError.*--freetoken-bandwidth B_P,B_H"):
        FreeTokenRuntime._policy_for(rt, PolicyWords("qstar"))
    with pytest.raises(ValueError, match="NotADirectoryError.*--freetoken-bandwidth "
                                         "B_P,B_H,F_P,F_H,B_P',B_H' "):
        FreeTokenRuntime._policy_for(rt, PolicyWords("qstar", host_rates="beside"))
    assert asked == [False, True]
    assert FreeTokenRuntime._policy_for(rt, PolicyWords("fill")) == MissPolicy("fill")
    rt.cpu_branch = None  # a server started with fill
    with pytest.raises(ValueError, match="started without the CPU branch"):
        FreeTokenRuntime._policy_for(rt, PolicyWords("cpu"))
