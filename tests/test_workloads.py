"""Tests of the scripted agent workloads, their context edits, and a smoke run of the serving benchmark against a CPU SGLang server with FreeToken."""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import serve_bench as sb  # noqa: E402
from benchmarks import workloads as wl  # noqa: E402

SMOKE_SCALE = 0.01
SMOKE_DECODE = 3


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from freetoken_sglang.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen3_moe", str(tmp_path_factory.mktemp("wl") / "qwen3_moe"))


@pytest.fixture(scope="module")
def tok(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


# ---------------------------------------------------------------------------------------
# Workload construction
# ---------------------------------------------------------------------------------------


def test_sizes_at_scale_1_match_the_documented_ones():
    w1, w2, w4 = (wl.build(n) for n in wl.WORKLOADS)
    s1, s2, s4 = w1.sizes(), w2.sizes(), w4.sizes()
    assert s1["requests"] == 1 and w1.decode_tokens == [1536]
    assert 230 <= s1["first_prompt"] <= 270
    # W2: 3 user turns, 14 tool calls + 3 answers, ~8.9k floor, ~30k final context
    assert s2["requests"] == 17
    assert sum(1 for m in w2.script if m["role"] == "user") == 3
    assert sum(1 for m in w2.script if m["role"] == "tool") == 14
    assert 8_000 <= s2["floor"] <= 9_500
    assert 28_000 <= s2["final_context"] <= 33_000
    assert 100 <= s2["decode_min"] and s2["decode_max"] <= 800
    # W4: 13 user turns, ~24.5k floor
    assert s4["requests"] == 20
    assert sum(1 for m in w4.script if m["role"] == "user") == 13
    assert 24_000 <= s4["floor"] <= 25_000
    assert s4["first_prompt"] - s4["floor"] < 50  # the first user turn is short
    assert 30_000 <= s4["final_context"] <= 34_000
    # every assistant turn carries a thinking segment; tool calls come with tool outputs
    for w in (w2, w4):
        for m in w.script:
            if m["role"] == "assistant":
                assert m["content"].startswith("<think>\n") and "\n</think>\n\n" in m["content"]
        calls = [tc["id"] for m in w.script for tc in m.get("tool_calls") or []]
        outs = [m["tool_call_id"] for m in w.script if m["role"] == "tool"]
        assert calls == outs


def test_workloads_are_deterministic_per_seed():
    a, b, c = wl.build("W2", 0.1, seed=0), wl.build("W2", 0.1, seed=0), wl.build("W2", 0.1, seed=1)
    assert a.script == b.script and a.tools == b.tools and a.decode_tokens == b.decode_tokens
    assert a.script != c.script


def test_scale_shrinks_sizes_and_decode():
    big, small = wl.build("W4", 1.0), wl.build("W4", 0.05)
    assert len(small.decode_tokens) == len(big.decode_tokens)
    assert small.sizes()["floor"] < 0.1 * big.sizes()["floor"]
    assert all(2 <= s <= b for s, b in zip(small.decode_tokens, big.decode_tokens))
    assert wl.build("W1", 0.01).decode_tokens == [15]
    reqs = small.requests(decode_cap=3)
    assert [r.max_tokens for r in reqs] == [3] * 20


def test_request_body_is_streaming_with_ignore_eos():
    r = wl.build("W2", 0.01).requests()[0]
    b = r.body("m")
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert b["ignore_eos"] is True and b["max_tokens"] == r.max_tokens
    assert b["tools"] and b["messages"][0]["role"] == "system"
    assert [m["role"] for m in b["messages"]] == ["system", "user"]


# ---------------------------------------------------------------------------------------
# Rendering with the tiny model's chat template
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["W2", "W4"])
def test_rendered_prompts_grow_as_scripted(tok, name):
    w = wl.build(name, 0.25)
    reqs = w.requests("none")
    ids = [wl.render_ids(tok, r) for r in reqs]
    nominal = w.sizes()["prompts"]
    for i in range(1, len(ids)):
        # without edits each prompt extends the previous one: the prefix cache can reuse it
        assert ids[i][: len(ids[i - 1])] == ids[i - 1], i
        grew, scripted = len(ids[i]) - len(ids[i - 1]), nominal[i] - nominal[i - 1]
        # the tiny 384-entry BPE spends ~3 tokens per nominal token
        assert 2.0 * scripted <= grew <= 4.5 * scripted, (i, grew, scripted)
    first = tok.decode(ids[0])
    assert first.startswith("<|im_start|>system" + w.script[0]["content"][:40])
    assert "# Tools" in first and '"name": "%s"' % w.tools[0]["function"]["name"] in first
    assert first.endswith("<|im_start|>assistant")


def test_render_matches_server_processing_of_tool_calls(tok):
    r = wl.build("W2", 0.01).requests("none")[2]
    text = wl.render_text(tok, r)
    # arguments are parsed to objects and re-serialized by the template, as SGLang does
    call = r.messages[2]["tool_calls"][0]["function"]
    assert '{"name": "%s", "arguments": %s}' % (call["name"], call["arguments"]) in text
    assert text.count("<tool_response>") == 2 and text.count("<tool_call>") == 2
    assert '"strict": false' in text  # SGLang's pydantic Tool dump


def _shared_prefix_bounds(tok, req, k):
    """Token counts of the rendering of the first k and k+1 messages of ``req``."""
    def n(msgs):
        m, t = wl.server_view(msgs, req.tools)
        return len(tok.encode(tok.apply_chat_template(m, tools=t, tokenize=False), add_special_tokens=False))
    return n(req.messages[:k]), n(req.messages[: k + 1])


@pytest.mark.parametrize("name,edits", [("W4", "drop_thinking"), ("W2", "placeholder:2"), ("W2", "last_n:3")])
def test_edits_move_the_reusable_prefix_to_the_edited_message(tok, name, edits):
    reqs = wl.build(name, 0.05).requests(edits)
    changed = 0
    for prev, cur in zip(reqs, reqs[1:]):
        a, b = wl.render_ids(tok, prev), wl.render_ids(tok, cur)
        shared = wl.common_prefix(a, b)
        k = next((i for i, (x, y) in enumerate(zip(prev.messages, cur.messages)) if x != y), None)
        if k is None:  # nothing edited: the whole previous prompt is reused
            assert shared == len(a)
            continue
        changed += 1
        lo, hi = _shared_prefix_bounds(tok, cur, k)
        assert lo <= shared < hi, (cur.index, k, lo, shared, hi)
    assert changed >= 3


# ---------------------------------------------------------------------------------------
# Context edits
# ---------------------------------------------------------------------------------------


def _conv():
    def asst(i, call=True):
        m = {"role": "assistant", "content": f"<think>\nplan {i}\nmore {i}\n</think>\n\nvisible {i}"}
        if call:
            m["tool_calls"] = [{"id": f"c{i}", "type": "function",
                                "function": {"name": "read", "arguments": json.dumps({"p": i})}}]
        return m

    msgs = [{"role": "system", "content": "sys <think>not a turn</think>"},
            {"role": "user", "content": "task <think>x</think>"}]
    for i in range(6):
        msgs.append(asst(i))
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"out {i}\nline2\nline3"})
    msgs.append({"role": "user", "content": "next"})
    msgs.append(asst(6, call=False))
    msgs.append({"role": "user", "content": "again"})
    return msgs


def test_drop_thinking_strips_exactly_older_thinking_blocks():
    msgs = _conv()
    out = wl.drop_thinking(msgs)
    assert len(out) == len(msgs)
    last = max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    for i, (a, b) in enumerate(zip(msgs, out)):
        if a["role"] != "assistant" or i == last:
            assert a == b, i  # users, tools, system and the latest assistant turn unchanged
        else:
            n = int(a["content"].split("visible ")[1])
            assert b["content"] == f"visible {n}"
            assert {k: v for k, v in a.items() if k != "content"} == {k: v for k, v in b.items() if k != "content"}
    assert out[last]["content"].startswith("<think>\nplan 6")
    assert msgs == _conv()  # the input is not modified


def test_placeholder_replaces_exactly_the_tool_outputs_outside_the_window():
    msgs = _conv()
    out = wl.placeholder_old_tool_outputs(msgs, window=2)
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    for i, (a, b) in enumerate(zip(msgs, out)):
        if i in tools[:-2]:
            assert b["content"] == wl.OPENCODE_PLACEHOLDER
            assert b["tool_call_id"] == a["tool_call_id"] and b["role"] == "tool"
        else:
            assert a == b, i
    assert wl.placeholder_old_tool_outputs(msgs, window=10) == msgs
    assert all(m["content"] == wl.OPENCODE_PLACEHOLDER
               for m in wl.placeholder_old_tool_outputs(msgs, window=0) if m["role"] == "tool")
    assert msgs == _conv()


def test_last_n_observations_elides_exactly_the_older_ones():
    msgs = _conv()
    out = wl.keep_last_observations(msgs, n=3)
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    for i, (a, b) in enumerate(zip(msgs, out)):
        if i in tools[:-3]:
            assert b["content"] == "Old environment output: (3 lines omitted)"
            assert b["tool_call_id"] == a["tool_call_id"]
        else:
            assert a == b, i
    # polling: the cut moves only every 2 observations
    elided = lambda o: sum(m["content"].startswith("Old environment") for m in o)  # noqa: E731
    assert elided(wl.keep_last_observations(msgs, n=3, polling=2)) == 2
    assert elided(wl.keep_last_observations(msgs, n=2, polling=2)) == 4
    assert msgs == _conv()


def test_edit_specs_parse_compose_and_select():
    assert wl.parse_edits("placeholder:3+drop_thinking") == ("placeholder:3", "drop_thinking")
    assert wl.parse_edits("none") == () and wl.parse_edits(None) == ()
    for bad in ("nope", "drop_thinking:3", "last_n:x"):
        with pytest.raises(ValueError):
            wl.parse_edits(bad)
    msgs = _conv()
    both = wl.apply_edits(msgs, ("placeholder:1", "drop_thinking"))
    assert both == wl.drop_thinking(wl.placeholder_old_tool_outputs(msgs, window=1))
    # defaults: W2 is OpenCode's placeholder, W4 OpenClaw's drop_thinking; selectable
    w2, w4 = wl.build("W2", 0.01), wl.build("W4", 0.01)
    assert w2.default_edits == ("placeholder",) and w4.default_edits == ("drop_thinking",)
    for w in (w2, w4):
        for edits in (None, "last_n:2", "none"):
            for r, j in zip(w.requests(edits), w.reply_indices):
                eds = w.default_edits if edits is None else wl.parse_edits(edits)
                assert r.edits == eds
                assert r.messages == wl.apply_edits(w.script[:j], eds)
    # with a window of 4, the 5th tool output of W2 pushes the first out of it
    r = w2.requests()[5]
    assert [m["content"] for m in r.messages if m["role"] == "tool"][0] == wl.OPENCODE_PLACEHOLDER


# ---------------------------------------------------------------------------------------
# Report helpers
# ---------------------------------------------------------------------------------------


def test_summary_and_stats_delta():
    recs = [
        {"ttft_s": 1.0, "decode_tok_s": 10.0, "tpot_ms": 100.0, "prompt_tokens": 100,
         "cached_tokens": 0, "prefill_tokens": 100, "completion_tokens": 5, "error": None},
        {"ttft_s": 3.0, "decode_tok_s": 30.0, "tpot_ms": 33.0, "prompt_tokens": 150,
         "cached_tokens": 100, "prefill_tokens": 50, "completion_tokens": 5, "error": None},
        {"ttft_s": None, "decode_tok_s": None, "tpot_ms": None, "prompt_tokens": None,
         "cached_tokens": None, "prefill_tokens": None, "completion_tokens": None, "error": "x"},
    ]
    s = sb.summarize(recs)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["mean_ttft_s"] == 2.0 and s["worst_ttft_s"] == 3.0 and s["mean_decode_tok_s"] == 20.0
    assert s["prompt_tokens"] == 250 and s["cached_tokens"] == 100 and s["prefill_tokens"] == 150
    assert s["cached_fraction"] == pytest.approx(0.4)
    before = {"total": {"reads": 10, "hits": 4, "fills": 6, "evictions": 2, "cpu": 0},
              "decode": {"reads": 4, "hits": 1, "fills": 3, "evictions": 1, "cpu": 0},
              "layers": [{"layer_id": 0, "reads": 10, "hits": 4, "fills": 6, "evictions": 2,
                          "cpu": 0}]}
    after = {"total": {"reads": 32, "hits": 19, "fills": 11, "evictions": 5, "cpu": 2},
             "decode": {"reads": 10, "hits": 5, "fills": 3, "evictions": 1, "cpu": 2},
             "layers": [{"layer_id": 0, "reads": 32, "hits": 19, "fills": 11, "evictions": 5,
                         "cpu": 2}]}
    d = sb.stats_delta(before, after)
    assert d["total"] == {"reads": 22, "hits": 15, "fills": 5, "evictions": 3, "cpu": 2,
                          "hit_rate": 15 / 22}
    assert d["decode"] == {"reads": 6, "hits": 4, "fills": 0, "evictions": 0, "cpu": 2,
                           "hit_rate": 4 / 6}
    assert d["layers"] == [{"layer_id": 0, "reads": 22, "hits": 15, "fills": 5, "evictions": 3,
                            "cpu": 2}]
    assert sb.stats_delta(None, after) is None


def test_freetoken_stats_is_none_without_the_route():
    # nothing listens on this port: treated like a stock server (no counters)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert sb.freetoken_stats(f"http://127.0.0.1:{port}") is None


# ---------------------------------------------------------------------------------------
# Smoke run against a real CPU server with FreeToken
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def freetoken_server(tiny_model, tmp_path_factory):
    from sglang_cpu import start_server

    log_path = str(tmp_path_factory.mktemp("srv") / "server.log")
    server = start_server(
        tiny_model,
        ["--enable-cache-report", "--enable-freetoken", "--freetoken-cache-ratio", "0.25"],
        log_path=log_path,
        max_running_requests=4,
    )
    try:
        yield server.url
    finally:
        server.stop()


def test_serve_bench_smoke_run_with_freetoken(freetoken_server, tiny_model, tmp_path):
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    rc = sb.main(["--base-url", freetoken_server, "--workloads", "W1,W2,W4",
                  "--scale", str(SMOKE_SCALE), "--decode-cap", str(SMOKE_DECODE),
                  "--label", "freetoken", "--tokenizer", tiny_model,
                  "--out-json", str(out_json), "--out-md", str(out_md)])
    assert rc == 0
    run = json.loads(out_json.read_text())
    recs = run["requests"]
    expected = {n: len(wl.build(n, SMOKE_SCALE).requests()) for n in wl.WORKLOADS}
    assert expected == {"W1": 1, "W2": 17, "W4": 20}
    assert {n: sum(r["workload"] == n for r in recs) for n in wl.WORKLOADS} == expected
    for r in recs:
        assert r["error"] is None
        assert r["ttft_s"] > 0 and r["decode_tok_s"] > 0 and r["e2e_s"] >= r["ttft_s"]
        assert r["completion_tokens"] == r["max_tokens"] == SMOKE_DECODE  # ignore_eos
        # the local rendering is what the server prefilled
        assert r["prompt_tokens"] == r["local_prompt_tokens"]
        assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
    for name in ("W2", "W4"):
        rs = [r for r in recs if r["workload"] == name]
        assert rs[0]["cached_tokens"] == 0  # the cache was flushed before the workload
        for r in rs[1:]:
            # radix-cache reuse: at least the prefix shared with the previous request
            assert r["cached_tokens"] > 0
            assert r["cached_tokens"] >= r["shared_prefix_tokens"] > 0
        assert 0 < run["workloads"][name]["summary"]["prefill_tokens"] < run["workloads"][name]["summary"]["prompt_tokens"]
    w2 = [r["prompt_tokens"] for r in recs if r["workload"] == "W2"]
    assert all(b > a for a, b in zip(w2, w2[1:])), w2
    assert run["workloads"]["W2"]["edits"] == ["placeholder"]
    assert run["workloads"]["W4"]["edits"] == ["drop_thinking"]
    s = run["summary"]
    assert s["requests"] == 38 and s["errors"] == 0
    assert s["worst_ttft_s"] >= s["mean_ttft_s"] > 0 and s["mean_decode_tok_s"] > 0
    # FreeToken counters: the run's difference and each workload's
    ft = run["freetoken"]["delta"]["total"]
    assert ft["reads"] > 0 and 0 <= ft["hit_rate"] <= 1
    assert ft["reads"] == sum(run["workloads"][n]["freetoken"]["total"]["reads"] for n in wl.WORKLOADS)
    for n in wl.WORKLOADS:
        assert run["workloads"][n]["freetoken"]["total"]["reads"] > 0
    md = out_md.read_text()
    assert "| freetoken | W2 | placeholder | 17 |" in md
    assert md.count("| freetoken | W4 |") == 1 + 20
