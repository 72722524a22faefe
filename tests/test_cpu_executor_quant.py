"""Quantized weight formats (FP8 block, MXFP4, NVFP4) and the GPT-OSS activation of the C
expert executor, against a float64 reference that dequantizes with each format's definition."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from freetoken_sglang.cpu.executor import ISAS, CpuExpertExecutor

AVAILABLE = CpuExpertExecutor.available_isas()
FP8 = torch.float8_e4m3fn
TOL = 1e-2  # max abs error / max abs reference
TOKENS = (1, 3, 64)
THREADS = 3


def isa_params():
    return [
        pytest.param(
            isa,
            marks=pytest.mark.skipif(
                isa not in AVAILABLE, reason=f"this CPU lacks the {isa} kernel path"
            ),
        )
        for isa in ISAS
    ]


# ---- the formats' definitions (independent of the executor) ---------------------------------

E2M1 = torch.tensor(
    [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64
)


def e2m1_codes(packed):
    """uint8 [..., C/2] -> codes [..., C]: the low nibble is element 2j, the high one 2j+1."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def expand(scale, rows, cols, bn, bk):
    return scale.repeat_interleave(bn, 1)[:, :rows].repeat_interleave(bk, 2)[:, :, :cols]


def dequant(banks, fmt, block_shape=None, gated=True, interleaved=False):
    """float64 (w13 [N, R, H], w2 [N, H, I]) from quantized banks."""
    w13, w2 = banks["w13_weight"], banks["w2_weight"]
    if fmt == "fp8_block":
        bn, bk = block_shape
        n, r, h = w13.shape
        i = w2.shape[2]
        s13 = banks["w13_weight_scale_inv"].double()
        if s13.shape[1] == 2 * math.ceil(i / bn) and s13.shape[1] != math.ceil(r / bn):
            half = s13.shape[1] // 2  # gate and up blocked separately
            e13 = torch.cat([expand(s13[:, :half], i, h, bn, bk),
                             expand(s13[:, half:], i, h, bn, bk)], dim=1)
        else:
            e13 = expand(s13, r, h, bn, bk)
        d13 = w13.to(torch.float64) * e13
        d2 = w2.to(torch.float64) * expand(banks["w2_weight_scale_inv"].double(), h, i, bn, bk)
        return d13, d2
    gs = 32 if fmt == "mxfp4" else 16

    def deq(q, s):
        v = E2M1[e2m1_codes(q).long()]
        if fmt == "mxfp4":
            sv = 2.0 ** (s.double() - 127)
        else:
            sv = s.to(torch.float64)
        return v * sv.repeat_interleave(gs, -1)

    d13 = deq(w13, banks["w13_weight_scale"])
    d2 = deq(w2, banks["w2_weight_scale"])
    if fmt == "nvfp4":
        s2_13 = banks["w13_weight_scale_2"].double().reshape(w13.shape[0], -1)
        r = w13.shape[1]
        if s2_13.shape[1] == 2:
            is_up = torch.arange(r) % 2 == 1 if interleaved else torch.arange(r) >= r // 2
            d13 = d13 * torch.where(is_up[None, :], s2_13[:, 1:2], s2_13[:, 0:1])[:, :, None]
        else:
            d13 = d13 * s2_13[:, :, None]
        d2 = d2 * banks["w2_weight_scale_2"].double().reshape(-1)[:, None, None]
    return d13, d2


def reference(w13, w2, banks, x, rows, experts, weights, act, interleaved=False,
              alpha=None, limit=None):
    """float64 MoE on dequantized weights."""
    inter = w2.shape[2]
    rows, experts, weights = rows.long(), experts.long(), weights.double()
    h = torch.einsum("nrh,nh->nr", w13[experts], x.double()[rows])
    if "w13_weight_bias" in banks:
        h = h + banks["w13_weight_bias"].double()[experts]
    if w13.shape[1] == 2 * inter:
        gate, up = (h[:, 0::2], h[:, 1::2]) if interleaved else (h[:, :inter], h[:, inter:])
        if act == "swiglu_oai":
            gate = gate.clamp(max=limit)
            up = up.clamp(min=-limit, max=limit)
            a = gate * torch.sigmoid(gate * alpha) * (up + 1)
        elif act == "silu":
            a = F.silu(gate) * up
        else:
            a = F.gelu(gate, approximate="tanh") * up
    else:
        a = F.silu(h) if act == "silu" else F.gelu(h, approximate="tanh")
    y = torch.einsum("nhi,ni->nh", w2[experts], a)
    if "w2_weight_bias" in banks:
        y = y + banks["w2_weight_bias"].double()[experts]
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    out.index_add_(0, rows, weights[:, None] * y)
    return out


# ---- random quantized banks ----------------------------------------------------------------


def make_fp8(gen, n, h, i, block, gated=True, split=False):
    bn, bk = block
    r = 2 * i if gated else i
    w13 = torch.randn(n, r, h, generator=gen).mul(8).to(FP8)
    w2 = torch.randn(n, h, i, generator=gen).mul(8).to(FP8)
    rows13 = 2 * math.ceil(i / bn) if split else math.ceil(r / bn)

    def scale(*shape, fan_in):
        return (0.5 + torch.rand(*shape, generator=gen)) / (8 * fan_in**0.5)

    return {
        "w13_weight": w13,
        "w2_weight": w2,
        "w13_weight_scale_inv": scale(n, rows13, math.ceil(h / bk), fan_in=h),
        "w2_weight_scale_inv": scale(n, math.ceil(h / bn), math.ceil(i / bk), fan_in=i),
    }


def make_fp4(gen, fmt, n, h, i, gated=True, scale_2_shape="auto"):
    r = 2 * i if gated else i
    banks = {
        "w13_weight": torch.randint(0, 256, (n, r, h // 2), generator=gen, dtype=torch.uint8),
        "w2_weight": torch.randint(0, 256, (n, h, i // 2), generator=gen, dtype=torch.uint8),
    }
    if fmt == "mxfp4":  # e8m0 around 2^-2 / sqrt(fan_in)
        for name, rows, cols in (("w13", r, h), ("w2", h, i)):
            centre = 127 - 2 - round(math.log2(cols) / 2)
            banks[f"{name}_weight_scale"] = torch.randint(
                centre - 2, centre + 2, (n, rows, cols // 32), generator=gen, dtype=torch.uint8
            )
    else:  # e4m3 block scales in [0.5, 8), per-tensor scale_2 ~ 1 / (8 sqrt(fan_in))
        for name, rows, cols in (("w13", r, h), ("w2", h, i)):
            banks[f"{name}_weight_scale"] = (
                0.5 + 7.5 * torch.rand(n, rows, cols // 16, generator=gen)
            ).to(FP8)
        shape2 = (n, 2) if gated else (n,)
        if scale_2_shape != "auto":
            shape2 = scale_2_shape
        banks["w13_weight_scale_2"] = (0.5 + torch.rand(*shape2, generator=gen)) / (16 * h**0.5)
        banks["w2_weight_scale_2"] = (0.5 + torch.rand(n, generator=gen)) / (16 * i**0.5)
    return banks


def add_biases(gen, banks, n, r, h, dtype):
    banks["w13_weight_bias"] = (0.5 * torch.randn(n, r, generator=gen)).to(dtype)
    banks["w2_weight_bias"] = (0.5 * torch.randn(n, h, generator=gen)).to(dtype)
    return banks


def route(gen, tokens, topk, n_experts):
    rows = torch.arange(tokens, dtype=torch.int32).repeat_interleave(topk)
    experts = torch.cat(
        [torch.randperm(n_experts, generator=gen)[:topk] for _ in range(tokens)]
    ).to(torch.int32)
    return rows, experts, torch.rand(rows.numel(), generator=gen)


def max_rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


# ---- numerics ------------------------------------------------------------------------------

N_EXPERTS, TOPK = 10, 4
OAI = dict(gemm1_alpha=1.702, gemm1_limit=7.0)

# name: (format, builder kwargs, gated, bias dtype or None, activation, interleaved, x dtype)
CASES = {
    "fp8_128_partial_silu": ("fp8_block", dict(h=200, i=136, block=(128, 128)), True, None,
                             "silu", False, torch.float32),
    "fp8_odd_block_bias": ("fp8_block", dict(h=100, i=72, block=(48, 40)), True,
                           torch.float32, "silu", False, torch.bfloat16),
    "fp8_split_scales": ("fp8_block", dict(h=96, i=72, block=(64, 64), split=True), True,
                         None, "silu", False, torch.float32),
    "fp8_not_gated_gelu": ("fp8_block", dict(h=70, i=50, block=(16, 32)), False, None,
                           "gelu", False, torch.float32),
    "fp8_oai_interleaved": ("fp8_block", dict(h=130, i=64, block=(32, 128)), True,
                            torch.float32, "swiglu_oai", True, torch.float32),
    "mxfp4_oai_interleaved": ("mxfp4", dict(h=96, i=160), True, torch.bfloat16,
                              "swiglu_oai", True, torch.float32),
    "mxfp4_oai_halves": ("mxfp4", dict(h=160, i=96), True, torch.bfloat16, "swiglu_oai",
                         False, torch.bfloat16),
    "mxfp4_silu": ("mxfp4", dict(h=96, i=32), True, None, "silu", False, torch.float32),
    "nvfp4_silu": ("nvfp4", dict(h=96, i=80), True, None, "silu", False, torch.float32),
    "nvfp4_not_gated_bias": ("nvfp4", dict(h=48, i=112), False, torch.float32, "silu",
                             False, torch.float32),
    "nvfp4_oai_interleaved": ("nvfp4", dict(h=160, i=48), True, torch.bfloat16,
                              "swiglu_oai", True, torch.float32),
    "bf16_oai_interleaved": ("bf16", dict(h=72, i=40), True, torch.float32, "swiglu_oai",
                             True, torch.float32),
    # H, I % 32 == 0: the experts of the 64-token call run on tiles under the AMX paths
    "bf16_oai_interleaved_tiled": ("bf16", dict(h=64, i=96), True, torch.float32,
                                   "swiglu_oai", True, torch.float32),
    "fp32_oai_halves": ("fp32", dict(h=40, i=24), True, None, "swiglu_oai", False,
                        torch.float32),
}


def build(gen, name):
    fmt, kw, gated, bias, act, il, x_dtype = CASES[name]
    h, i = kw["h"], kw["i"]
    if fmt == "fp8_block":
        banks = make_fp8(gen, N_EXPERTS, h, i, kw["block"], gated, kw.get("split", False))
    elif fmt in ("mxfp4", "nvfp4"):
        banks = make_fp4(gen, fmt, N_EXPERTS, h, i, gated)
    else:
        dt = torch.bfloat16 if fmt == "bf16" else torch.float32
        r = 2 * i if gated else i
        banks = {
            "w13_weight": (torch.randn(N_EXPERTS, r, h, generator=gen) / h**0.5).to(dt),
            "w2_weight": (torch.randn(N_EXPERTS, h, i, generator=gen) / i**0.5).to(dt),
        }
    if bias is not None:
        add_biases(gen, banks, N_EXPERTS, 2 * i if gated else i, h, bias)
    kwargs = dict(gate_up_interleaved=il)
    if fmt == "fp8_block":
        kwargs["block_shape"] = list(kw["block"])
    if act == "swiglu_oai":
        kwargs.update(OAI)
    else:
        kwargs["activation"] = act
    return banks, kwargs


@pytest.mark.parametrize("isa", isa_params())
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_float64_dequantized_reference(isa, case):
    fmt, kw, gated, bias, act, il, x_dtype = CASES[case]
    gen = torch.Generator().manual_seed(sorted(CASES).index(case) * 10 + ISAS.index(isa))
    banks, kwargs = build(gen, case)
    if fmt in ("fp8_block", "mxfp4", "nvfp4"):
        w13, w2 = dequant(banks, fmt, kw.get("block"), gated, il)
    else:
        w13, w2 = banks["w13_weight"].double(), banks["w2_weight"].double()
    with CpuExpertExecutor(banks, isa=isa, num_threads=THREADS, **kwargs) as ex:
        assert ex.isa == isa
        assert ex.weight_format == fmt
        assert ex.activation == act
        assert (ex.hidden_size, ex.intermediate_size, ex.gated) == (kw["h"], kw["i"], gated)
        for tokens in TOKENS:
            x = (4 * torch.randn(tokens, kw["h"], generator=gen)).to(x_dtype)
            rows, experts, weights = route(gen, tokens, TOPK, N_EXPERTS)
            out = ex.run(x, rows, experts, weights, torch.zeros(tokens, kw["h"]))
            ref = reference(w13, w2, banks, x, rows, experts, weights, act, il,
                            OAI["gemm1_alpha"], OAI["gemm1_limit"])
            err = max_rel_err(out, ref)
            assert err < TOL, f"{case} {isa} tokens={tokens}: relative error {err:.3g}"


@pytest.mark.parametrize("isa", isa_params())
def test_every_e4m3_code_subnormals_included(isa):
    """One expert whose w13 rows hold every finite e4m3 code (and w2 is the identity up to a
    scale), so that a wrong conversion of any code shows up."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    h, i = codes.numel(), 16  # 254 columns: partial blocks of 128
    gen = torch.Generator().manual_seed(1)
    w13 = torch.stack([codes.roll(k) for k in range(2 * i)])[None].view(FP8)
    eye = torch.zeros(h, i)
    eye[:i, :i] = torch.eye(i)
    banks = {
        "w13_weight": w13.contiguous(),
        "w2_weight": eye[None].to(FP8),
        "w13_weight_scale_inv": torch.rand(1, 1, 2, generator=gen) + 0.5,
        "w2_weight_scale_inv": torch.ones(1, 2, 1),
    }
    x = torch.randn(2, h, generator=gen) / 1000
    rows = torch.tensor([0, 1], dtype=torch.int32)
    experts = torch.zeros(2, dtype=torch.int32)
    weights = torch.ones(2)
    d13, d2 = dequant(banks, "fp8_block", (128, 128))
    assert torch.isfinite(d13).all()
    with CpuExpertExecutor(banks, isa=isa, block_shape=(128, 128), num_threads=2) as ex:
        out = ex.run(x, rows, experts, weights, torch.zeros(2, h))
    ref = reference(d13, d2, banks, x, rows, experts, weights, "silu")
    assert max_rel_err(out, ref) < 1e-5


def test_isa_paths_agree_and_weight_format_is_read_only():
    gen = torch.Generator().manual_seed(3)
    banks = make_fp4(gen, "mxfp4", 4, 64, 96)
    x = torch.randn(5, 64, generator=gen)
    rows, experts, weights = route(gen, 5, 2, 4)
    outs = []
    with CpuExpertExecutor(banks, num_threads=2, **OAI) as ex:
        assert ex.activation == "swiglu_oai" and ex.weight_format == "mxfp4"
        with pytest.raises(AttributeError):
            ex.weight_format = "bf16"
        for isa in AVAILABLE:
            ex.set_isa(isa)
            outs.append(ex.run(x, rows, experts, weights, torch.zeros(5, 64)))
    for o in outs[1:]:
        assert max_rel_err(o, outs[0].double()) < 1e-5


# ---- errors --------------------------------------------------------------------------------


def test_bad_quantized_banks_name_the_bank():
    gen = torch.Generator().manual_seed(0)
    fp8 = make_fp8(gen, 3, 64, 48, (32, 32))
    mx = make_fp4(gen, "mxfp4", 3, 64, 32)
    nv = make_fp4(gen, "nvfp4", 3, 64, 32)
    blk = dict(block_shape=[32, 32])
    cases = [
        ({**fp8, "w13_weight_scale_inv": fp8["w13_weight_scale_inv"][:, :2].contiguous()}, blk,
         r"'w13_weight_scale_inv' must be float32 \[3, 3, 2\], got float32 \[3, 2, 2\]"),
        ({**fp8, "w2_weight_scale_inv": fp8["w2_weight_scale_inv"].double()}, blk,
         "'w2_weight_scale_inv' must be float32"),
        ({k: v for k, v in fp8.items() if k != "w2_weight_scale_inv"}, blk,
         "lack 'w2_weight_scale_inv'"),
        (fp8, {}, "block_shape"),
        ({**fp8, "w2_weight": fp8["w2_weight"].to(torch.bfloat16)}, blk, "'w2_weight'"),
        ({**mx, "w13_weight_scale": mx["w13_weight_scale"][:, :, :1].contiguous()}, {},
         r"'w13_weight_scale' must be uint8 \[3, 64, 2\], got uint8 \[3, 64, 1\]"),
        ({**mx, "w2_weight_scale": mx["w2_weight_scale"][:2].contiguous()}, {},
         r"'w2_weight_scale' must be uint8 \[3, 64, 1\]"),
        ({**nv, "w13_weight_scale": nv["w13_weight_scale"].view(torch.uint8)[:, :, :2]
          .contiguous().view(FP8)}, {}, r"'w13_weight_scale' must be float8_e4m3fn \[3, 64, 4\]"),
        ({k: v for k, v in nv.items() if k != "w13_weight_scale_2"}, {},
         "lack 'w13_weight_scale_2'"),
        ({**nv, "w13_weight_scale_2": torch.ones(3, 3)}, {}, "'w13_weight_scale_2' must be"),
        ({**nv, "w2_weight_scale_2": torch.ones(2)}, {}, "'w2_weight_scale_2' must be"),
        ({**mx, "w13_weight_bias": torch.zeros(3, 64, dtype=torch.float16)}, {},
         "'w13_weight_bias' must be"),
        ({k: v for k, v in mx.items() if k != "w13_weight_scale"}, {}, "'w13_weight_scale'"),
    ]
    for banks, kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            CpuExpertExecutor(banks, **kwargs)
    with pytest.raises(ValueError, match="multiples of 32"):
        CpuExpertExecutor(make_fp4(gen, "mxfp4", 2, 48, 32))
    with pytest.raises(ValueError, match="gemm1_limit"):
        CpuExpertExecutor(mx, gemm1_alpha=1.702)
    with pytest.raises(ValueError, match="gated"):
        CpuExpertExecutor(make_fp4(gen, "mxfp4", 2, 64, 32, gated=False), **OAI)
    with pytest.raises(ValueError, match="gate_up_interleaved"):
        CpuExpertExecutor(make_fp4(gen, "nvfp4", 2, 64, 32, gated=False),
                          gate_up_interleaved=True)
