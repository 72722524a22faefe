"""Cache fills: the Triton row-copy kernel (run by Triton's interpreter here) and the
host-planned filler copy exactly the planned pool rows into the planned slots."""

from __future__ import annotations

import pytest
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


@needs_interpreter
def test_one_launch_copies_every_bank_of_the_counted_rows():
    from freetoken_sglang.kernels import fill

    # five banks of mixed dtypes and row sizes (a second launch takes the fifth); rows of
    # several 4096-word chunks (3 x 9000 bf16 = 2 int64 chunks, 40000 fp32 = 5 chunks) so
    # that a wrong chunk offset in any bank shows
    shapes = [((3, 9000), torch.bfloat16), ((7,), torch.float32), ((40000,), torch.float32),
              ((2, 5), torch.uint8), ((3,), torch.int32)]
    srcs = [torch.randn(9, *sh).to(dt) if dt.is_floating_point
            else torch.randint(0, 100, (9, *sh)).to(dt) for sh, dt in shapes]
    dsts = [torch.zeros(4, *s.shape[1:], dtype=s.dtype) for s in srcs]
    before = [d.clone() for d in dsts]
    launches = []
    real = fill._copy_banks_kernel

    class Count:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    fill._copy_banks_kernel = Count()
    try:
        fill.copy_rows_banks(srcs, dsts, torch.tensor([7, 2, 5], dtype=torch.int32),
                             torch.tensor([1, 3, 0], dtype=torch.int32),
                             torch.tensor([2], dtype=torch.int32))
    finally:
        fill._copy_banks_kernel = real
    assert len(launches) == 2
    with pytest.raises(ValueError, match="rows differ"):  # checked before anything moves
        bad = [d.clone() for d in dsts]
        fill.copy_rows_banks(srcs, bad[:4] + [torch.zeros(4, 2, dtype=torch.int32)],
                             torch.tensor([0]), torch.tensor([0]), torch.tensor([1]))
    assert all(torch.equal(a, b) for a, b in zip(bad[:4], dsts[:4]))
    for s, d, b in zip(srcs, dsts, before):
        assert torch.equal(d[1], s[7]) and torch.equal(d[3], s[2])
        assert torch.equal(d[0], b[0]) and torch.equal(d[2], b[2])


@needs_interpreter
@pytest.mark.parametrize("count,keep_negative,null_slot",
                         [(0, False, None), (2, False, None), (2, True, None), (0, True, 40),
                          (2, True, 40)])
def test_the_fill_launch_remaps_block_ids_to_slots(count, keep_negative, null_slot):
    """``copy_rows_banks(remap=)``: the decode call's fill also rewrites SGLang's per-block
    expert ids to slots in its first launch (ids past several programs' steps; -1 and
    out-of-range ids kept; an expert without a slot reads slot 0, or with ``keep_negative``
    gets -1; with a ``null_slot``, it and the -1 ids read the null slot), copying as without
    it (count 0: ``remap_expert_ids_`` alone)."""
    from freetoken_sglang.kernels import fill

    g = torch.Generator().manual_seed(3)
    E = 16
    layer_slots = torch.randperm(40, generator=g)[:E].to(torch.int32)
    layer_slots[5] = -1
    ids = torch.randint(-1, E + 2, (1300,), generator=g, dtype=torch.int32)
    ids[:4] = torch.tensor([5, -1, E, 0], dtype=torch.int32)
    ok = (ids >= 0) & (ids < E)
    slot = layer_slots[ids.clamp(0, E - 1).long()]
    want = torch.where(ok, slot if keep_negative else slot.clamp(min=0), ids)
    if null_slot is not None:
        want = torch.where(ok, torch.where(slot < 0, null_slot, slot),
                           torch.where(ids == -1, null_slot, ids)).to(torch.int32)
        assert (want == null_slot).sum() > 2  # the -1 slot and several -1 ids
    srcs = [torch.randn(9, 3, 9000).to(torch.bfloat16)] + [torch.randn(9, 7) for _ in range(4)]
    dsts = [torch.zeros(4, *x.shape[1:], dtype=x.dtype) for x in srcs]
    before = [d.clone() for d in dsts]
    fill.copy_rows_banks(srcs, dsts, torch.tensor([7, 2, 5], dtype=torch.int32),
                         torch.tensor([1, 3, 0], dtype=torch.int32),
                         torch.tensor([count], dtype=torch.int32),
                         remap=(ids, layer_slots, keep_negative, null_slot))
    assert torch.equal(ids, want)
    for x, d, b in zip(srcs, dsts, before):
        assert torch.equal(d[0], b[0]) and torch.equal(d[2], b[2])
        assert torch.equal(d[1], x[7] if count else b[1])
        assert torch.equal(d[3], x[2] if count else b[3])


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
