"""Quantized experts on the CPU-run SGLang: FP8 with block scales (``experts/formats.py``).

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
"""

from __future__ import annotations

import pytest

from freetoken_sglang.tiny_quant import write_fp8_block
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


def test_fp8_block_on_the_cpu_executor(fp8_checkpoint, tmp_path):
    """Every routed expert on the C executor (``--freetoken-backend cpu``), which dequantizes
    FP8 in its kernels: the same tokens as the C executor on the twin's FP16 experts (the
    dense path, itself token-identical to stock SGLang in fp32: test_e2e_families.py). Stock's
    own FP16 MoE rounds every step to FP16 where the executor accumulates in fp32, so against
    stock the tokens of these tiny random models part within a few steps."""
    path, twin = fp8_checkpoint("qwen2_moe", "float16")
    flags = CHUNK + ["--dtype", "float16", "--enable-freetoken", "--freetoken-backend", "cpu"]
    want, _, _ = serve_and_collect(twin, flags, str(tmp_path / "dense.log"))
    got, stats, log = serve_and_collect(path, flags, str(tmp_path / "fp8.log"))
    assert "float8_e4m3fn" in log
    assert_same_tokens(got, want, "fp8 on the C executor")
    assert stats["total"]["cpu"] == stats["total"]["reads"] > 0
