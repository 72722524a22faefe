"""End to end on the CPU-run SGLang: a server with ``--enable-freetoken`` and a cache of 25%
of the expert pool gives the same greedy tokens as stock SGLang (fp32) for every supported
family and every miss policy (fill, qstar, cpu, and qstar with the admission or the re-miss
rule or the late fill; one server per family switches among those that differ only in the
policy's runtime keys, ``POST /freetoken/cache``, with SGLang's radix cache flushed between
them), through /generate, the OpenAI completion and chat endpoints and the
Anthropic messages endpoint, including 8 concurrent requests of different lengths (in one batch
request); prefill chunks of 64 tokens, so that the longer prompts stream their layers
(full-layer prefill buffers) over several chunks while decode goes through the LRU; mixed
chunked prefill too; the pure-CPU backend does too; and the tokens equal
transformers' ``generate`` for three families."""

from __future__ import annotations


import time

import pytest
import requests
import torch

from sglang_cpu import start_server

# Ten layers: 25% of the pool holds two full-layer prefill buffers plus an LRU of at least
# top-k slots (2E + k), so prefill streams (cache/layout.py).
FAMILY_SHAPES = {
    "qwen3_moe": dict(num_layers=10, num_experts=16, top_k=4),
    "qwen2_moe": dict(num_layers=10, num_experts=8, top_k=2),
    "mixtral": dict(num_layers=10, num_experts=8, top_k=2),
    "olmoe": dict(num_layers=10, num_experts=16, top_k=4),
    "deepseek_v2": dict(num_layers=10, num_experts=8, top_k=2),
    "deepseek_v3": dict(num_layers=10, num_experts=16, top_k=4),
    "glm4_moe": dict(num_layers=10, num_experts=8, top_k=2),
}
# Several prefill chunks per long prompt, on stock and FreeToken alike.
CHUNK = ["--chunked-prefill-size", "64"]
# OLMoE is left out: stock SGLang 0.5.17 itself differs from transformers on it.
TRANSFORMERS_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")

PROMPTS = [
    [5, 6, 7, 8],
    [100, 20, 3, 44, 51, 60, 7, 8, 9, 10, 11],
    list(range(30, 90)),
    [200 + (i * 7) % 150 for i in range(150)],
]
NEW_TOKENS = 24
# Eight requests at once, different prompt and output lengths.
CONCURRENT = [
    ([(i * 13 + j * 5) % 300 + 20 for j in range(5 + 17 * i)], 8 + 4 * i) for i in range(8)
]


def greedy(url, input_ids, n, top2=None, cached=None):
    """Greedy output ids; with a list ``top2``, appends the top-2 ``(logprob, id)`` pairs of
    every output position; with a list ``cached``, the prompt tokens SGLang's radix cache
    held."""
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": input_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": top2 is not None,
            "top_logprobs_num": 2,
        },
        timeout=300,
    )
    r.raise_for_status()
    body = r.json()
    if top2 is not None:
        top2.append(_top2(body))
    if cached is not None:
        cached.append(body["meta_info"]["cached_tokens"])
    return body["output_ids"]


def _top2(body):
    return [[(lp, tok) for lp, tok, *_ in pos] for pos in body["meta_info"]["output_top_logprobs"]]


def collect(url, logprobs=True):
    """Every endpoint's greedy output; with ``logprobs``, each position's top two logprobs
    too (SGLang does not mix decode rows into prefill chunks of requests that return them);
    ``cached_tokens``: the prompt tokens of /generate's requests that the radix cache held."""
    top2 = [] if logprobs else None
    cached = []
    out = {"sequential": [greedy(url, p, NEW_TOKENS, top2, cached) for p in PROMPTS]}
    # The eight in one request: they reach the scheduler together, so stock and FreeToken
    # batch them alike (from eight threads, arrival order changes the batches, and with
    # them stock SGLang's own fp32 tokens from run to run).
    r = requests.post(
        url + "/generate",
        json={
            "input_ids": [p for p, _ in CONCURRENT],
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for _, n in CONCURRENT
            ],
            "return_logprob": logprobs,
            "top_logprobs_num": 2,
        },
        timeout=300,
    )
    r.raise_for_status()
    out["concurrent"] = [o["output_ids"] for o in r.json()]
    out["cached_tokens"] = {"sequential": cached,
                            "concurrent": [o["meta_info"]["cached_tokens"] for o in r.json()]}
    if logprobs:
        out["top2"] = {"sequential": top2, "concurrent": [_top2(o) for o in r.json()]}
    sp = {"temperature": 0, "max_tokens": 16}
    r = requests.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": "the expert cache holds a slot", **sp},
        timeout=300,
    )
    r.raise_for_status()
    out["completion"] = r.json()["choices"][0]["text"]
    messages = [
        {"role": "system", "content": "you are a coding agent"},
        {"role": "user", "content": "read the file and run the test"},
    ]
    r = requests.post(
        url + "/v1/chat/completions", json={"model": "m", "messages": messages, **sp}, timeout=300
    )
    r.raise_for_status()
    out["chat"] = r.json()["choices"][0]["message"]["content"]
    r = requests.post(
        url + "/v1/messages",
        json={
            "model": "m",
            "max_tokens": 16,
            "temperature": 0,
            "system": "you are a mail agent",
            "messages": [{"role": "user", "content": "move the meeting to tuesday"}],
        },
        timeout=300,
    )
    r.raise_for_status()
    body = r.json()
    out["messages"] = "".join(b["text"] for b in body["content"] if b["type"] == "text")
    out["messages_usage"] = body["usage"]["output_tokens"]
    return out


def transformers_greedy(path, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )
            outs.append(ids[0, len(p):].tolist())
    return outs


CACHE_25 = ["--enable-freetoken", "--freetoken-cache-ratio", "0.25"]
# One policy's server start (tests/test_quantized.py and the half-precision test below start
# fill's).
POLICIES = {
    "fill": ["--freetoken-miss-policy", "fill"],
    "qstar": ["--freetoken-miss-policy", "qstar", "--freetoken-bandwidth", "20,40,0,0"],
    "cpu": ["--freetoken-miss-policy", "cpu"],
}

# The variants whose differences are only the miss policy's runtime keys: one server serves
# them in turn, each after a ``POST /freetoken/cache`` of its body (every body names its
# policy, so no rule carries over from the one before), in this order, so that every one of
# them is a switch (the first from the start's qstar). It starts with qstar, so that it has
# the CPU branch that qstar and cpu need (a server started with fill has none), B_P/B_H = 0.5:
# half of each call's misses are filled, half run on the CPU; no fixed costs
# (F_P = F_H = 0), so the lone-miss rule keeps every split (B_H - B_P = B_P: a CPU expert
# costs what its fill does); the prefill buffers borrowed from the LRU (the default).
SWITCHED_START = POLICIES["qstar"]
SWITCHED = {
    "fill": {"miss_policy": "fill"},
    "qstar": {"miss_policy": "qstar"},
    "cpu": {"miss_policy": "cpu"},
    # q* with the admission rule: misses not used since the LRU slot's last use run on the CPU
    "qstar-admit": {"miss_policy": "qstar", "admission": "reuse"},
    # q* with the re-miss rule: misses used since then are filled, counted in q*
    "qstar-remiss": {"miss_policy": "qstar", "fill_reused": "on"},
    # q* with the admission rule and the late fill of every CPU run it admits (of calls that
    # fill too: at B_P/B_H = 0.5 every call with a miss fills one)
    "qstar-lateall": {"miss_policy": "qstar", "admission": "reuse", "late_fill": "all"},
}
# The variants that need start-time flags: a server of their own each.
STARTED = {
    # the prefill buffers reserved outside the LRU instead of borrowed from it (a start flag:
    # its own server), under the switched server's qstar
    "qstar-reserved": POLICIES["qstar"] + ["--freetoken-prefill-buffers", "reserved"],
    # q* with the late fill: B_P/B_H = 0.1 rounds up to 4 misses to no fill; those run on
    # the CPU and are filled after their call (at the switched server's 0.5 every call with a
    # miss fills one, so the late fill ``on`` would fill nothing there: its own server)
    "qstar-late": ["--freetoken-miss-policy", "qstar", "--freetoken-bandwidth", "5,50",
                   "--freetoken-late-fill", "on"],
    # streamed prefill with half of each layer's non-resident experts on the C executor
    "fill-prefillcpu": ["--freetoken-miss-policy", "fill", "--freetoken-prefill-cpu", "0.5"],
    # ... with the balance rule: B_P = B_H / 2 from the flag, g measured at start
    "fill-prefillauto": ["--freetoken-miss-policy", "fill", "--freetoken-prefill-cpu", "auto",
                         "--freetoken-bandwidth", "20,40"],
}
# The policy label of each variant (``MissPolicy.label``: the switch's answer and its log).
LABELS = {"fill": "fill", "qstar": "qstar", "cpu": "cpu", "qstar-admit": "qstar+admission",
          "qstar-remiss": "qstar+fill_reused", "qstar-lateall": "qstar+admission+late_fill_all",
          "qstar-reserved": "qstar", "qstar-late": "qstar+late_fill",
          "fill-prefillcpu": "fill", "fill-prefillauto": "fill"}

# The admission variant runs on two families of different routing (softmax top-k without
# and sigmoid grouped top-k with a shared expert), the re-miss variant on one; their decision
# is the same code for all. So do the reserved prefill buffers.
ADMIT_FAMILIES = ("qwen3_moe", "deepseek_v3")
REMISS_FAMILIES = ("qwen3_moe",)
LATE_FAMILIES = ("qwen3_moe",)
RESERVED_FAMILIES = ("qwen3_moe", "deepseek_v3")
# The prefill CPU share on a family with plain softmax top-k and on one with grouped sigmoid
# top-k, a shared expert and a routed scaling factor.
PREFILL_CPU_FAMILIES = ("qwen3_moe", "deepseek_v3")
PREFILL_AUTO_FAMILIES = ("qwen3_moe",)
# (CI time) the rules are family-independent decision code: each runs on these families only
VARIANT_FAMILIES = {
    "qstar-admit": ADMIT_FAMILIES, "qstar-remiss": REMISS_FAMILIES,
    "qstar-late": LATE_FAMILIES, "qstar-lateall": LATE_FAMILIES,
    "qstar-reserved": RESERVED_FAMILIES,
    "fill-prefillcpu": PREFILL_CPU_FAMILIES, "fill-prefillauto": PREFILL_AUTO_FAMILIES,
}


def serve_and_collect(path, args, log_path, logprobs=True, collector=None, **server_kw):
    """Start a server with ``args``, collect its outputs (``collector(url)``, default
    ``collect``), its ``/freetoken/stats`` when FreeToken serves, and its log; stop it."""
    server = start_server(path, args, log_path=log_path, **server_kw)
    try:
        out = collector(server.url) if collector else collect(server.url, logprobs)
        stats = None
        if "--enable-freetoken" in args:
            stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    return out, stats, server.log()


def flush_radix_cache(url, wait_s=30.0):
    """SGLang's ``POST /flush_cache``: the next requests prefill (and stream) their prompts
    again. SGLang answers 400 while requests are running or waiting: retried for ``wait_s``."""
    deadline = time.time() + wait_s
    while True:
        r = requests.post(url + "/flush_cache", timeout=60)
        if r.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert r.status_code == 200, f"/flush_cache: {r.status_code} {r.text}"


# The counters of ``/freetoken/stats``, cumulative over the server's life (a policy switch
# keeps them), and the cache's ``late_fills``; ``hit_rate`` and ``layer_id`` are not counts.
COUNTERS = ("total", "decode", "prefill", "layers", "prefill_stream", "forwards")
NOT_COUNTS = ("hit_rate", "layer_id")


def counts_since(before, after):
    """``after``'s ``/freetoken/stats`` with its counters (``COUNTERS``, ``late_fills``) less
    ``before``'s: what was counted between the two (each must have grown or stayed); the
    other fields (policy, slots, layout, bandwidth, ...) are ``after``'s."""

    def sub(a, b, where):
        if isinstance(a, dict):
            # (a count may first appear after, e.g. a forward mode first seen)
            return {k: v if k in NOT_COUNTS else sub(v, b.get(k, 0), f"{where}.{k}")
                    for k, v in a.items()}
        if isinstance(a, list):
            assert len(a) == len(b), where
            return [sub(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b))]
        if isinstance(a, bool) or not isinstance(a, (int, float)):
            return a
        assert a >= b, f"counter {where} went down: {b} -> {a}"
        return a - b

    out = dict(after)
    for key in COUNTERS:
        out[key] = sub(after[key], before[key], key)
    for phase in ("total", "decode", "prefill"):
        t = out[phase]
        t["hit_rate"] = t["hits"] / t["reads"] if t["reads"] else None
    out["cache"] = dict(after["cache"], late_fills=sub(after["cache"]["late_fills"],
                                                       before["cache"]["late_fills"],
                                                       "cache.late_fills"))
    return out


def serve_variants(path, args, variants, log_path):
    """Start one FreeToken server with ``args`` and serve ``variants`` (``(name, body)``
    pairs) in turn: switch to each (``POST /freetoken/cache`` of ``body``; None: the start's
    policy), flush the radix cache and ``collect``. Returns one ``(name, outputs, stats,
    before, answer)`` per variant, where ``stats`` counts what its ``collect`` counted
    (``counts_since``), ``before`` is the stats read after its switch and flush, and
    ``answer`` the switch's answer (None without one), and the server's log."""
    server = start_server(path, args, log_path=log_path)
    results = []
    try:
        for name, body in variants:
            answer = None
            if body is not None:
                r = requests.post(server.url + "/freetoken/cache", json=body, timeout=300)
                assert r.status_code == 200, f"switch to {name} ({body}): {r.text}"
                answer = r.json()
            flush_radix_cache(server.url)
            before = requests.get(server.url + "/freetoken/stats", timeout=60).json()
            out = collect(server.url)
            after = requests.get(server.url + "/freetoken/stats", timeout=60).json()
            results.append((name, out, counts_since(before, after), before, answer))
    finally:
        server.stop()
    return results, server.log()


def assert_variant_stats(variant, stats, log):
    """A variant's ``/freetoken/stats`` (``counts_since``: its settings read after its switch,
    its counters those of its ``collect``): a quarter of the pool, misses served as the
    policy says, prefill streamed."""
    policy = variant.split("-")[0]
    total = stats["total"]
    assert stats["miss_policy"] == policy
    assert stats["admission"] == ("reuse" if variant in ("qstar-admit", "qstar-lateall")
                                  else "off")
    assert stats["fill_reused"] == ("on" if variant == "qstar-remiss" else "off")
    assert stats["late_fill"] == {"qstar-late": "on", "qstar-lateall": "all"}.get(variant, "off")
    assert (stats["cache"]["late_fills"] > 0) == (variant in ("qstar-late", "qstar-lateall"))
    assert stats["cache"]["slots"] == stats["pool"]["experts"] // 4
    assert stats["cache"]["layout"] == "stream"
    buffers = "reserved" if variant == "qstar-reserved" else "borrowed"
    assert stats["cache"]["prefill_buffers"] == buffers
    assert stats["prefill_mode"] == {"mode": "stream", "stream_min_tokens": 5}
    assert set(stats["prefill"]) >= {"reads", "hits", "fills"}  # the LRU's prefill phase
    for phase in ("total", "decode", "prefill"):
        t = stats[phase]
        assert t["reads"] == t["hits"] + t["fills"] + t["cpu"], phase
    assert total["reads"] > 0
    assert len(stats["layers"]) == stats["num_moe_layers"]
    assert sum(layer["reads"] for layer in stats["layers"]) == total["reads"]
    # prefill chunks streamed, outside the LRU (with reserved buffers, decode batches
    # wider than the small LRU ran in waves); borrowed buffers came back holding the last
    # layers' streamed experts
    stream = stats["prefill_stream"]
    assert stream["layer_calls"] > stream["wave_calls"]
    assert stream["experts_streamed"] > 0
    assert (stream["lru_seeded"] > 0) == (buffers == "borrowed")
    assert (stream["bytes_streamed"]
            == stream["experts_streamed"] * stats["pool"]["expert_bytes"])
    if variant == "fill-prefillcpu":
        assert stats["prefill_cpu"]["share"] == 0.5 and stream["experts_cpu"] > 0
        assert "CPU share: 0.5 of each streamed layer" in log
    elif variant == "fill-prefillauto":
        rule = stats["prefill_cpu"]
        assert rule["share"] is None and rule["p_us"] == rule["h0_us"] > 0  # B_H - B_P = B_P
        assert rule["g_us"] > 0 and stream["experts_cpu"] > 0
        assert "CPU share: balance rule" in log
        assert stats["bandwidth"]["ratio"] == 0.5
    else:
        assert stats["prefill_cpu"] == "off" and stream["experts_cpu"] == 0
    if policy == "fill":
        assert total["cpu"] == 0 and total["fills"] > 0 and total["evictions"] > 0
        # the switched server's CPU branch and the prefill CPU share run the C executor (a
        # server started with fill has none: the half-precision test below)
        assert stats["cpu_executor"] is not None
    elif variant == "qstar-late":
        assert total["fills"] > 0 and total["cpu"] > 0
        assert stats["bandwidth"]["ratio"] == 0.1
        assert stats["bandwidth"]["F_P_us"] is None  # the flag gave no fixed costs
    elif policy == "qstar":
        assert total["fills"] > 0 and total["cpu"] > 0
        assert stats["bandwidth"]["ratio"] == 0.5
        assert (stats["bandwidth"]["F_P_us"], stats["bandwidth"]["F_H_us"]) == (0, 0)
    else:
        # decode never fills, and streamed prefill fills nothing through the LRU
        assert total["cpu"] > 0 and total["fills"] == 0


# A greedy token may differ from stock's only where stock's top two logprobs are this close:
# a near-tie that fp32 rounding (another summation order, e.g. the C executor's kernels on
# another CPU's instruction set) can flip. After it the two sequences part, so the rest of
# that request is not compared. A real error (a wrong expert or weight) moves logprobs by far
# more.
TIE = 1e-3


def assert_same_tokens(got, want, label, tie=TIE, max_parted=1, texts=True):
    """``got`` equals ``want`` (``collect``'s results, or only some of its token lists) token
    for token, and FreeToken's
    logprob of each token is stock's within ``tie``; but at most ``max_parted`` requests may
    part where stock's top two logprobs are closer than ``tie`` (the rest of such a request is
    not compared); with ``texts``, the endpoints' texts are equal too."""
    parted = []
    for key in ("sequential", "concurrent"):
        if key not in want:  # (a caller's own token lists)
            continue
        for i, (g, w) in enumerate(zip(got[key], want[key])):
            assert len(g) == len(w), f"{label} {key} request {i}: {len(g)} tokens != stock {len(w)}"
            at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), len(g))
            if "top2" not in want or "top2" not in got:  # no logprobs: token for token
                assert g == w, f"{label} {key} request {i}: {g} != stock {w}"
                continue
            for j in range(at):
                lg, lw = got["top2"][key][i][j][0][0], want["top2"][key][i][j][0][0]
                assert abs(lg - lw) < tie, (
                    f"{label} {key} request {i} position {j}: logprob {lg:.6f} != stock's "
                    f"{lw:.6f}"
                )
            if at == len(g):
                continue
            (lp1, t1), (lp2, t2) = want["top2"][key][i][at][:2]
            # (an exact tie may list stock's own pick second)
            assert {g[at], w[at]} == {t1, t2} and lp1 - lp2 < tie, (
                f"{label} {key} request {i}: {g} != stock {w} from position {at}, where "
                f"stock's top two were {t1} ({lp1:.6f}) and {t2} ({lp2:.6f})"
            )
            parted.append((key, i, at))
    # a near-tie that flips is rare
    assert len(parted) <= max_parted, f"{label}: requests parted at near-ties: {parted}"
    if "messages_usage" not in want:  # token lists only, no endpoint texts
        return
    for key in ("completion", "chat", "messages"):
        assert not texts or got[key] == want[key], f"{label} {key}"
        assert len(got[key]) > 0
    assert got["messages_usage"] == want["messages_usage"] > 0


@pytest.mark.parametrize("family", sorted(FAMILY_SHAPES))
def test_freetoken_matches_stock_sglang(tiny_checkpoint, family, tmp_path):
    """Every variant's tokens are stock's. One server switches among ``SWITCHED`` (the radix
    cache flushed between them, so every variant prefills and streams its prompts again);
    ``STARTED``'s variants have a server each."""
    path = tiny_checkpoint(family, **FAMILY_SHAPES[family])
    want, _, _ = serve_and_collect(path, CHUNK, str(tmp_path / "stock.log"))
    assert want["cached_tokens"]["sequential"] == [0] * len(PROMPTS)  # no shared prefixes
    runs = lambda v: family in VARIANT_FAMILIES.get(v, (family,))
    servers = [("switched", SWITCHED_START, [(v, b) for v, b in SWITCHED.items() if runs(v)])]
    servers += [(v, flags, [(v, None)]) for v, flags in STARTED.items() if runs(v)]
    for name, flags, variants in servers:
        results, log = serve_variants(path, CHUNK + CACHE_25 + flags, variants,
                                      str(tmp_path / f"freetoken-{name}.log"))
        start = flags[flags.index("--freetoken-miss-policy") + 1]
        assert "GPU expert cache" in log and f"decode misses: {start}" in log, name
        assert "2 full-layer prefill buffers" in log, name
        was = start
        for variant, got, stats, before, answer in results:
            label = f"{family} {variant}"
            if answer is not None:  # the switch took: its answer, its log, the stats after it
                assert answer["ok"] and answer["reason"] == "policy", (label, answer)
                assert answer["miss_policy"] == LABELS[variant], (label, answer)
                assert answer["old_slots"] == answer["new_slots"] == stats["cache"]["slots"]
                assert f"decode misses now {LABELS[variant]} (was {was}): " in log, label
                was = LABELS[variant]
            for key in ("miss_policy", "admission", "fill_reused", "late_fill", "host_rates"):
                assert before[key] == stats[key], (label, key)  # the same before and after
            # the radix cache held what a fresh server's does (the flush took): every variant
            # prefilled and streamed its prompts again
            assert got["cached_tokens"] == want["cached_tokens"], label
            assert_same_tokens(got, want, label)
            assert_variant_stats(variant, stats, log)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_match_stock_sglang(tiny_checkpoint, dtype, tmp_path):
    """BF16 and FP16 experts (the pool keeps the checkpoint's dtype), served in that dtype."""
    path = tiny_checkpoint("mixtral", dtype=dtype, **FAMILY_SHAPES["mixtral"])
    flags = ["--dtype", dtype] + CHUNK
    want, _, _ = serve_and_collect(path, flags, str(tmp_path / "stock.log"))
    got, stats, log = serve_and_collect(
        path, flags + CACHE_25 + POLICIES["fill"], str(tmp_path / "ft.log")
    )
    assert f":{dtype}" in log  # the pool's banks are in the checkpoint dtype
    assert_same_tokens(got, want, f"mixtral {dtype}")
    assert stats["total"]["fills"] > 0 and stats["prefill_stream"]["layer_calls"] > 0
    # started with fill: no CPU branch, so no C executor (the families' fill runs on a
    # server started with qstar)
    assert stats["miss_policy"] == "fill" and stats["cpu_executor"] is None


def test_mixed_chunked_prefill_matches_stock_sglang(tiny_checkpoint, tmp_path):
    """--enable-mixed-chunk: decode rows ride in the prefill chunks' forwards; the executor is
    chosen by the forward's rows (execute/choice.py) and reads each row's own routing."""
    path = tiny_checkpoint("qwen3_moe", **FAMILY_SHAPES["qwen3_moe"])
    flags = CHUNK + ["--enable-mixed-chunk"]
    # no logprobs: SGLang mixes no decode rows into the chunks of requests that return them
    want, _, _ = serve_and_collect(path, flags, str(tmp_path / "stock.log"), logprobs=False)
    got, stats, log = serve_and_collect(path, flags + CACHE_25, str(tmp_path / "ft.log"),
                                        logprobs=False)
    assert_same_tokens(got, want, "qwen3_moe mixed chunk")
    assert stats["forwards"]["mixed"] > 0  # decode rows did ride in prefill forwards
    assert stats["prefill_stream"]["layer_calls"] > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_pure_cpu_backend_matches_stock_sglang(tiny_checkpoint, family, tmp_path):
    path = tiny_checkpoint(family, **FAMILY_SHAPES[family])
    want, _, _ = serve_and_collect(path, [], str(tmp_path / "stock.log"))
    got, stats, log = serve_and_collect(
        path, ["--enable-freetoken", "--freetoken-backend", "cpu"], str(tmp_path / "ft.log")
    )
    assert "backend cpu" in log
    assert_same_tokens(got, want, f"{family} cpu backend")
    total = stats["total"]
    assert stats["cache"]["slots"] == 0 and stats["backend"] == "cpu"
    assert total["cpu"] == total["reads"] > 0 and total["fills"] == 0
    from freetoken_sglang.cpu.executor import CpuExpertExecutor

    assert stats["cpu_executor"] == {"isa": CpuExpertExecutor.best_isa(), "threads":
                                     stats["cpu_executor"]["threads"], "tile_min_tokens": None}
    assert stats["cpu_executor"]["threads"] >= 1


@pytest.mark.parametrize("family", TRANSFORMERS_FAMILIES)
def test_freetoken_matches_transformers(tiny_checkpoint, family, tmp_path):
    path = tiny_checkpoint(family, **FAMILY_SHAPES[family])
    want = transformers_greedy(path, PROMPTS, NEW_TOKENS)
    ft = start_server(
        path,
        ["--enable-freetoken", "--freetoken-cache-ratio", "0.25"],
        log_path=str(tmp_path / "freetoken.log"),
    )
    try:
        got = [greedy(ft.url, p, NEW_TOKENS) for p in PROMPTS]
    finally:
        ft.stop()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{family} prompt {i}: {g} != transformers {w}"
