"""Start-up limits and errors of ``--enable-freetoken`` on a real CPU-run server: a cache
smaller than one layer serves in waves, token for token as stock; one smaller than top-k is
refused with the minimum; an unsupported or quantized model fails naming itself, a cache as
large as the pool makes every expert resident (no fills), and the ``sglang.Engine`` keyword
form works."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import requests

from inproc import run_check
from sglang_cpu import run_launch_server_expecting_failure, start_server


def assert_clean_refusal(out):
    """A refused launch: exit code 2 (not a kill signal), one line naming it, no traceback."""
    log = out.stdout + out.stderr
    assert out.returncode == 2, (out.returncode, log[-3000:])
    assert "Traceback" not in log, log[-3000:]
    assert len([l for l in log.splitlines() if "FreeToken refused to start:" in l]) >= 1


def test_cache_smaller_than_top_k_is_refused_with_the_minimum(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")  # 8 experts per layer, top-2
    out = run_launch_server_expecting_failure(
        path, ["--enable-freetoken", "--freetoken-cache-slots", "1"]
    )
    log = out.stdout + out.stderr
    assert_clean_refusal(out)
    assert "would hold 1 slot, but at least 2 are needed" in log
    assert "--freetoken-cache-slots 2" in log


def test_min_free_gb_on_a_cpu_device_is_refused(tiny_checkpoint):
    out = run_launch_server_expecting_failure(
        tiny_checkpoint("qwen3_moe"), ["--enable-freetoken", "--freetoken-min-free-gb", "4"])
    assert_clean_refusal(out)
    assert "--freetoken-min-free-gb watches the GPU's free memory and needs a CUDA device" in (
        out.stdout + out.stderr)


def test_cache_smaller_than_one_layer_serves_in_waves(tiny_checkpoint, tmp_path):
    """5 slots, 8 experts per layer: a 2-expert wave buffer and a 3-slot LRU; every prefill
    chunk and most decode batches run in waves, and the tokens equal stock's."""
    from test_e2e_families import assert_same_tokens, serve_and_collect

    path = tiny_checkpoint("qwen3_moe")
    flags = ["--chunked-prefill-size", "64"]
    want, _, _ = serve_and_collect(path, flags, str(tmp_path / "stock.log"))
    got, stats, log = serve_and_collect(
        path, flags + ["--enable-freetoken", "--freetoken-cache-slots", "5"],
        str(tmp_path / "ft.log"),
    )
    assert "2-expert wave buffer" in log
    assert_same_tokens(got, want, "qwen3_moe waves")
    assert stats["cache"]["layout"] == "waves" and stats["cache"]["lru_slots"] == 3
    stream = stats["prefill_stream"]
    assert stream["wave_calls"] == stream["layer_calls"] > 0
    assert stream["experts_streamed"] > 0


def test_unsupported_architecture_fails_at_start(tiny_dir):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tiny_dir / "dense-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        cfg = LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2,
        )
        LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    out = run_launch_server_expecting_failure(path, ["--enable-freetoken"])
    log = out.stdout + out.stderr
    assert_clean_refusal(out)
    assert "does not support the architecture ['LlamaForCausalLM']" in log


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
     "FP8 without weight_block_size (per-tensor scales) is not served yet"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128},
     "quantization 'gptq' is not served yet"),
])
def test_unserved_quantization_fails_at_start(tiny_checkpoint, tiny_dir, quant, message):
    src = tiny_checkpoint("qwen3_moe")
    path = str(tiny_dir / f"qwen3-moe-{quant['quant_method']}-config")
    shutil.copytree(src, path, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["quantization_config"] = quant
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    out = run_launch_server_expecting_failure(path, ["--enable-freetoken"])
    log = out.stdout + out.stderr
    assert_clean_refusal(out)
    assert message in log


def test_cache_as_large_as_the_pool_keeps_every_expert_resident(tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("mixtral")
    server = start_server(
        path, ["--enable-freetoken", "--freetoken-cache-ratio", "1.5"],
        log_path=str(tmp_path / "server.log"),
    )
    try:
        for prompt in ([5, 6, 7], list(range(20, 80))):
            r = requests.post(
                server.url + "/generate",
                json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 12}},
                timeout=300,
            )
            r.raise_for_status()
        stats = requests.get(server.url + "/freetoken/stats", timeout=60).json()
    finally:
        server.stop()
    assert stats["cache"]["all_resident"] is True
    assert stats["cache"]["slots"] == stats["pool"]["experts"]
    # layer calls run as stock SGLang's MoE over the slots (execute/resident.py): no LRU,
    # nothing filled, nothing counted
    assert stats["total"] == {"reads": 0, "hits": 0, "fills": 0, "evictions": 0, "cpu": 0,
                              "hit_rate": None}
    assert stats["forwards"]["decode"] > 0


def test_engine_keywords(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    r = run_check("engine", path, freetoken_cache_slots=8, resize_to=20)
    assert [len(o) for o in r["output_ids"]] == [8, 8]
    assert r["stats"]["cache"]["slots"] == 8
    assert r["stats"]["total"]["reads"] > 0
    # freetoken_sglang.resize_cache(engine, ...): the same tokens from the resized cache
    assert r["resize"]["ok"] and (r["resize"]["old_slots"], r["resize"]["new_slots"]) == (8, 20)
    assert "top-" in r["refused"] and r["refused"].startswith("FreeToken cache resize refused")
    assert r["output_ids_after"] == r["output_ids"]
    assert r["stats_after"]["cache"]["slots"] == 20 and r["stats_after"]["cache"]["resizes"] == 1
    assert r["stats_after"]["total"]["reads"] > r["stats"]["total"]["reads"]
