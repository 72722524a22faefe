"""The host expert pool: bank layout (row ``l*E + e`` holds exactly that expert), loading
straight into it, and what a refused pin reports."""

from __future__ import annotations

import pytest
import torch

from freetoken_sglang.experts.pool import BankSpec, HostExpertPool, bank_specs_for_layer
from inproc import run_check


def make_pool(layers=(1, 2, 4), E=3):
    specs = bank_specs_for_layer(hidden_size=5, intermediate_size=3, dtype=torch.bfloat16)
    return HostExpertPool(list(layers), E, specs)


def test_layer_rows_are_views_at_l_times_E():
    pool = make_pool()
    assert pool.num_rows == 9
    assert pool.ordinal(4) == 2 and pool.flat_id(4, 1) == 7
    rows = pool.layer_rows("w13_weight", 2)
    assert rows.shape == (3, 6, 5)
    rows[1].fill_(7.0)
    bank = pool.banks["w13_weight"]
    assert (bank[4] == 7).all()
    assert not (bank[3] == 7).any() and not (bank[5] == 7).any()
    assert rows.data_ptr() == bank[3].data_ptr()
    with pytest.raises(KeyError, match="not one of the MoE layers"):
        pool.ordinal(3)


def test_expert_bytes_and_specs():
    pool = make_pool()
    assert pool.expert_bytes == (6 * 5 + 5 * 3) * 2
    assert pool.nbytes == pool.expert_bytes * 9
    with_bias = bank_specs_for_layer(5, 3, torch.float16, with_bias=True)
    assert with_bias["w13_weight_bias"] == BankSpec((6,), torch.float32)
    assert with_bias["w2_weight_bias"] == BankSpec((5,), torch.float32)


def test_pin_refused_stays_pageable_and_says_why(monkeypatch):
    pool = make_pool()
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0 if len(calls) == 1 else 2  # second bank refused

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    launches = []
    real_full = torch.full

    def full(*a, **k):  # the launch that consumes CUDA's last error after the refusal
        launches.append(k.get("device"))
        raise RuntimeError("CUDA error: invalid argument")

    monkeypatch.setattr(torch, "full", full)
    assert pool.pin() is False
    monkeypatch.setattr(torch, "full", real_full)
    assert launches == ["cuda"]  # the refusal's error consumed
    assert pool.pinned is False and pool.device_banks == {}
    kinds = [c[0] for c in calls]
    assert kinds == ["register", "register", "unregister"]  # w13 is unregistered again
    assert calls[0][1] == pool.banks["w13_weight"].data_ptr()
    assert calls[0][3] == 3  # portable | mapped
    assert pool.pin_error_code == 2
    assert pool.pin_error.startswith("cudaHostRegister error 2, out of memory, on bank w2_weight:")


def test_banks_are_host_memory_under_another_default_device():
    # SGLang builds the model under a CUDA default device; the pool must stay on the host.
    with torch.device("meta"):
        pool = make_pool()
    for bank in pool.banks.values():
        assert bank.device.type == "cpu" and bank.data_ptr() % 4096 == 0


@pytest.mark.parametrize(
    "family,first_moe_layer", [("qwen3_moe", 0), ("mixtral", 0), ("deepseek_v2", 1)]
)
def test_loaded_pool_rows_hold_the_checkpoint_experts(tiny_checkpoint, family, first_moe_layer):
    path = tiny_checkpoint(family)
    r = run_check("pool_layout", path, freetoken_cache_ratio=0.5)
    assert r["moe_layer_ids"][0] == first_moe_layer
    assert r["checked"] == r["rows"] * 3  # gate, up and down of every expert
    assert r["mismatches"] == []
    assert r["params_are_views"] is True
    assert r["expert_params_on_cpu"] is True


def test_dummy_load_fills_the_pool_with_stock_values(tiny_checkpoint):
    """patches/model_loader.initialize_dummy_weights: every layer's rows equal what stock
    SGLang draws for an expert parameter of that shape (the pool never sat on the device)."""
    path = tiny_checkpoint("qwen3_moe")
    r = run_check("dummy_values", path, freetoken_cache_ratio=0.5)
    assert r["layers"] >= 2
    assert set(r["banks"]) == {"w13_weight", "w2_weight"}
    for bank in r["banks"].values():
        assert bank["nonzero"] is True
        assert bank["layers_equal_to_stock"] == [True] * r["layers"]
