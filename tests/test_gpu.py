"""GPU-only checks (skipped without CUDA): the device-side decision kernels against the torch
reference, UVA fills from a pinned pool, and the MoE over slots against SGLang's own fused
MoE on the same weights, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_decide_on_cuda_matches_reference():
    from freetoken_sglang.residency import ResidencyState, decide, decide_reference

    rng = random.Random(0)
    L, E, k, S = 6, 128, 8, 300
    a, b = ResidencyState(L * E, S, "cpu"), ResidencyState(L * E, S, "cuda")
    ca = torch.zeros(4, L, dtype=torch.int64)
    cb = torch.zeros(4, L, dtype=torch.int64, device="cuda")
    for step in range(200):
        T = rng.choice([1, 1, 4, 16, 300])
        layer = rng.randrange(L)
        ids = torch.tensor([rng.sample(range(E), k) for _ in range(T)], dtype=torch.int32)
        nv = torch.tensor([rng.randint(1, T)], dtype=torch.int32)
        pa, ra = decide_reference(a, ca, layer, E, ids, nv)
        pb, rb = decide(b, cb, layer, E, ids.cuda(), nv.cuda())
        assert torch.equal(ra, rb.cpu())
        n = int(pa.count)
        assert int(pb.count) == n
        assert pb.src[:n].tolist() == pa.src[:n].tolist()
        assert pb.dst[:n].tolist() == pa.dst[:n].tolist()
    for name in ("residency", "owner", "key", "clock"):
        assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
    assert torch.equal(ca, cb.cpu())


def test_uva_fill_from_pinned_pool():
    from freetoken_sglang.fill import Filler
    from freetoken_sglang.pool import HostExpertPool, bank_specs_for_layer
    from freetoken_sglang.residency import FillPlan

    pool = HostExpertPool([0, 1], 16, bank_specs_for_layer(256, 96, torch.bfloat16))
    for bank in pool.banks.values():
        bank.copy_(torch.randn(bank.shape).to(bank.dtype))
    assert pool.pin() and pool.pinned
    slots = {n: torch.zeros(8, *s.shape, dtype=s.dtype, device="cuda") for n, s in pool.specs.items()}
    f = Filler(pool.banks, pool.device_banks, slots)
    assert f.mode == "uva"
    plan = FillPlan(
        torch.tensor([31, 2, 17, 0], dtype=torch.int32, device="cuda"),
        torch.tensor([7, 0, 3, 5], dtype=torch.int32, device="cuda"),
        torch.tensor([3], dtype=torch.int32, device="cuda"),
    )
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        f.run(plan)
    g.replay()
    torch.cuda.synchronize()
    for n, bank in pool.banks.items():
        assert torch.equal(slots[n][7].cpu(), bank[31])
        assert torch.equal(slots[n][0].cpu(), bank[2])
        assert torch.equal(slots[n][3].cpu(), bank[17])
        assert (slots[n][5] == 0).all()
    pool.unpin()


@pytest.fixture(scope="module")
def published_server_args(tiny_checkpoint):
    """SGLang's kernels read config bags that a server publishes at start."""
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=tiny_checkpoint("qwen3_moe")), role="test")


@pytest.mark.parametrize("num_tokens", [1, 3, 64, 700])
def test_moe_on_slots_is_bit_identical_to_stock(num_tokens, published_server_args):
    from types import SimpleNamespace

    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import fused_experts
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    from freetoken_sglang.slot_moe import run_on_slots_triton

    torch.manual_seed(num_tokens)
    E, H, I, k, S = 16, 512, 256, 4, 40
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(num_tokens, H, device="cuda", dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, E, device="cuda")
    weights, ids = torch.topk(logits.softmax(-1), k)
    ids = ids.to(torch.int32)
    cfg = MoeRunnerConfig(
        num_experts=E, num_local_experts=E, hidden_size=H,
        intermediate_size_per_partition=I, top_k=k, params_dtype=torch.bfloat16,
        activation="silu", inplace=False, routed_scaling_factor=1.5,
    )
    want = fused_experts(x.clone(), w13, w2, StandardTopKOutput(weights, ids, logits), cfg)
    # Scatter the experts into random slots of a larger slot bank.
    perm = torch.randperm(S, device="cuda")[:E].to(torch.int32)
    slot_w13 = torch.zeros(S, 2 * I, H, device="cuda", dtype=torch.bfloat16)
    slot_w2 = torch.zeros(S, H, I, device="cuda", dtype=torch.bfloat16)
    slot_w13[perm.long()] = w13
    slot_w2[perm.long()] = w2
    layer = SimpleNamespace(moe_runner_config=cfg, w13_weight=w13.cpu(), w2_weight=w2.cpu())
    got = run_on_slots_triton(
        layer, x.clone(), weights, ids, perm, {"w13_weight": slot_w13, "w2_weight": slot_w2}
    )
    assert torch.equal(got, want)
