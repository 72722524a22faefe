"""GPT-OSS (``GptOssForCausalLM``, FP32 experts here) on the CPU-run SGLang: expert biases, the
clamped swiglu with ``gemm1_alpha`` and interleaved gate/up rows (the tiny checkpoint's gate/up
weights are scaled so that the clamp at 7.0 is reached), attention sinks and sliding window.

SGLang 0.5.17 refuses GPT-OSS on the CPU recipe's ``torch_native`` attention (no attention
sinks), and its ``intel_amx`` backend falls back to ``torch_native`` on a CPU without AMX; its
``triton`` backend runs here under Triton's interpreter, so stock and FreeToken both serve
with it. FreeToken at 25% of the pool with fill (SGLang's runner over slots, streamed
prefill) and with qstar (B_P/B_H = 0.5: a call with m misses runs floor(m/2) of them on the C
executor's swiglu_oai path) gives stock's greedy tokens, and stock gives transformers' within
the sliding window.

MXFP4 (GPT-OSS's own checkpoint format): stock SGLang 0.5.17 cannot run it on the CPU engine
(without AMX its MXFP4 path needs the ``triton_kernels`` package to upcast the weights), so
FreeToken serving a tiny MXFP4 checkpoint is held to stock SGLang serving its dequantized twin
(``tiny_quant.write_mxfp4``), in BF16. On a GPU the cache's slots are dequantized per
call (``tests/test_gpu.py``, ``benchmarks/gpu_equality.py --quant mxfp4``).
"""

from __future__ import annotations

import requests
import torch

from freetoken_sglang.tiny_quant import mxfp4_dequantize, mxfp4_quantize, write_mxfp4
from inproc import run_check
from sglang_cpu import start_server
from test_e2e_families import (CACHE_25, CHUNK, _top2, assert_same_tokens, counts_since,
                               flush_radix_cache, serve_and_collect, transformers_greedy)

# Ten layers, as test_e2e_families.FAMILY_SHAPES: at 25% the prefill streams.
SHAPE = dict(num_layers=10, num_experts=8, top_k=2)

TRITON_ATTENTION = ["--attention-backend", "triton"]
# One prompt inside the 32-token sliding window, one across it, one over two prefill chunks.
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12],
    [(i * 11) % 300 + 20 for i in range(40)],
    [200 + (i * 7) % 150 for i in range(90)],
]
NEW_TOKENS = 10


def generate(url):
    """Greedy ids and top-2 logprobs: the prompts one by one, then all three in one request."""
    def post(ids):
        r = requests.post(url + "/generate", json={
            "input_ids": ids,
            "sampling_params": (
                [{"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}] * len(ids)
                if isinstance(ids[0], list)
                else {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}),
            "return_logprob": True,
            "top_logprobs_num": 2,
        }, timeout=600)
        r.raise_for_status()
        return r.json()

    seq = [post(p) for p in PROMPTS]
    batch = post(PROMPTS)
    return {
        "sequential": [b["output_ids"] for b in seq],
        "concurrent": [b["output_ids"] for b in batch],
        "top2": {"sequential": [_top2(b) for b in seq], "concurrent": [_top2(b) for b in batch]},
    }


def serve(path, flags, log_path):
    return serve_and_collect(path, CHUNK + TRITON_ATTENTION + flags, log_path,
                             collector=generate, timeout=600)


def test_gpt_oss_matches_stock_sglang_and_transformers(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("gpt_oss", **SHAPE)
    want, _, _ = serve(path, [], str(tmp_path / "stock.log"))
    # stock SGLang against transformers, within the sliding window (prompt 0: 18 positions)
    assert want["sequential"][:1] == transformers_greedy(path, PROMPTS[:1], NEW_TOKENS)
    # One FreeToken server (CI time): qstar from its start (B_P/B_H = 0.5 and no fixed costs:
    # half of each call's misses on the C executor), then switched to fill (POST
    # /freetoken/cache), SGLang's radix cache flushed before each; each policy's counters are
    # what its own requests counted.
    server = start_server(path, CHUNK + TRITON_ATTENTION + CACHE_25 + [
        "--freetoken-miss-policy", "qstar", "--freetoken-bandwidth", "20,40,0,0"],
        log_path=str(tmp_path / "ft.log"), timeout=600)
    runs = []
    try:
        for policy in ("qstar", "fill"):
            if policy == "fill":
                r = requests.post(server.url + "/freetoken/cache", json={"miss_policy": "fill"},
                                  timeout=300)
                assert r.status_code == 200, r.text
            flush_radix_cache(server.url)
            before = requests.get(server.url + "/freetoken/stats", timeout=60).json()
            got = generate(server.url)
            after = requests.get(server.url + "/freetoken/stats", timeout=60).json()
            runs.append((policy, got, counts_since(before, after)))
    finally:
        server.stop()
    log = server.log()
    assert "FreeToken: GPT-OSS, routed experts in host memory" in log
    assert "w13_weight_bias" in log and "w2_weight_bias" in log  # biases in the pool
    for policy, got, stats in runs:
        assert stats["miss_policy"] == policy
        assert_same_tokens(got, want, f"gpt_oss {policy}")
        total = stats["total"]
        assert stats["cache"]["slots"] == stats["pool"]["experts"] // 4
        assert stats["prefill_stream"]["experts_streamed"] > 0
        if policy == "fill":
            assert total["fills"] > 0 and total["cpu"] == 0
        else:
            assert total["fills"] > 0 and total["cpu"] > 0


def test_mxfp4_codes_round_trip():
    # by the format's definition: 6 = code 7, -0.5 = code 1 | sign 8, low nibble first;
    # amax 6 maps to scale 2^0 (127), 12 to 2^1 (128)
    known = torch.zeros(2, 32)
    known[0, :2] = torch.tensor([6.0, -0.5])
    known[1, :2] = torch.tensor([12.0, -1.0])
    blocks, scales = mxfp4_quantize(known)
    assert blocks[:, 0, 0].tolist() == [7 | (9 << 4)] * 2 and scales[:, 0].tolist() == [127, 128]
    assert torch.equal(mxfp4_dequantize(blocks, scales), known)
    w = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3
    w[0, 0, :32] = 0  # an all-zero block
    blocks, scales = mxfp4_quantize(w)
    assert blocks.shape == (3, 5, 2, 16) and scales.shape == (3, 5, 2)
    d = mxfp4_dequantize(blocks, scales)
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1)  # half the widest gap
    assert ((d - w).abs() <= step).all()
    assert torch.equal(mxfp4_dequantize(*mxfp4_quantize(d)), d)  # on-grid values are exact


def test_gpt_oss_mxfp4_matches_stock_on_the_dequantized_twin(tiny_checkpoint, tiny_dir,
                                                             tmp_path):
    """The pool holds the checkpoint's MXFP4 codes, scales and BF16 biases (SGLang's CPU engine
    pads I = 32 to 64: the padding holds Mxfp4MoEMethod's initial values); q* at 25% fills
    MXFP4 slots (dequantized for SGLang's native MoE) and runs misses on the C executor's
    MXFP4 kernels, token for token with stock SGLang on the twin."""
    src = tiny_checkpoint("gpt_oss", dtype="bfloat16", **SHAPE)
    out = str(tiny_dir / "gpt_oss-bfloat16-mxfp4")
    path, twin = write_mxfp4(src, out, out + "-twin")
    bf16 = ["--dtype", "bfloat16"]
    r = run_check("pool_layout", path, freetoken_cache_ratio=0.25, dtype="bfloat16",
                  attention_backend="triton")
    assert r["checked"] == r["rows"] * 6 and r["mismatches"] == []
    assert r["params_are_views"] is True and r["expert_params_on_cpu"] is True
    # --load-format dummy: stock keeps create_weights' codes (0) and scales (127), draws biases
    r = run_check("dummy_values", path, freetoken_cache_ratio=0.25, dtype="bfloat16",
                  attention_backend="triton")
    assert all(b["layers_equal_to_stock"] == [True] * r["layers"] for b in r["banks"].values())
    assert [n for n, b in r["banks"].items() if b["nonzero"]] == [
        "w13_weight_scale", "w13_weight_bias", "w2_weight_scale", "w2_weight_bias"]
    want, _, _ = serve(twin, bf16, str(tmp_path / "stock.log"))
    got, stats, log = serve(path, bf16 + CACHE_25 + [
        "--freetoken-miss-policy", "qstar", "--freetoken-bandwidth", "20,40,0,0"],
        str(tmp_path / "ft.log"))
    assert "w13_weight_scale[128, 2]:uint8" in log and "w13_weight_bias[128]:bfloat16" in log
    assert_same_tokens(got, want, "gpt_oss mxfp4 qstar")
    assert stats["total"]["fills"] > 0 and stats["total"]["cpu"] > 0
