"""FreeToken serves the hybrid families (Qwen3-Next, the Qwen3.5-MoE text model: gated
DeltaNet + full attention, MoE) on the CPU recipe, with the stand-in's gated DeltaNet and
Qwen3.5 ops: at a cache of 25% of the expert pool, with semantic anchors (the default) and
without, the greedy tokens equal stock SGLang's (fp32) and transformers' own, including a
turn restored from a recurrent state kept in the radix cache and an edited agent turn."""

from __future__ import annotations

import pytest
import requests
import torch

from sglang_cpu import start_server

# SGLang's default hybrid cache strategy (extra_buffer) needs a GPU; no_buffer needs the
# overlap schedule off. For Qwen3_5MoeForCausalLM SGLang 0.5.17 runs no strategy resolution
# at all (only the multimodal Qwen3.5 architectures are in _MAMBA_RADIX_CACHE_ARCHS,
# arg_groups/overrides.py): these two flags are what it would declare. A small mamba pool
# keeps the CPU servers' memory down (its default is ~7.5 GB).
HYBRID_CPU = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
              "--chunked-prefill-size", "64", "--max-mamba-cache-size", "64"]
# Ten layers, so that 25% of the pool streams prefill (2E + k slots; cache/layout.py).
HYBRID_SHAPE = dict(num_layers=10, num_experts=8, top_k=2)
CACHE_25 = ["--enable-freetoken", "--freetoken-cache-ratio", "0.25"]
NEW = 8


@pytest.fixture(autouse=True)
def fp32_conv_state(monkeypatch):
    """SGLang keeps the DeltaNet conv state in bf16 by default (SGLANG_MAMBA_CONV_DTYPE): a
    prefill chunk boundary then rounds the last three conv inputs, which the tiny random
    models amplify (a logprob off by 3.5 right after a 64-token chunk); fp32 for exact
    comparisons. The servers inherit this environment (servers.cpu_env)."""
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "float32")


def chat_ids(tok, messages):
    return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                   return_dict=False)


def _prompts(tok):
    """A short prompt, one of two prefill chunks, an agent turn (thinking, tool call, tool
    output) and the same turn with the tool output replaced (an edit after anchors)."""
    agent = [
        {"role": "system", "content": "you are a coding agent"},
        {"role": "user", "content": "read the file and run the test"},
        {"role": "assistant", "content": "<think>\nthe test fails build the server\n</think>\n\n",
         "tool_calls": [{"function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "content": "python function class return value error test passes"},
    ]
    edited = [dict(m) for m in agent]
    edited[3]["content"] = "[output removed]"
    return [
        [5, 6, 7, 8, 9, 10, 11, 12],
        [100, 20, 3, 44, 51, 60, 7, 8, 9, 10, 11] + list(range(200, 300)),
        chat_ids(tok, agent),
        chat_ids(tok, edited),
    ]


def _serve(ckpt, flags, prompts, log_path):
    """Greedy NEW tokens for each prompt, in order, then a second turn of the first
    (restored from its recurrent state); the outputs and the stats (or None)."""
    server = start_server(ckpt, flags, log_path=log_path)
    try:
        def gen(ids):
            r = requests.post(server.url + "/generate", json={
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
            }, timeout=300)
            r.raise_for_status()
            return r.json()

        outs = [gen(p) for p in prompts]
        turn2 = prompts[0] + outs[0]["output_ids"] + [40, 41, 42]
        second = gen(turn2)
        assert second["meta_info"]["cached_tokens"] >= len(prompts[0])  # a restored state
        stats = None
        if "--enable-freetoken" in flags:
            stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    return [o["output_ids"] for o in outs] + [second["output_ids"]], turn2, stats, server.log()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_freetoken_matches_stock_and_transformers(tiny_checkpoint, family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tiny_checkpoint(family, **HYBRID_SHAPE)
    prompts = _prompts(AutoTokenizer.from_pretrained(ckpt))
    want, turn2, _, _ = _serve(ckpt, HYBRID_CPU, prompts, str(tmp_path / "stock.log"))
    # Anchors on: Qwen3-Next with a chunk cut at each anchor; Qwen3.5-MoE with the default
    # (cuts auto: at 25% the states are taken inside the forward).
    cuts = "on" if family == "qwen3_next" else "auto"
    for anchors in ("on", "off"):
        got, _, stats, log = _serve(
            ckpt, HYBRID_CPU + CACHE_25 + (["--freetoken-anchor-cuts", cuts] if anchors == "on"
                                           else ["--freetoken-anchors", "off"]), prompts,
            str(tmp_path / f"freetoken-anchors-{anchors}.log"))
        assert got == want, f"{family} anchors {anchors}"
        assert stats["cache"]["slots"] == stats["pool"]["experts"] // 4
        assert stats["cache"]["layout"] == "stream" and stats["prefill_stream"]["layer_calls"] > 0
        assert stats["total"]["fills"] > 0
        if anchors == "on":
            a = stats["anchors"]
            assert "FreeToken anchors: '<think>'=" in log
            # the agent turn kept anchor states; its edited copy restored from one
            assert a["states_kept"] >= 2 and a["restores"] >= 1
            assert a["requests"] >= len(prompts) + 1
            assert a["cuts"] == ("on" if cuts == "on" else "inside")
            assert a["snaps_missed"] == 0
            # SGLang's CPU kernel returns no chunk-start states: one segment per anchor
            assert a["snapped_from_chunks"] == 0
            if cuts == "auto":
                assert a["states_snapped"] > 0
        else:
            assert stats["anchors"] is None and "FreeToken anchors" not in log
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    for ids, out in zip(prompts + [turn2], want):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                                 do_sample=False,
                                 attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out == ref[0, len(ids):].tolist(), (family, ids[:4])
