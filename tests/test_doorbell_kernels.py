"""The CPU branch's doorbell kernels (kernels/doorbell.py) under the Triton interpreter, with CPU
tensors standing in for device memory and for the mapped host buffers (the system-scope fence,
PTX inline assembly, is the identity here; tests/test_gpu.py runs the real thing)."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it beside a jit function)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the kernels in the Triton interpreter")


@triton.jit
def _identity(x):
    return x


@pytest.fixture
def doorbell(monkeypatch):
    import freetoken_sglang.kernels.doorbell as d

    monkeypatch.setattr(d, "_fence_sys", _identity)
    return d


def test_post_copies_the_work_and_rings_only_with_items(doorbell):
    T, H = 3, 96
    x = torch.randn(T, H).to(torch.bfloat16)
    rows = torch.tensor([0, 2, 2, 0, 0, 0], dtype=torch.int32)
    experts = torch.tensor([5, 1, 7, 0, 0, 0], dtype=torch.int32)
    weights = torch.tensor([0.5, 0.25, 1.0, 0, 0, 0])
    count = torch.tensor([3], dtype=torch.int32)
    seq = torch.zeros(1, dtype=torch.int64)
    host = dict(x=torch.zeros(4, H, dtype=torch.bfloat16), rows=torch.zeros(8, dtype=torch.int32),
                experts=torch.zeros(8, dtype=torch.int32), weights=torch.zeros(8),
                count=torch.zeros(1, dtype=torch.int32), n_rows=torch.zeros(1, dtype=torch.int32),
                ring=torch.zeros(1, dtype=torch.int64))
    doorbell.post(x, rows, experts, weights, count, seq, host)
    assert torch.equal(host["x"][:T], x) and torch.equal(host["experts"][:6], experts)
    assert torch.equal(host["rows"][:6], rows) and torch.equal(host["weights"][:6], weights)
    assert (int(host["count"]), int(host["n_rows"]), int(host["ring"]), int(seq)) == (3, 3, 1, 1)
    count.zero_()
    host["x"].zero_()
    doorbell.post(x, rows, experts, weights, count, seq, host)
    assert int(host["ring"]) == 1 and int(seq) == 1 and not host["x"].any()  # nothing posted


def test_wait_merge_adds_the_served_partial_and_nothing_else(doorbell):
    T, H = 3, 96
    seq = torch.tensor([4], dtype=torch.int64)
    done = torch.tensor([4], dtype=torch.int64)
    partial = torch.randn(T, H)
    status = torch.zeros(1, dtype=torch.int32)
    out = torch.randn(T, H)
    start = out.clone()
    doorbell.wait_merge(out, torch.tensor([2], dtype=torch.int32), seq, done, partial, status)
    assert torch.equal(out, start + partial) and int(status) == 0
    out = start.clone()  # no item: no wait, no merge (done lags behind seq here)
    done.fill_(3)
    doorbell.wait_merge(out, torch.tensor([0], dtype=torch.int32), seq, done, partial, status)
    assert torch.equal(out, start) and int(status) == 0
    # items, but the executor never answers: out untouched, status set, no hang
    doorbell.wait_merge(out, torch.tensor([2], dtype=torch.int32), seq, done, partial, status,
                        max_spins=3)
    assert torch.equal(out, start) and int(status) == 1
