"""The FP4 GPU-cache paths in Triton's interpreter on CPU tensors, so CI covers what otherwise
runs only on a GPU: the dequantized run over slots (``execute/slot_moe.py``) against SGLang's
own Triton MoE over the dequantized experts (one case of ``test_gpu.py``'s
``test_fp4_slots_match_sglang_over_the_dequantized_experts``: one pass bit-identical, several
passes within rounding, -1 entries), and the direct kernels (``kernels/fp4_moe.py``) against
the float64 reference of the formats' definitions and against the dequantized run.

Three pieces of SGLang 0.5.17 are CUDA-only and stand in here: ``fused_experts`` is a custom op
registered for CUDA, so the reference calls the function behind it (the private
``fused_moe.fused_experts_impl``, with ``fused_experts``' arguments); the token alignment's
``sgl_moe_align_block_size`` is imported only on CUDA, so ``align_block_size`` below does what
its kernel does (``sglang/kernels/jit/csrc/moe/moe_align_kernel.cu``); and the kernel-config
lookup asks for a device name (``fused_moe_triton_config.get_device_name``). Two pieces of
Triton 3.8's interpreter differ from the GPU and are patched here: it multiplies bf16
``tl.dot`` operands as their uint16 bit patterns (``InterpreterBuilder.create_dot``), so
SGLang's GEMMs gave garbage (the same garbage on both sides of the comparison), and it
truncates fp32 -> bf16 casts where the GPU rounds to nearest even: ``bf16_dot`` and
``bf16_rtne``. SGLang's CPU fallbacks remain (its silu_and_mul rounds silu before the
product; the MXFP4 case's SwiGLU is the same compiled function as on CUDA)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from conftest import needs_interpreter
from test_gpu import assert_within_bf16_ulps, check_fp4_slots, fp4_case, fp4_reference

from freetoken_sglang.kernels.fp4 import _e2m1
from freetoken_sglang.kernels.fp4_moe import _e2m1_pair

FUSED_MOE = "sglang.srt.layers.moe.moe_runner.triton_utils."


def align_block_size(topk_ids, num_buckets, block_size, sorted_ids, expert_ids, num_post_pad,
                     cumsum, pad_sorted_ids, ignore_invalid_expert=False):
    """The CUDA ``moe_align_block_size`` with ``num_buckets = E + 1``: ids shifted by one (-1
    into bucket 0), each bucket's entries (stable order; the kernel's order inside a bucket
    is its atomics') padded to a multiple of ``block_size``, every block labelled with its
    bucket minus one, the padding rows ``numel``; ``cumsum`` is the kernel's scratch. SGLang's
    own torch version (``trtllm_lora_temp.virtual_experts._align_block_size_torch``) puts the
    -1 bucket last, unlike the kernel. ``test_gpu.py`` checks this one against the kernel."""
    assert not ignore_invalid_expert, "the stand-in does not implement ignore_invalid_expert"
    flat = topk_ids.reshape(-1).long() + 1
    counts = torch.bincount(flat, minlength=num_buckets)
    ends = torch.cumsum((counts + block_size - 1) // block_size * block_size, 0).tolist()
    if pad_sorted_ids:
        sorted_ids.fill_(flat.numel())
    order = torch.argsort(flat, stable=True).int()
    start = taken = 0
    for b, end in enumerate(ends):
        c = int(counts[b])
        sorted_ids[start:start + c] = order[taken:taken + c]
        expert_ids[start // block_size:end // block_size] = b - 1
        start, taken = end, taken + c
    num_post_pad[0] = ends[-1]


def bf16_dot(monkeypatch):
    """Triton's interpreter with bf16 ``tl.dot`` operands upcast to fp32 (exact) before its
    numpy matmul, instead of multiplied as uint16 bit patterns."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    create_dot = builder.create_dot

    def upcast(h):
        if h.dtype != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    monkeypatch.setattr(builder, "create_dot", lambda self, a, b, *rest: create_dot(
        self, upcast(a), upcast(b), *rest))


def bf16_rtne(monkeypatch):
    """Triton's interpreter with fp32 -> bf16 casts (SGLang's kernels' stores) rounded to
    nearest even, as the GPU rounds them, instead of truncated."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    cast_impl = builder.cast_impl

    def cast(self, src, dst_type):
        if src.dtype != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast_impl(self, src, dst_type)
        bits = src.data.astype(np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(src.data)
        return interpreter.TensorHandle(np.where(nan, (bits >> 16).astype(np.uint16) | 0x40,
                                                 rounded), tl.bfloat16)

    monkeypatch.setattr(builder, "cast_impl", cast)


#: Few programs per launch for the direct FP4 kernels in the interpreter, with partial blocks
#: at the test shapes (rows of I and H, code bytes)
INTERPRETER_BLOCKS = dict(BLOCK_N=64, BLOCK_H=64, BLOCK_K1=64, BLOCK_K2=32, WARPS_UP=4,
                          WARPS_DOWN=4)


def sglang_in_the_interpreter(monkeypatch):
    """Make SGLang's Triton MoE runnable on CPU tensors (the stand-ins above, ``bf16_dot``)
    and the direct FP4 kernels quick there (``INTERPRETER_BLOCKS``); returns SGLang's
    ``fused_moe`` module."""
    from freetoken_sglang.kernels import fp4_moe

    bf16_dot(monkeypatch)
    bf16_rtne(monkeypatch)
    monkeypatch.setattr(fp4_moe, "DEFAULT_BLOCKS", INTERPRETER_BLOCKS)
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "fused_moe_triton_config"),
                        "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "moe_align_block_size"),
                        "sgl_moe_align_block_size", align_block_size, raising=False)
    return importlib.import_module(FUSED_MOE + "fused_moe")


@needs_interpreter
def test_fp4_slots_match_sglang_in_the_interpreter(monkeypatch, published_server_args):
    fused_moe = sglang_in_the_interpreter(monkeypatch)

    def fused_experts(x, w13, w2, topk_output, c, b1=None, b2=None):
        weights, ids, _ = topk_output
        return fused_moe.fused_experts_impl(
            x, w13, w2, weights, ids, b1, b2, inplace=False, activation=c.activation,
            is_gated=c.is_gated, no_combine=c.no_combine,
            routed_scaling_factor=c.routed_scaling_factor, gemm1_alpha=c.gemm1_alpha,
            gemm1_limit=c.gemm1_clamp_limit, filter_expert=False, swiglu_limit=c.swiglu_limit,
            gate_up_interleaved=c.gate_up_interleaved)

    # GPT-OSS's MXFP4: biases, the clamped SwiGLU with alpha, interleaved gate/up rows
    check_fp4_slots("mxfp4", 1, "cpu", fused_experts, monkeypatch)


@needs_interpreter
@pytest.mark.parametrize("label", ["mxfp4", "nvfp4"])
def test_fp4_direct_kernels_in_the_interpreter(label, monkeypatch):
    """The direct FP4 kernels (``kernels/fp4_moe.py``), as ``run_on_slots_triton`` dispatches
    a decode-sized call (T*k <= ``DIRECT_FP4_MAX_PAIRS``) to them: MXFP4 with GPT-OSS's
    biases, SwiGLU (alpha, limit) and interleaved gate/up, NVFP4 with silu and
    routed_scaling_factor; T = 1 and 3 with a -1 entry; partial blocks in I, H and the code
    bytes; for MXFP4 also the other activations and options the kernels implement. Against
    the float64 reference of the formats' definitions within 1 bf16 ulp: the same rounding
    points, only the accumulation order (fp32 here) differs. (Against SGLang's kernels over
    the dequantized experts: ``check_fp4_slots``.) MXFP4 also: a routed expert without a slot
    (-1) reads slot 0, as SGLang's path does."""
    from freetoken_sglang.execute import slot_moe
    from freetoken_sglang.kernels import fp4_moe

    monkeypatch.setattr(fp4_moe, "DEFAULT_BLOCKS", INTERPRETER_BLOCKS)
    monkeypatch.setattr(slot_moe, "_run_dequantized", None)  # fails if dispatched there
    # T = 1 and 3, then at T = 1 the variants the config selects: SwiGLU on gate/up halves
    # (not interleaved), the limit alone (silu clamped), the router weight on the input,
    # fp16 activations (weights rounded to fp16)
    variants = [dict(T=1), dict(T=3)] + ([
        dict(gate_up_interleaved=False), dict(gemm1_alpha=None),
        dict(apply_router_weight_on_input=True), dict(dtype=torch.float16),
    ] if label == "mxfp4" else [])
    for i, v in enumerate(variants):
        c = fp4_case(label, v.pop("T", 1), "cpu", **v)
        slots, fills = c.slots, []
        if i == 0:  # the decode executor's fill: launched first, with nothing to remap
            slots = {n: torch.zeros_like(b) for n, b in c.slots.items()}

            def fill(remap):
                fills.append(remap)
                for n, b in slots.items():
                    b.copy_(c.slots[n])
        got = slot_moe.run_on_slots_triton(c.layer, c.x, c.weights, c.ids, c.layer_slots,
                                           slots, skip_negative_ids=True,
                                           fill=fill if i == 0 else None)
        assert fills == ([None] if i == 0 else [])
        ulps = 1 if c.x.dtype == torch.bfloat16 else 1 / 8  # an fp16 ulp
        assert_within_bf16_ulps(got, fp4_reference(c), ulps, f"{v}: accumulation order only")
    if label == "mxfp4":
        # A routed expert without a slot (-1: rows the decision treats as padding, e.g. in a
        # graph capture) reads slot 0, as SGLang's path after remap_expert_ids_ does, not
        # the memory before the bank (an illegal access on the GPU)
        c = fp4_case(label, 1, "cpu")
        e = int(c.ids[0, 0])
        runs = []
        for slot in (-1, 0):
            layer_slots = c.layer_slots.clone()
            layer_slots[e] = slot
            runs.append(slot_moe.run_on_slots_triton(c.layer, c.x, c.weights, c.ids,
                                                     layer_slots, c.slots))
        assert torch.equal(runs[0], runs[1])


@triton.jit
def _decode_every_byte(out_ptr):
    byte = tl.arange(0, 256)
    lo, hi = _e2m1_pair(byte)
    tl.store(out_ptr + byte, lo)
    tl.store(out_ptr + 256 + byte, hi)
    tl.store(out_ptr + 512 + byte, _e2m1(byte & 15))
    tl.store(out_ptr + 768 + byte, _e2m1(byte >> 4))


@needs_interpreter
def test_e2m1_pair_decodes_every_byte_as_the_dequantizer():
    """``fp4_moe._e2m1_pair`` (bits placed, one multiply) equals ``fp4._e2m1`` (the
    dequantizer's arithmetic) bit for bit on all 256 bytes, -0.0 included."""
    out = torch.empty(4, 256)
    _decode_every_byte[(1,)](out)
    assert torch.equal(out[:2].view(torch.int32), out[2:].view(torch.int32))
    assert str(out[0, 8].item()) == "-0.0" and out[1, 0x75].item() == 6.0
