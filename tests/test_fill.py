"""Cache fills: the Triton row-copy kernel (run by Triton's interpreter here) and the
host-planned filler copy exactly the planned pool rows into the planned slots."""

from __future__ import annotations

import torch

from conftest import needs_interpreter

from freetoken_sglang.cache.fills import Filler
from freetoken_sglang.cache.residency import FillPlan


@needs_interpreter
def test_copy_rows_kernel_copies_only_counted_rows():
    from freetoken_sglang.kernels.fill import copy_rows

    for dtype, shape in [(torch.bfloat16, (6, 10)), (torch.float32, (3, 7)), (torch.float16, (5,))]:
        src = torch.randn(9, *shape).to(dtype)
        dst = torch.zeros(4, *shape, dtype=dtype)
        before = dst.clone()
        copy_rows(
            src,
            dst,
            torch.tensor([7, 2, 5], dtype=torch.int32),
            torch.tensor([1, 3, 0], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
        )
        assert torch.equal(dst[1], src[7]) and torch.equal(dst[3], src[2])
        assert torch.equal(dst[0], before[0]) and torch.equal(dst[2], before[2])


def test_filler_local_mode_and_fill_all():
    pool = {"w13_weight": torch.randn(8, 4, 3), "w2_weight": torch.randn(8, 3, 2)}
    slots = {n: torch.zeros(3, *t.shape[1:]) for n, t in pool.items()}
    f = Filler(pool, {}, slots)
    assert f.mode == "local"
    f.run(
        FillPlan(
            torch.tensor([6, 1, 0], dtype=torch.int32),
            torch.tensor([2, 0, 1], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
        )
    )
    for n in pool:
        assert torch.equal(slots[n][2], pool[n][6]) and torch.equal(slots[n][0], pool[n][1])
        assert (slots[n][1] == 0).all()
    big = {n: torch.zeros(9, *t.shape[1:]) for n, t in pool.items()}
    Filler(pool, {}, big).fill_all()
    for n in pool:
        assert torch.equal(big[n][:8], pool[n]) and (big[n][8] == 0).all()
