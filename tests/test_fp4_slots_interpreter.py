"""The FP4 GPU-cache path (``execute/slot_moe.py``'s dequantized run over slots) against SGLang's
own Triton MoE over the dequantized experts, in Triton's interpreter on CPU tensors: one case
of ``test_gpu.py``'s ``test_fp4_slots_match_sglang_over_the_dequantized_experts`` (one pass
bit-identical, several passes within rounding, -1 entries), so CI covers what otherwise runs
only on a GPU.

Three pieces of SGLang 0.5.17 are CUDA-only and stand in here: ``fused_experts`` is a custom op
registered for CUDA, so the reference calls the function behind it (the private
``fused_moe.fused_experts_impl``, with ``fused_experts``' arguments); the token alignment's
``sgl_moe_align_block_size`` is imported only on CUDA, so ``align_block_size`` below does what
its kernel does (``sglang/kernels/jit/csrc/moe/moe_align_kernel.cu``); and the kernel-config
lookup asks for a device name (``fused_moe_triton_config.get_device_name``)."""

from __future__ import annotations

import importlib

import torch

from conftest import needs_interpreter
from test_gpu import check_fp4_slots

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


@needs_interpreter
def test_fp4_slots_match_sglang_in_the_interpreter(monkeypatch, published_server_args):
    fused_moe = importlib.import_module(FUSED_MOE + "fused_moe")
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "fused_moe_triton_config"),
                        "get_device_name", lambda *a: "cpu")
    monkeypatch.setattr(importlib.import_module(FUSED_MOE + "moe_align_block_size"),
                        "sgl_moe_align_block_size", align_block_size, raising=False)

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
