"""Quantized experts on the CPU-run SGLang: FP8 with block scales and NVFP4 (ModelOpt FP4)
(``experts/formats.py``).

Stock SGLang 0.5.17 cannot run FP8 MoE layers on the CPU engine: its CPU path needs
sgl_kernel's AMX FP8 kernels, which the CPU stand-in (``tests/stubs``) does not have, and FP8
needs BF16 or FP16 activations. So each FP8 checkpoint here comes with its dequantized twin
(``tiny_quant.py``: the same checkpoint, each routed expert replaced by its dequantized
values, exact in BF16), and FreeToken serving the FP8 checkpoint is held to stock SGLang
serving the twin (the slot MoE: fills, streamed prefill); the C executor on FP8 is held to
the C executor on the twin's dense experts. On the GPU the check is against stock SGLang on
the FP8 checkpoint itself (``benchmarks/gpu_equality.py --quant fp8_block``). The C
executor's FP8, MXFP4 and NVFP4 kernels are checked against a float64 reference in
``test_cpu_executor_quant.py``; the refusal of other quantizations is in ``test_startup.py``.

NVFP4: stock SGLang 0.5.17 cannot run it on the CPU engine either (its
``ModelOptNvFp4FusedMoEMethod`` needs Blackwell kernels or Marlin on a CUDA GPU), so it too is
held to stock SGLang serving its dequantized twin (``tiny_quant.write_nvfp4``).
"""

from __future__ import annotations

import pytest

import torch

from freetoken_sglang.experts.formats import dequantize_nvfp4
from freetoken_sglang.tiny_quant import nvfp4_quantize, write_fp8_block, write_nvfp4
from conftest import needs_interpreter
from inproc import run_check
from test_e2e_families import CACHE_25, CHUNK, FAMILY_SHAPES, POLICIES, assert_same_tokens, serve_and_collect

BF16 = ["--dtype", "bfloat16"]


@pytest.fixture(scope="session")
def fp8_checkpoint(tiny_checkpoint, tiny_dir):
    """(family, dtype) -> (FP8-block checkpoint, its dequantized twin), block [16, 16]."""

    def build(family, dtype="bfloat16"):
        src = tiny_checkpoint(family, dtype=dtype, **FAMILY_SHAPES[family])
        out = tiny_dir / f"{family}-{dtype}-fp8"
        return write_fp8_block(src, str(out), str(out) + "-twin")

    return build


def test_fp8_pool_rows_hold_the_checkpoint_codes_and_scales(fp8_checkpoint):
    path, _ = fp8_checkpoint("deepseek_v3")
    r = run_check("pool_layout", path, freetoken_cache_ratio=0.5, dtype="bfloat16")
    # gate, up and down of every expert, each its FP8 codes and its block scales, bit for bit
    assert r["checked"] == r["rows"] * 6
    assert r["mismatches"] == []
    assert r["params_are_views"] is True and r["expert_params_on_cpu"] is True


def test_fp8_dummy_load_fills_the_pool_with_stock_values(fp8_checkpoint):
    """--load-format dummy: FP8 codes drawn as stock draws them (in FP16, then converted)."""
    path, _ = fp8_checkpoint("deepseek_v3")
    r = run_check("dummy_values", path, freetoken_cache_ratio=0.5, dtype="bfloat16")
    assert set(r["banks"]) == {"w13_weight", "w2_weight", "w13_weight_scale_inv",
                               "w2_weight_scale_inv"}
    for name, bank in r["banks"].items():
        assert bank["nonzero"] is True, name
        assert bank["layers_equal_to_stock"] == [True] * r["layers"], name


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_fp8_block_matches_stock_on_the_dequantized_twin(fp8_checkpoint, family, tmp_path):
    """Fill policy at 25%: fills move the FP8 codes and their scales; prefill streams them."""
    path, twin = fp8_checkpoint(family)
    want, _, _ = serve_and_collect(twin, CHUNK + BF16, str(tmp_path / "stock.log"))
    got, stats, log = serve_and_collect(
        path, CHUNK + BF16 + CACHE_25 + POLICIES["fill"], str(tmp_path / "ft.log")
    )
    assert "w13_weight_scale_inv[" in log and "float8_e4m3fn" in log
    assert_same_tokens(got, want, f"{family} fp8 fill")
    assert stats["total"]["fills"] > 0 and stats["prefill_stream"]["layer_calls"] > 0
    assert stats["pool"]["expert_bytes"] == sum(
        n * size for n, size in (
            (3 * 32 * 64, 1),  # w13 [2I, H] and w2 [H, I] codes, one byte each (I = 32, H = 64)
            ((4 * 4 + 4 * 2), 4),  # fp32 scales: [2I/16, H/16] and [H/16, I/16]
        )
    )


def test_nvfp4_codes_round_trip():
    # by the format's definition: e2m1 code 7 = 6, code 1 | sign 8 = -0.5, low nibble first;
    # the amax 6 * 448 maps to scale_2 = 2^0 and its block's e4m3 scale to 448
    known = torch.zeros(2, 32)
    known[0, :2] = torch.tensor([6.0 * 448, -0.5 * 448])
    known[1, 16:18] = torch.tensor([3.0, -1.5])  # block scale 0.5: codes 6 and -3
    q, s, s2 = nvfp4_quantize(known)
    assert float(s2) == 1.0 and float(s[0, 0]) == 448 and int(q[0, 0]) == 7 | (9 << 4)
    assert float(s[1, 1]) == 0.5 and int(q[1, 8]) == 7 | (0xD << 4)
    assert torch.equal(dequantize_nvfp4(q[None], s[None], s2[None], torch.float32)[0], known)
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    q, s, s2 = nvfp4_quantize(w)
    d = dequantize_nvfp4(q[None], s[None], s2[None], torch.float32)[0]
    assert q.shape == (4, 32) and s.shape == (4, 4) and s2.shape == ()
    assert ((d - w).abs() <= s.float().repeat_interleave(16, -1) * s2).all()  # half the widest gap
    # [n, 2] scale_2: the first half of the rows (gate) by the first, the second (up) by the other
    two = dequantize_nvfp4(q[None], s[None], torch.tensor([[1.0, 4.0]]), torch.float32)[0]
    one = dequantize_nvfp4(q[None], s[None], torch.tensor([1.0]), torch.float32)[0]
    assert torch.equal(two[:2], one[:2]) and torch.equal(two[2:], 4 * one[2:])


@needs_interpreter
def test_fp4_kernel_matches_the_definitions_and_a_call_dequantizes_its_distinct_experts():
    """The GPU cache's FP4 path (execute/slot_moe.py): the Triton kernel exactly as the
    definitions (MXFP4's is SGLang's ``MXFP4QuantizeUtil``); the rows a call dequantizes are
    its distinct experts."""
    from freetoken_sglang.execute.slot_moe import distinct_experts
    from freetoken_sglang.experts.formats import dequantize_mxfp4

    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (2, 4, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(115, 135, (2, 4, 2), dtype=torch.uint8, generator=g)
    # the GPU cache's kernel (kernels/fp4.py; here in Triton's interpreter): bit-identical
    # to the definitions, from any slot rows, every output dtype
    from freetoken_sglang.experts.formats import dequantize_nvfp4
    from freetoken_sglang.kernels.fp4 import dequantize_fp4_rows

    rows = torch.tensor([1, 0, 1])
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    e4m3 = e4m3[~torch.isnan(e4m3.float())]  # every finite e4m3 value may be a block scale
    nv_scale = e4m3[torch.randint(0, e4m3.numel(), (2, 4, 4), generator=g)]
    out = dequantize_fp4_rows(w, scale, None, torch.tensor([1, -1]), torch.float32)
    assert torch.equal(out[0], dequantize_mxfp4(w[1:], scale[1:], torch.float32)[0])
    # a -1 row (unused) reads and writes nothing: here the bytes before the banks (an expert
    # of the same shape) are readable; on the GPU they may be unmapped (an illegal address)
    nv_big = torch.cat([nv_scale[:1], nv_scale])
    for sc, s2 in ((torch.cat([scale[:1], scale]), None),
                   (nv_big, torch.tensor([0.5, 0.3, 1.7]))):
        out = torch.full((2, 4, 64), 123.0)
        dequantize_fp4_rows(torch.cat([w[:1], w])[1:], sc[1:], None if s2 is None else s2[1:],
                            torch.tensor([1, -1]), torch.float32, out=out)
        assert torch.equal(out[1], torch.full((4, 64), 123.0))
    with pytest.raises(ValueError, match="out must be a contiguous torch.float32 tensor"):
        dequantize_fp4_rows(w, scale, None, torch.tensor([1, -1]), torch.float32,
                            out=torch.empty(2, 4, 63))
        assert torch.equal(out[0], dequantize_fp4_rows(
            w, sc[1:], None if s2 is None else s2[1:], torch.tensor([1]), torch.float32)[0])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_fp4_rows(w, scale, None, rows, dtype),
                           dequantize_mxfp4(w[rows], scale[rows], dtype))
        for s2 in (torch.tensor([0.3, 1.7]), torch.tensor([[0.3, 0.01], [1.7, 2.0]])):
            assert torch.equal(dequantize_fp4_rows(w, nv_scale, s2, rows, dtype),
                               dequantize_nvfp4(w[rows], nv_scale[rows], s2[rows], dtype))
    ids = torch.tensor([[5, 3, -1], [3, 9, 0]])
    experts, row_of = distinct_experts(ids, 12)
    assert experts.tolist() == [0, 3, 5, 9, -1, -1]  # ascending, then -1 (unused rows)
    assert row_of.tolist() == [0, -1, -1, 1, -1, 2, -1, -1, -1, 3, -1, -1]
    experts, row_of = distinct_experts(torch.tensor([[1, 1], [3, -1]]), 4)  # T k >= E
    assert experts.tolist() == [1, 3, -1, -1] and row_of.tolist() == [-1, 0, -1, 1]
    # a pass over rows [2, 4) of {1, 3, 5, 6}: its experts remapped, the others' blocks -1
    from freetoken_sglang.kernels.residency import remap_expert_ids_

    _, row_of = distinct_experts(torch.tensor([[1, 3], [5, 6]]), 8)
    table = torch.where((row_of >= 2) & (row_of < 4), row_of - 2, -1).to(torch.int32)
    blocks = torch.tensor([1, 3, 5, 6, -1], dtype=torch.int32)
    remap_expert_ids_(blocks, table, keep_negative=True)
    assert blocks.tolist() == [-1, -1, 0, 1, -1]


@pytest.fixture(scope="session")
def nvfp4_checkpoint(tiny_checkpoint, tiny_dir):
    """dtype -> (NVFP4 qwen2_moe checkpoint, its dequantized twin), ``dtype`` elsewhere."""

    def build(dtype="bfloat16"):
        src = tiny_checkpoint("qwen2_moe", dtype=dtype, **FAMILY_SHAPES["qwen2_moe"])
        out = tiny_dir / f"qwen2_moe-{dtype}-nvfp4"
        return write_nvfp4(src, str(out), str(out) + "-twin")

    return build


def test_nvfp4_pool_rows_hold_the_checkpoint_codes_and_scales_and_dummy_values(
        nvfp4_checkpoint):
    path, _ = nvfp4_checkpoint()
    r = run_check("pool_layout", path, freetoken_cache_ratio=0.5, dtype="bfloat16")
    # gate, up and down of every expert, each its e2m1 codes, e4m3 block scales, scale_2 and
    # input scale, bit for bit
    assert r["checked"] == r["rows"] * 12
    assert r["mismatches"] == []
    assert r["params_are_views"] is True and r["expert_params_on_cpu"] is True
    # --load-format dummy: float banks drawn as stock draws them, the codes left as created
    r = run_check("dummy_values", path, freetoken_cache_ratio=0.5, dtype="bfloat16")
    assert all(b["layers_equal_to_stock"] == [True] * r["layers"] for b in r["banks"].values())
    assert [n for n, b in r["banks"].items() if not b["nonzero"]] == ["w13_weight", "w2_weight"]


def test_nvfp4_matches_stock_on_the_dequantized_twin(nvfp4_checkpoint, tmp_path):
    """Fill policy at 25%: a fill moves an expert's NVFP4 codes and all its scales (its slot
    dequantized for SGLang's native MoE); prefill streams them."""
    path, twin = nvfp4_checkpoint()
    want, _, _ = serve_and_collect(twin, CHUNK + BF16, str(tmp_path / "stock.log"))
    got, stats, log = serve_and_collect(
        path, CHUNK + BF16 + CACHE_25 + POLICIES["fill"], str(tmp_path / "ft.log"))
    assert "w13_weight_scale_2[2]:float32" in log and "float8_e4m3fn" in log
    assert_same_tokens(got, want, "nvfp4 fill")
    assert stats["total"]["fills"] > 0 and stats["prefill_stream"]["layer_calls"] > 0
    assert stats["pool"]["expert_bytes"] == sum(
        n * size for n, size in (
            (3 * 32 * 64 // 2, 1),  # w13 [2I, H/2] and w2 [H, I/2] codes (I = 32, H = 64)
            (3 * 32 * 64 // 16, 1),  # e4m3 scales per 16
            (2 + 1 + 2 + 1, 4),  # fp32 scale_2 (gate, up; down) and input scales
        )
    )


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
def test_quantized_experts_on_the_cpu_executor(fmt, fp8_checkpoint, nvfp4_checkpoint,
                                               tmp_path):
    """Every routed expert on the C executor (``--freetoken-backend cpu``), which dequantizes
    FP8 and NVFP4 in its kernels: the same tokens as the C executor on the twin's FP16 experts
    (the dense path, itself token-identical to stock SGLang in fp32: test_e2e_families.py).
    Stock's own FP16 MoE rounds every step to FP16 where the executor accumulates in fp32, so
    against stock the tokens of these tiny random models part within a few steps (and SGLang
    refuses FP32 activations with NVFP4)."""
    if fmt == "fp8_block":
        (path, twin), bank = fp8_checkpoint("qwen2_moe", "float16"), "w13_weight_scale_inv["
    else:
        (path, twin), bank = nvfp4_checkpoint("float16"), "w13_weight_scale_2[2]:float32"
    flags = CHUNK + ["--dtype", "float16", "--enable-freetoken", "--freetoken-backend", "cpu"]
    want, _, _ = serve_and_collect(twin, flags, str(tmp_path / "dense.log"))
    got, stats, log = serve_and_collect(path, flags, str(tmp_path / f"{fmt}.log"))
    assert bank in log
    assert_same_tokens(got, want, f"{fmt} on the C executor")
    assert stats["total"]["cpu"] == stats["total"]["reads"] > 0


@pytest.mark.parametrize("serialized,needle", [
    (False, "online FP8 quantization of a BF16 checkpoint (--quantization fp8) is not served"),
    (True, "FP8 without weight_block_size"),
])
def test_fp8_methods_the_format_refuses_fail_with_its_reason(serialized, needle):
    """``--quantization fp8`` on a BF16 checkpoint, and FP8 without block scales: the format's
    one-line refusal (its Triton arguments are built only for a method it accepts)."""
    from types import SimpleNamespace

    from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod

    from freetoken_sglang.experts.formats import format_for_method
    from freetoken_sglang.families import UnsupportedModelError
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    base = Fp8MoEMethod(Fp8Config(is_checkpoint_fp8_serialized=serialized))
    fmt = format_for_method(base)
    rt = SimpleNamespace(backend="gpu", device=torch.device("cpu"))
    method = FreeTokenMoEMethod(rt, base, fmt, None)
    with pytest.raises(UnsupportedModelError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        method.create_weights(torch.nn.Module(), 4, 32, 16, torch.bfloat16)
