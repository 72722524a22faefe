"""Semantic anchors (paper §3.1): markers found in token ids, the per-request plan of chunk
cuts and kept states, the flags and the ServerArgs they imply."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from freetoken_sglang import config as ft
from freetoken_sglang.errors import RefusedError
from freetoken_sglang.anchors.markers import (DEFAULT_MARKERS, find_markers, marker_ids,
                                              parse_markers)
from freetoken_sglang.anchors.plan import next_cut, plan


def test_markers_are_found_at_their_start_and_may_be_several_tokens():
    markers = [(7,), (3, 4)]  # a one-token marker and a two-token opener
    ids = [1, 7, 2, 3, 4, 3, 5, 7, 3, 4]
    assert find_markers(ids, markers) == [1, 3, 7, 8]  # 3 not followed by 4 is no marker


def test_marker_ids_come_from_the_tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3_moe"))
    ids = marker_ids(tok, DEFAULT_MARKERS)
    assert ids == [(tok.convert_tokens_to_ids(m),) for m in DEFAULT_MARKERS]
    # a plain-text marker encodes to several tokens
    (several,) = marker_ids(tok, ["tool result:"])
    assert len(several) > 1 and several == tuple(tok.encode("tool result:",
                                                            add_special_tokens=False))
    assert parse_markers(" <think> ,</think>") == ("<think>", "</think>")
    assert parse_markers("<think>,</think>,<think>") == ("<think>", "</think>")  # each once
    for bad in ("<think>,,", ""):
        with pytest.raises(RefusedError, match="non-empty markers"):
            parse_markers(bad)
    with pytest.raises(RefusedError, match="not in the model's tokenizer"):
        marker_ids(SimpleNamespace(unk_token_id=0, encode=lambda m, **kw: [0]), ["<x>"])


def test_a_special_looking_marker_of_several_tokens_is_warned_about(tiny_checkpoint, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint("qwen3_moe"))
    with caplog.at_level(logging.WARNING, logger="freetoken_sglang.anchors.markers"):
        marker_ids(tok, ["<think>", "tool result:"])
    assert not caplog.records  # a special token, and plain text of several tokens
    with caplog.at_level(logging.WARNING, logger="freetoken_sglang.anchors.markers"):
        (ids,) = marker_ids(tok, ["<thnk>"])
    assert len(ids) > 1
    assert [r.getMessage() for r in caplog.records] == [
        f"FreeToken anchors: marker '<thnk>' is not one token of the model's tokenizer (it "
        f"matches as the text of {len(ids)} tokens); check it against the chat template's "
        "special tokens (--freetoken-anchor-tokens sets the list)"]


def test_plan_cuts_at_every_marker_beyond_the_prefix_with_distance_one():
    p = plan([3, 10, 11, 40], prefix_len=10, prompt_len=50, min_distance=1)
    assert p.cuts == (11, 40)  # 3 lies in the prefix; 10 is the prefix's own state
    assert p.keep == (10, 11, 40)
    assert next_cut(p.cuts, 10) == 11 and next_cut(p.cuts, 11) == 40
    assert next_cut(p.cuts, 40) is None


def test_plan_merges_close_markers_into_the_prefix_the_cut_or_the_prompt_end():
    # the turn boundary right after the matched prefix, a tool output at 140 with markers
    # 2 and 5 tokens later, the closing markers 6 tokens before the prompt end
    p = plan([103, 105, 140, 142, 145, 200, 201, 203], prefix_len=100, prompt_len=206,
             min_distance=32)
    assert p.cuts == (140,)
    assert p.keep == (100, 140, 206)
    # no matched prefix: markers close to the start are dropped, not kept at 0
    p = plan([2, 5, 60], prefix_len=0, prompt_len=200, min_distance=32)
    assert p.cuts == (60,) and p.keep == (60,)


def test_plan_without_cuts_keeps_only_the_prefix_and_the_prompt_end_near_markers():
    positions = [103, 105, 140, 142, 145, 200, 201, 203]
    p = plan(positions, prefix_len=100, prompt_len=206, min_distance=32, cuts_on=False)
    assert p.cuts == () and p.keep == (100, 206)
    # markers far from both ends: nothing kept; no prefix: the prompt end alone
    assert plan([150], 100, 206, 32, cuts_on=False).keep == ()
    assert plan([2, 190], 0, 206, 32, cuts_on=False).keep == (206,)


def test_anchor_cuts_follow_the_mode_and_where_the_experts_are():
    from freetoken_sglang.anchors.book import resolve_mode

    assert resolve_mode("auto", experts_on_gpu=True) == "on"
    assert resolve_mode("auto", experts_on_gpu=False) == "inside"
    assert resolve_mode("on", experts_on_gpu=False) == "on"
    assert resolve_mode("off", experts_on_gpu=True) == "off"
    with pytest.raises(ValueError, match="choose one of auto, on, inside, off"):
        resolve_mode("sometimes", experts_on_gpu=True)


def test_anchor_cuts_follow_a_resize_under_auto_only():
    from freetoken_sglang.anchors.book import Anchors

    auto = Anchors(["<a>"], [(1,)], 32, None)
    auto.follow_experts(False)  # not attached yet: nothing to follow
    assert auto.mode == "on"
    auto.attach(object(), 64, 8, 1000, experts_on_gpu=False)
    assert auto.mode == "inside"
    auto.follow_experts(True)  # a resize made every expert resident
    assert auto.mode == "on"
    auto.follow_experts(False)  # and a shrink moved them off again
    assert auto.mode == "inside"
    fixed = Anchors(["<a>"], [(1,)], 32, None, cuts="on")
    fixed.attach(object(), 64, 8, 1000, experts_on_gpu=False)
    fixed.follow_experts(False)
    assert fixed.mode == "on"


def test_a_flush_counts_the_states_it_drops():
    """``/flush_cache`` resets the tree: its pinned states count as flushed, so that
    kept - evicted - flushed stays the states held."""
    from freetoken_sglang.anchors.states import AnchorStates

    st = AnchorStates(None, 4, 100)
    st.pinned[1], st.pinned[2] = (None, None), (None, None)  # (node, lock params)
    st.kept, st.evicted = 3, 1
    st.reset()
    snap = st.snapshot()
    assert (snap["states_flushed"], snap["states_held"], snap["states_kept"]) == (2, 0, 3)
    assert snap["states_kept"] - snap["states_evicted"] - snap["states_flushed"] == 0


def test_anchor_budget_must_fit_the_mamba_pool():
    from freetoken_sglang.anchors.book import Anchors, default_budget

    assert default_budget(64, 8) == 24
    # RefusedError: the scheduler's start ends with the one-line refusal, not a traceback
    with pytest.raises(RefusedError, match="do not fit the mamba pool of 64 states .*at most 48"):
        Anchors(["<a>"], [(1,)], 32, 49).attach(object(), 64, 8, 1000, experts_on_gpu=False)
    with pytest.raises(RefusedError, match="lower --freetoken-anchor-states"):
        Anchors(["<a>"], [(1,)], 32, None).attach(object(), 16, 8, 1000, experts_on_gpu=False)


def test_anchor_flags():
    cfg = ft.pop_config({"enable_freetoken": True})
    assert cfg.anchors is None and cfg.anchor_min_distance == 32 and cfg.anchor_cuts == "auto"
    assert cfg.anchors_enabled(hybrid=True) and not cfg.anchors_enabled(hybrid=False)
    assert cfg.anchor_marker_list() == DEFAULT_MARKERS
    cfg = ft.pop_config({"enable_freetoken": True, "freetoken_anchor_tokens": "<a>,<b>",
                         "freetoken_anchor_states": 4})
    assert cfg.anchor_marker_list() == ("<a>", "<b>") and cfg.anchor_states == 4
    off = ft.pop_config({"enable_freetoken": True, "freetoken_anchors": "off"})
    assert not off.anchors_enabled(hybrid=True)
    for kw, needle in [
        ({"freetoken_anchors": "off", "freetoken_anchor_states": 4},
         "--freetoken-anchor-states has no effect with --freetoken-anchors off"),
        ({"freetoken_anchors": "off", "freetoken_anchor_cuts": "on"},
         "--freetoken-anchor-cuts has no effect with --freetoken-anchors off"),
        ({"freetoken_backend": "cpu", "freetoken_anchors": "off", "freetoken_anchor_cuts": "on"},
         "--freetoken-anchor-cuts has no effect with --freetoken-anchors off"),
        ({"freetoken_backend": "cpu", "freetoken_anchor_tokens": ","}, "non-empty markers"),
        ({"freetoken_anchor_tokens": ","}, "non-empty markers"),
        ({"freetoken_anchor_tokens": ""}, "non-empty markers"),
        ({"freetoken_anchors": "maybe"}, "invalid choice 'maybe'"),
    ]:
        with pytest.raises(ValueError, match=needle):
            ft.pop_config({"enable_freetoken": True, **kw})


def test_anchor_server_args(tiny_checkpoint):
    hybrid = tiny_checkpoint("qwen3_next")
    dense = tiny_checkpoint("qwen3_moe")
    on = ft.pop_config({"enable_freetoken": True, "freetoken_anchors": "on"})
    default = ft.pop_config({"enable_freetoken": True})
    kw = ft.apply_server_args_overrides({"model_path": hybrid, "device": "cpu"}, default)
    assert kw["mamba_radix_cache_strategy"] == "no_buffer"
    assert kw["disable_overlap_schedule"] is True
    kw = ft.apply_server_args_overrides({"model_path": dense, "device": "cpu"}, default)
    assert "mamba_radix_cache_strategy" not in kw
    for model, extra, needle in [
        (dense, {}, "applies to hybrid models .* only"),
        (hybrid, {"mamba_radix_cache_strategy": "extra_buffer"},
         "need --mamba-radix-cache-strategy no_buffer .*not extra_buffer"),
        (hybrid, {"disable_radix_cache": True}, "drop --disable-radix-cache"),
        (hybrid, {"chunked_prefill_size": -1}, "drop --chunked-prefill-size -1"),
        (hybrid, {"enable_deterministic_inference": True},
         "drop --enable-deterministic-inference"),
        (hybrid, {"enable_hierarchical_cache": True}, "drop --enable-hierarchical-cache"),
    ]:
        with pytest.raises(ValueError, match=needle + ".*--freetoken-anchors off|" + needle):
            ft.apply_server_args_overrides({"model_path": model, "device": "cpu", **extra}, on)
    off = ft.pop_config({"enable_freetoken": True, "freetoken_anchors": "off"})
    kw = ft.apply_server_args_overrides(
        {"model_path": hybrid, "device": "cpu", "disable_radix_cache": True}, off)
    assert "mamba_radix_cache_strategy" not in kw
    # an anchor flag on a non-hybrid model is refused, not dropped
    cuts = ft.pop_config({"enable_freetoken": True, "freetoken_anchor_cuts": "off"})
    with pytest.raises(ValueError, match="--freetoken-anchor-cuts applies to hybrid models"):
        ft.apply_server_args_overrides({"model_path": dense, "device": "cpu"}, cuts)
    # without cuts, anchors end no chunk: one-chunk prefill is allowed
    kw = ft.apply_server_args_overrides(
        {"model_path": hybrid, "device": "cpu", "chunked_prefill_size": -1}, cuts)
    assert kw["mamba_radix_cache_strategy"] == "no_buffer"


# ---- anchor states inside a forward, against the recurrence run up to each anchor -------


def _fake_gdn(monkeypatch, chunk_states: bool, device: str = "cpu"):
    """A gated-DeltaNet layer on SGLang's kernels (the CPU stand-in's on the CPU, the Triton
    conv and chunked delta rule on CUDA), called as ``GDNAttnBackend.forward_extend`` is
    (``original(backend, layer, batch, x, a, b)``), with slot-indexed conv and recurrent
    states; its dispatcher returns the chunk-start states ``h`` or not."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    if device == "cpu":
        from sgl_kernel.mamba import causal_conv1d_fn_cpu as conv_fn
        from sgl_kernel.mamba import chunk_gated_delta_rule_cpu

        monkeypatch.setenv("SGL_STUB_GDN_CHUNK_STATES", "1" if chunk_states else "0")
        H, K, dtype = 2, 4, torch.float32

        def kernel(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **_):
            return chunk_gated_delta_rule_cpu(q, k, v, g, beta, ssm_states, query_start_loc,
                                              False, True, cache_indices)
    else:
        from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
        from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_fn as conv_fn

        triton_extend = TritonGDNKernel().extend
        H, K, dtype = 2, 64, torch.bfloat16

        def kernel(*args, **kw):
            o, final, h = triton_extend(*args, **kw)
            return o, final, h if chunk_states else None

    g = torch.Generator().manual_seed(0)
    slots, D = 32, 3 * H * K
    weight = torch.randn(D, 4, generator=g).div(2).to(device, dtype)
    conv = torch.zeros(slots, D, 3, device=device, dtype=dtype)
    ssm = torch.zeros(slots, H, K, K, device=device)

    def original(backend, layer, batch, x, a, b, **_):
        meta = backend.forward_metadata
        y = conv_fn(x=x.T, weight=weight, bias=None, activation="silu",
                    conv_states=conv, has_initial_state=batch.extend_prefix_lens > 0,
                    cache_indices=meta.mamba_cache_indices,
                    query_start_loc=meta.query_start_loc,
                    seq_lens_cpu=batch.extend_seq_lens_cpu).T
        q, k, v = (t.reshape(1, -1, H, K) for t in y.split(H * K, dim=-1))
        return backend.kernel_dispatcher.extend(
            q, k, v, -F.softplus(a.float())[None], torch.sigmoid(b.float())[None],
            ssm_states=ssm, cache_indices=meta.mamba_cache_indices,
            query_start_loc=meta.query_start_loc)[0]

    class Dispatcher:  # a class method, as SGLang's kernel dispatchers have
        def extend(self, *args, **kw):
            return kernel(*args, **kw)

    cache = SimpleNamespace(conv=[conv], temporal=ssm)
    backend = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(mamba2_layer_cache=lambda layer_id: cache),
        kernel_dispatcher=Dispatcher())
    return backend, original, conv, ssm


def check_inside_states(monkeypatch, chunk_states: bool, device: str = "cpu",
                        rtol: float = 1e-5):
    """``anchors.inside.replay`` after the stock call of a two-sequence extend, each sequence
    taking anchor states: the first from no prefix (70 tokens), the second after a prefix of
    5 (200 tokens), at anchors 1 and 2 tokens into the extend, on and just past the 64-token
    chunk starts, twice in one chunk, and at the last token but one. Each state equals its
    request's recurrence run from its initial state to the anchor in one call (conv windows
    exactly, recurrent states within ``rtol`` of the largest entry); the dispatcher is left
    as it was."""
    from types import SimpleNamespace

    import torch

    from freetoken_sglang.anchors import inside

    backend, original, conv, ssm = _fake_gdn(monkeypatch, chunk_states, device)
    g = torch.Generator().manual_seed(1)
    lens, starts, reqs = [70, 200], [0, 5], [0, 1]  # sequence i in slot i
    dev = dict(device=device)
    i32 = dict(device=device, dtype=torch.int32)
    x = torch.randn(sum(lens), conv.shape[1], generator=g).to(device, conv.dtype)
    a, b = (torch.randn(sum(lens), ssm.shape[1], generator=g).to(device) for _ in range(2))
    conv[1] = torch.randn(conv.shape[1:], generator=g).to(device, conv.dtype)
    ssm[1] = 0.1 * torch.randn(ssm.shape[1:], generator=g).to(device)
    init = [(torch.zeros_like(conv[0]), torch.zeros_like(ssm[0])),
            (conv[1].clone(), ssm[1].clone())]
    wanted = [(2, 30, 64, 66, 69),
              tuple(5 + r for r in (1, 2, 40, 64, 65, 66, 100, 128, 130, 198))]
    snaps, row, free = [], 0, 2
    for n, start, req, pos in zip(lens, starts, reqs, wanted):
        phys = torch.arange(free, free + len(pos), **dev)
        snaps.append(inside.Snapshots(row=row, start=start, positions=pos, slots=phys,
                                      phys=phys, req_slot=torch.tensor([req], **dev)))
        row, free = row + n, free + len(pos)
    ref_slot = free
    mode = SimpleNamespace(name="EXTEND")
    batch = SimpleNamespace(forward_mode=mode, extend_seq_lens_cpu=lens,
                            extend_prefix_lens=torch.tensor(starts, **dev))
    meta = SimpleNamespace(query_start_loc=torch.tensor([0, lens[0], sum(lens)], **i32),
                           mamba_cache_indices=torch.tensor(reqs, **i32),
                           has_mamba_track_mask=False)
    backend.forward_metadata = meta
    layer = SimpleNamespace(layer_id=0)
    out = inside.replay(backend, original, layer, batch, x, a, b, snaps, {})
    assert backend.forward_metadata is meta and out.shape[1] == sum(lens)
    assert "extend" not in vars(backend.kernel_dispatcher)
    for s, (c0, s0) in zip(snaps, init):
        assert ("segments" not in s.built) == chunk_states
        for i, p in enumerate(s.positions):  # the reference: one call from the initial state
            conv[ref_slot], ssm[ref_slot] = c0, s0
            n, r = p - s.start, slice(s.row, s.row + p - s.start)
            backend.forward_metadata = SimpleNamespace(
                query_start_loc=torch.tensor([0, n], **i32),
                mamba_cache_indices=torch.tensor([ref_slot], **i32))
            one = SimpleNamespace(forward_mode=mode, extend_seq_lens_cpu=[n],
                                  extend_prefix_lens=torch.tensor([s.start], **dev))
            original(backend, layer, one, x[r], a[r], b[r])
            assert torch.equal(conv[s.phys[i]], conv[ref_slot]), p
            err = (ssm[s.phys[i]] - ssm[ref_slot]).abs().max() / ssm[ref_slot].abs().max()
            assert err <= rtol, (p, float(err))
    # the stock call raising leaves the dispatcher as it was
    with pytest.raises(RuntimeError, match="stock"):
        inside.replay(backend, lambda *a, **k: (_ for _ in ()).throw(RuntimeError("stock")),
                      layer, batch, x, a, b, snaps, {})
    assert "extend" not in vars(backend.kernel_dispatcher)


@pytest.mark.parametrize("chunk_states", [True, False])
def test_anchor_states_inside_a_forward_equal_the_recurrence_up_to_each_anchor(monkeypatch,
                                                                             chunk_states):
    check_inside_states(monkeypatch, chunk_states)


# ---- end to end on the CPU-run SGLang (tiny Qwen3-Next, 25% cache) ------------------------

NEW = 4
SYSTEM = {"role": "system", "content": "you are a coding agent"}
TASK = {"role": "user", "content": "read the file and run the test"}


def _step(i):
    """The i-th agent step: thinking and a tool call, then the tool's output."""
    words = "python function class return value error test passes fails build".split()
    return [
        {"role": "assistant",
         "content": f"<think>\nstep {i} the {words[i % 10]} {words[(i + 3) % 10]}\n</think>\n\n",
         "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": f"{i}.py"}}}]},
        {"role": "tool", "content": " ".join(words[(i + j) % 10] for j in range(8))},
    ]


def _edit(messages, kind):
    """A harness edit of every step but the newest (the three of the hybrid-model issue)."""
    steps = [messages[i:i + 2] for i in range(2, len(messages), 2)]
    out = messages[:2]
    for n, (assistant, tool) in enumerate(steps):
        old = n < len(steps) - 1
        if old and kind == "drop_thinking":
            assistant = dict(assistant, content="")
        if old and kind == "placeholder":
            tool = dict(tool, content="[output removed]")
        if old and kind == "last_observation":
            out.append(assistant)
            continue
        out += [assistant, tool]
    return out


def _restore_point(prompt, sent, marker_ids):
    """The spec: the deepest state at or before the first position where ``prompt`` leaves
    an earlier prompt, over every earlier prompt; with a merge distance of 1 every marker
    position and every prompt end holds one (0: none)."""
    best = 0
    for prev in sent:
        lcp = next((i for i, (a, b) in enumerate(zip(prompt, prev)) if a != b),
                   min(len(prompt), len(prev)))
        states = find_markers(prev, marker_ids) + [len(prev)]
        best = max([best] + [p for p in states if p <= lcp])
    return best


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    return tiny_checkpoint("qwen3_next", num_layers=10, num_experts=8, top_k=2)


def test_edited_agent_sessions_re_prefill_only_after_the_deepest_anchor(hybrid, tmp_path,
                                                                        monkeypatch):
    import requests
    from transformers import AutoTokenizer

    from sglang_cpu import start_server
    from test_hybrid_cpu import CACHE_25, chat_ids

    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "float32")  # test_hybrid_cpu says why
    # the stand-in kernel returns chunk-start states as SGLang's Triton kernel does, so that
    # the anchor states come from them (the GPU's path; test_hybrid_cpu runs the other)
    monkeypatch.setenv("SGL_STUB_GDN_CHUNK_STATES", "1")
    tok = AutoTokenizer.from_pretrained(hybrid)
    ids = [(tok.convert_tokens_to_ids(m),) for m in DEFAULT_MARKERS]
    # one chunk per prompt: the only states inside a prompt are the anchors' own
    base = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
            "--chunked-prefill-size", "4096", "--max-mamba-cache-size", "512"]
    sessions = {}
    for kind in ("drop_thinking", "placeholder", "last_observation"):
        sys_msg = dict(SYSTEM, content=f"{SYSTEM['content']} {kind.replace('_', ' ')}")
        turns = []
        for t in range(1, 4):
            msgs = [sys_msg, TASK] + sum((_step(i) for i in range(t)), [])
            turns.append(chat_ids(tok, _edit(msgs, kind)))
        sessions[kind] = turns

    def gen(server, prompt):
        r = requests.post(server.url + "/generate", json={
            "input_ids": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
        }, timeout=300)
        r.raise_for_status()
        return r.json()

    # states taken inside the forward (what auto picks at 25%): no chunk ends at anchors
    flags = base + CACHE_25 + ["--freetoken-anchor-min-distance", "1",
                               "--freetoken-anchor-cuts", "inside"]
    got, sent, want_cached = {}, [], {}
    server = start_server(hybrid, flags, log_path=str(tmp_path / "anchors.log"))
    try:
        # SGLang's warm-up request was admitted before these
        before = requests.get(server.url + "/freetoken/stats", timeout=60).json()["anchors"]
        for kind, turns in sessions.items():
            for t, prompt in enumerate(turns):
                want_cached[kind, t] = _restore_point(prompt, sent, ids)
                out = gen(server, prompt)
                got[kind, t] = out["output_ids"]
                sent.append(prompt)
                re_prefilled = len(prompt) - out["meta_info"]["cached_tokens"]
                assert re_prefilled == len(prompt) - want_cached[kind, t], (kind, t)
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()["anchors"]
    finally:
        server.stop()
    # every edited turn restored from an anchor inside the conversation, not from scratch
    for kind in sessions:
        assert want_cached[kind, 2] > len(chat_ids(tok, [SYSTEM, TASK]))
    assert stats["restores"] >= len(sessions) and stats["states_evicted"] == 0
    assert stats["cuts"] == "inside" and stats["snaps_missed"] == 0
    assert stats["states_snapped"] > 0  # the anchors inside each prompt
    assert stats["snapped_from_chunks"] == stats["states_snapped"]
    assert (stats["reprefill_tokens"] - before["reprefill_tokens"]
            == sum(len(p) for p in sent) - sum(want_cached.values()))
    assert stats["requests"] - before["requests"] == len(sent)

    # two anchor states at most: the least recently used go first
    prompt = sessions["placeholder"][1]
    cuts = [p for p in find_markers(prompt, ids) if p > 0]
    a1, a2, a3 = cuts[-3], cuts[-2], cuts[-1]  # the last three anchors are kept, in order
    # (in this order: a request's own cuts pin new anchors and evict the oldest in turn)
    edits = {"before_a3": prompt[:a3 - 1] + [40], "before_a2": prompt[:a2 - 1] + [40, 41, 42]}
    server = start_server(hybrid, flags + ["--freetoken-anchor-states", "2"],
                          log_path=str(tmp_path / "anchors-2.log"))
    try:
        gen(server, prompt)
        small = requests.get(server.url + "/freetoken/stats", timeout=60).json()["anchors"]
        assert small["states_held"] == 2 and small["states_evicted"] == small["states_kept"] - 2
        # a1 is gone: an edit before a2 re-prefills from an earlier state (none here);
        # a2 survives: an edit before a3 restores from it
        for name, p in edits.items():
            got[name] = gen(server, p)
            want = 0 if name == "before_a2" else a2
            assert got[name]["meta_info"]["cached_tokens"] == want, (name, a1, a2, a3)
            got[name] = got[name]["output_ids"]
    finally:
        server.stop()

    # a restored state is a correct state: the tokens of stock SGLang with no radix cache
    prompts = {**{k: sessions[k[0]][k[1]] for k in got if isinstance(k, tuple)}, **edits}
    server = start_server(hybrid, base + ["--disable-radix-cache"],
                          log_path=str(tmp_path / "stock.log"))
    try:
        for key, out in got.items():
            ref = gen(server, prompts[key])
            assert ref["meta_info"]["cached_tokens"] == 0
            assert ref["output_ids"] == out, key
    finally:
        server.stop()
