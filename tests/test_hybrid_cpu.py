"""Stock SGLang 0.5.17 serves a tiny Qwen3-Next (gated DeltaNet + full attention, MoE) on the
CPU recipe with the stand-in's gated DeltaNet ops, token for token as transformers does,
including a second turn restored from the radix cache's recurrent state. The groundwork of
the hybrid-model issue: FreeToken itself still refuses hybrid models."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import requests
import torch

from sglang_cpu import start_server

# SGLang's default hybrid cache strategy (extra_buffer) needs a GPU; no_buffer needs the
# overlap schedule off.
HYBRID_CPU = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule",
              "--chunked-prefill-size", "64"]
NEW = 12


@pytest.fixture(scope="module")
def qwen3_next(tiny_checkpoint, tmp_path_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    tok_dir = tiny_checkpoint("qwen3_moe")
    vocab = json.load(open(os.path.join(tok_dir, "config.json")))["vocab_size"]
    out = str(tmp_path_factory.mktemp("qwen3_next"))
    cfg = Qwen3NextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        full_attention_interval=2, max_position_embeddings=512, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True,
    )
    torch.manual_seed(0)
    Qwen3NextForCausalLM(cfg).save_pretrained(out)
    # transformers writes layer_types only; SGLang derives them from full_attention_interval
    c = json.load(open(os.path.join(out, "config.json")))
    c["full_attention_interval"] = 2
    json.dump(c, open(os.path.join(out, "config.json"), "w"))
    for f in os.listdir(tok_dir):
        if f.startswith("tokenizer"):
            shutil.copy(os.path.join(tok_dir, f), out)
    return out


def test_stock_sglang_serves_qwen3_next_like_transformers(qwen3_next, tmp_path):
    from transformers import AutoModelForCausalLM

    first = [5, 6, 7, 8, 9, 10, 11, 12]
    long = [100, 20, 3, 44, 51, 60, 7, 8, 9, 10, 11] + list(range(200, 300))  # two chunks
    server = start_server(qwen3_next, HYBRID_CPU, log_path=str(tmp_path / "stock.log"))
    try:
        def gen(ids):
            r = requests.post(server.url + "/generate", json={
                "input_ids": ids,
                "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True},
            }, timeout=300)
            r.raise_for_status()
            return r.json()

        got = [gen(first)["output_ids"], gen(long)["output_ids"]]
        turn2 = first + got[0] + [40, 41, 42]
        second = gen(turn2)
        got.append(second["output_ids"])
        # the second turn started from the first turn's state kept in the radix cache
        assert second["meta_info"]["cached_tokens"] >= len(first)
    finally:
        server.stop()
    model = AutoModelForCausalLM.from_pretrained(qwen3_next, dtype=torch.float32).eval()
    for ids, out in zip((first, long, turn2), got):
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        assert out == want[0, len(ids):].tolist(), ids[:4]
