"""Run SGLang's own fused-MoE computation over the GPU slot banks instead of a layer's
``[E, ...]`` weights, so the routed-expert math is exactly what stock SGLang computes.

On CUDA this is the Triton runner's sequence (``fused_experts_impl`` in SGLang 0.5.17's
``moe_runner/triton_utils/fused_moe.py``): the token alignment is computed over the layer's
E local expert ids, exactly as stock SGLang computes it (same blocks, same kernel config),
and only the per-block expert ids are rewritten to slot ids before the two grouped GEMMs.
On the CPU it is SGLang's ``moe_forward_native`` over the slot banks (quantized slots
dequantized first by their format's definition, ``experts/formats.py``). FP8 passes its
scales and flags to the same Triton kernels as stock SGLang's runner does. FP4 formats, which
those kernels cannot read: a call of at most ``DIRECT_FP4_MAX_PAIRS`` (token, expert) pairs
(decode) runs ``kernels/fp4_moe.py``, which reads the FP4 codes and scales in the slots
directly with the rounding points of SGLang's sequence (``_run_direct_fp4``); a larger one
has its experts dequantized first and runs SGLang's kernels over them
(``_run_dequantized``). SGLang private functions used: ``_prepare_fused_moe_run`` (its
``down_moe_use_tma`` result, turned off where entries are skipped) and
``_fused_moe_kernel_sequence``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, Optional

import torch

from freetoken_sglang.experts.formats import TritonQuant

# a layer without FreeToken's method (the executors' unit tests' bare layers) is unquantized
_UNQUANTIZED = TritonQuant()

#: The most routed (token, expert) pairs, T*k, of an FP4 call that runs the direct kernels
#: (``kernels/fp4_moe.py``: codes read in place, every pair's expert read once per pair);
#: larger calls dequantize their distinct experts (``_run_dequantized``: about 9x an
#: expert's FP4 bytes written and read, once per distinct expert, then tensor-core GEMMs).
#: 32 covers decode batches up to 8 tokens at top-4 (GPT-OSS), 4 at top-8;
#: ``benchmarks/bench_fp4_slots.py`` times both paths on either side of it.
DIRECT_FP4_MAX_PAIRS = 32


def aligns_before_fill(layer, x: torch.Tensor) -> bool:
    """Whether ``run_on_slots`` runs SGLang's token alignment of the routed ids before it
    launches the call's fill (CUDA, not an FP4 format): the decision may then run beside the
    alignment (``execute/decode.py``)."""
    tq = getattr(getattr(layer, "quant_method", None), "triton_quant", _UNQUANTIZED)
    return x.is_cuda and tq is not None and not tq.dequantized


def run_on_slots_triton(
    layer,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    routed_ids: torch.Tensor,
    layer_slots: Optional[torch.Tensor],
    slot_banks: Dict[str, torch.Tensor],
    skip_negative_ids: bool = False,
    inplace: Optional[bool] = None,
    fill: Optional[Callable[[Optional[tuple]], None]] = None,
    null_slot: Optional[int] = None,
) -> torch.Tensor:
    """The layer's routed-expert output, computed from the slots (CUDA).

    Args:
        layer: the ``FusedMoE`` (its ``moe_runner_config`` and ``[E, ...]`` host-pool
            parameters, whose shapes select the kernel config as in stock SGLang).
        hidden_states: ``[T, H]`` activations.
        topk_weights: fp32 ``[T, k]`` router weights.
        routed_ids: int ``[T, k]`` local expert ids, every one resident, or -1 for an entry
            served elsewhere (the CPU), as ``residency.decide`` returns them; or the router's
            own ids where ``layer_slots`` gives a slot to every expert the GPU computes (and
            -1 with ``skip_negative_ids`` to the rest; ``execute/decode.py``'s overlap).
        layer_slots: int32 ``[E]`` slot of each local expert.
        skip_negative_ids: some ids may be -1, or some experts have no slot (-1 in
            ``layer_slots``): SGLang's kernels then run with ``filter_expert`` (as under
            expert parallelism), giving those entries zero, unless ``null_slot`` is given.
        slot_banks: ``w13_weight [S, 2I, H]``, ``w2_weight [S, H, I]`` and optional biases,
            or the format's banks (FP8 codes and scales; FP4 packed codes ``[S, 2I, H/2]``
            and scales).
        inplace: overrides the runner config's ``inplace`` (False keeps ``hidden_states``
            intact, for executors that run one call in several passes).
        fill: the call's pending fill (``Filler.run`` of its plan), launched here before
            any kernel reads a slot: after the token alignment, given ``(expert_ids,
            layer_slots, skip_negative_ids, null_slot)`` to remap in its own launch (one
            launch fewer;
            ``Filler.run``), or first with ``None`` on the FP4 paths and without
            ``layer_slots`` (``aligns_before_fill``).
        null_slot: with ``skip_negative_ids``, a row of ``slot_banks`` that is all zeros
            (``ExpertCache.null_slot``): the entries served elsewhere are computed against it
            (exactly 0: zero weights, scales and biases) instead of skipped, so SGLang's
            kernels run as stock's do, without ``filter_expert`` (and with TMA where its
            config asks). Ignored by the FP4 paths.

    FP4 slots: at most ``DIRECT_FP4_MAX_PAIRS`` pairs (``routed_ids.numel()``, a static
    shape), bf16/fp16 activations, a silu-gated activation (``fp4_moe.activation_code``)
    and no ``no_combine``: ``_run_direct_fp4``; otherwise ``_run_dequantized``.

    Returns:
        ``[T, H]`` (``hidden_states`` itself when the runner config is in place).

    Raises:
        ValueError: ``null_slot`` without ``layer_slots``, or not a row of ``slot_banks``.
    """
    if null_slot is not None and skip_negative_ids and not (
            layer_slots is not None and 0 <= null_slot < slot_banks["w13_weight"].shape[0]):
        raise ValueError(f"run_on_slots_triton: null_slot {null_slot} needs layer_slots and a "
                         f"row of the {slot_banks['w13_weight'].shape[0]} slot banks' rows")
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
        _fused_moe_kernel_sequence,
        _prepare_fused_moe_run,
    )

    from freetoken_sglang.kernels.residency import remap_expert_ids_

    cfg = layer.moe_runner_config
    ids = routed_ids
    tq = getattr(getattr(layer, "quant_method", None), "triton_quant", _UNQUANTIZED)
    if tq is None:  # a format without GPU slot kernels (refused at start; never reached)
        raise RuntimeError("FreeToken: no GPU slot kernels for this layer's expert format")
    if fill is not None and (tq.dequantized or layer_slots is None):
        fill(None)
        fill = None
    if tq.dequantized:  # FP4: decode-sized calls read the codes in place, others dequantize
        act = _direct_fp4_activation(tq, cfg, hidden_states, routed_ids)
        if act is not None:
            return _run_direct_fp4(layer, act, hidden_states, topk_weights, routed_ids,
                                   layer_slots, slot_banks, inplace)
        return _run_dequantized(layer, tq, hidden_states, topk_weights, routed_ids,
                                layer_slots, slot_banks, skip_negative_ids, inplace)
    quant, scales = tq.kernel_kwargs(slot_banks)
    (
        config,
        down_config,
        down_moe_use_tma,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
    ) = _prepare_fused_moe_run(
        hidden_states,
        layer.w13_weight,  # shapes only: [E, 2I, H], as stock SGLang sees them
        layer.w2_weight,
        ids,
        **quant,
    )
    if not skip_negative_ids:
        null_slot = None
    if fill is not None:
        fill((expert_ids, layer_slots, skip_negative_ids, null_slot))
    elif layer_slots is not None:
        remap_expert_ids_(expert_ids, layer_slots, keep_negative=skip_negative_ids,
                          null_slot=null_slot)
    filter_expert = (skip_negative_ids and null_slot is None) or (
        cfg.num_experts is None or cfg.num_experts != cfg.num_local_experts
    )
    if filter_expert and down_moe_use_tma:
        # SGLang 0.5.17's ``fused_moe_kernel`` (``c_sorted``, set by ``_prepare_fused_moe_run``'s
        # ``down_moe_use_tma`` from a tuned config's ``USE_TMA``) writes a skipped (-1)
        # block's zeros at the flat token rows while the TMA layout is sorted: the zeros can
        # land on another expert's rows. Without TMA both use the flat rows.
        down_moe_use_tma = False
    return _fused_moe_kernel_sequence(
        hidden_states,
        slot_banks["w13_weight"],
        slot_banks["w2_weight"],
        topk_weights,
        ids,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_padded,
        config,
        down_config,
        down_moe_use_tma,
        b1=slot_banks.get("w13_weight_bias"),
        b2=slot_banks.get("w2_weight_bias"),
        **quant,
        **scales,
        w1_zp=None,
        w2_zp=None,
        a1_scale=None,
        a2_scale=None,
        activation=cfg.activation,
        is_gated=cfg.is_gated,
        no_combine=cfg.no_combine,
        inplace=cfg.inplace if inplace is None else inplace,
        apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        routed_scaling_factor=cfg.routed_scaling_factor,
        gemm1_alpha=cfg.gemm1_alpha,
        gemm1_limit=cfg.gemm1_clamp_limit,
        filter_expert=filter_expert,
        hooks=None,
        swiglu_limit=cfg.swiglu_limit,
        gate_up_interleaved=cfg.gate_up_interleaved,
    )


#: The most bytes of dequantized experts (activation dtype) one pass of a call holds: a call
#: over more distinct experts runs in several passes over disjoint groups (one expert at
#: least per pass).
DEQUANTIZED_PASS_BYTES = 512 << 20
#: Device memory the cache sizing leaves free for them (a pass's experts and the partials).
DEQUANTIZED_SCRATCH_BYTES = 2 * DEQUANTIZED_PASS_BYTES


def distinct_experts(routed_ids: torch.Tensor, num_experts: int):
    """The distinct experts of a call with static shapes (CUDA-graph safe).

    Args:
        routed_ids: int ``[T, k]`` local expert ids, -1 for entries served elsewhere.
        num_experts: E, the layer's local experts.

    Returns:
        ``(experts, row_of)``: int64 ``[min(T k, E)]``, the distinct ids ascending, then -1;
        int32 ``[E]``, each expert's index in ``experts``, -1 where the call does not read it.
    """
    dev = routed_ids.device
    n = routed_ids.numel()
    rows = min(n, num_experts)
    flat = routed_ids.reshape(-1).long()
    ids = torch.sort(torch.where(flat >= 0, flat, num_experts)).values  # -1 sorts last as E
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    first &= ids < num_experts
    rank = torch.cumsum(first, 0) - 1
    row_of = torch.full((num_experts + 1,), -1, dtype=torch.int32, device=dev)
    row_of.scatter_(0, ids, rank.to(torch.int32))  # the sentinel's write lands in row E
    experts = torch.full((rows + 1,), -1, dtype=torch.long, device=dev)
    experts.scatter_(0, torch.where(first, rank, rows), ids)
    return experts[:rows], row_of[:num_experts]


def _direct_fp4_activation(tq, cfg, hidden_states, routed_ids):
    """``fp4_moe.activation_code`` of a call ``_run_direct_fp4`` serves, else None: FP4
    slots, at most ``DIRECT_FP4_MAX_PAIRS`` pairs, bf16/fp16, combined output, and an
    activation the direct kernels implement. Host-static (shapes and config only)."""
    if not tq.fp4 or routed_ids.numel() > DIRECT_FP4_MAX_PAIRS or cfg.no_combine:
        return None
    if hidden_states.dtype not in (torch.bfloat16, torch.float16):
        return None
    from freetoken_sglang.kernels.fp4_moe import activation_code

    return activation_code(cfg.activation, cfg.is_gated, cfg.gemm1_alpha,
                           cfg.gemm1_clamp_limit, cfg.swiglu_limit, cfg.gate_up_interleaved)


def _run_direct_fp4(layer, act, hidden_states, topk_weights, routed_ids, layer_slots,
                    slot_banks, inplace):
    """``run_on_slots_triton`` for a decode-sized FP4 call: ``kernels/fp4_moe.py`` reads each
    pair's expert codes and scales in its slot (entries at -1 give zero, as SGLang's
    ``filter_expert``), with the rounding points of SGLang's sequence over the dequantized
    experts: the output differs from ``_run_dequantized``'s only by fp32 accumulation order
    and the last bits of exp/sigmoid. Two kernels, static grids, no host sync (CUDA-graph
    safe); in place, the output is written into ``hidden_states``."""
    from freetoken_sglang.kernels.fp4_moe import fp4_moe

    cfg = layer.moe_runner_config
    code, interleaved = act
    in_place = cfg.inplace if inplace is None else inplace
    return fp4_moe(hidden_states, topk_weights, routed_ids, layer_slots, slot_banks, code,
                   interleaved, gemm1_alpha=cfg.gemm1_alpha, gemm1_limit=cfg.gemm1_clamp_limit,
                   apply_router_weight_on_input=cfg.apply_router_weight_on_input,
                   routed_scaling_factor=cfg.routed_scaling_factor,
                   out=hidden_states if in_place else None)


def _run_dequantized(layer, tq, hidden_states, topk_weights, routed_ids, layer_slots,
                     slot_banks, skip_negative_ids, inplace):
    """``run_on_slots_triton`` for a format SGLang's Triton kernels cannot read (FP4), for
    calls ``_run_direct_fp4`` does not serve (more than ``DIRECT_FP4_MAX_PAIRS`` pairs): the
    distinct experts of the call are dequantized from their slots into ``hidden_states.dtype``
    by the format's definition (``TritonQuant.dequantize_rows``: one Triton kernel per
    projection, ``kernels/fp4.py``), and SGLang's unquantized kernel sequence runs over them,
    the token alignment computed over the layer's E ids as stock SGLang computes it and its
    block expert ids remapped to the dequantized rows (the non-TMA down kernel). Static shapes
    and no host sync (CUDA-graph safe): ``min(T k, E)`` rows, the unused ones left
    unwritten, in passes of ``DEQUANTIZED_PASS_BYTES`` (at least one expert each). With one
    pass the result is bit-identical to SGLang's kernels over the dequantized experts; with
    several (GPT-OSS-120B's 49.8 MB experts: more than 10 distinct experts in a call) the
    passes' outputs, other passes' entries zero, are summed in fp32 and rounded once (a q*
    call's CPU partial, folded into the first pass's sum, is rounded there too)."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe import (
        _fused_moe_kernel_sequence,
        _prepare_fused_moe_run,
    )

    from freetoken_sglang.kernels.residency import remap_expert_ids_

    cfg = layer.moe_runner_config
    num_experts = layer.w13_weight.shape[0]
    experts, row_of = distinct_experts(routed_ids, num_experts)
    rows = experts.numel()
    # a routed expert without a slot (-1: rows the decision treats as padding) reads slot 0,
    # as remap_expert_ids_ makes SGLang's path read it
    slot_rows = experts if layer_slots is None else torch.where(
        experts >= 0, layer_slots[experts.clamp(min=0)].long().clamp(min=0), -1)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size_per_partition
    shards = 2 if cfg.is_gated else 1
    per_expert = (shards + 1) * inter * hidden * hidden_states.element_size()
    per_pass = max(1, min(rows, DEQUANTIZED_PASS_BYTES // per_expert))
    passes = -(-rows // per_pass)
    filter_expert = passes > 1 or skip_negative_ids or (
        cfg.num_experts is None or cfg.num_experts != cfg.num_local_experts)
    prepared = None
    total = None
    for p in range(passes):
        lo, hi = p * per_pass, min(rows, (p + 1) * per_pass)
        rows_p = slot_rows[lo:hi]
        w13, w2 = tq.dequantize_rows(slot_banks, rows_p, hidden_states.dtype)
        b1, b2 = (slot_banks[b][rows_p.clamp(min=0)] if b in slot_banks else None
                  for b in ("w13_weight_bias", "w2_weight_bias"))
        if prepared is None:  # shapes only, as stock SGLang sees the dequantized layer
            prepared = _prepare_fused_moe_run(
                hidden_states,
                torch.empty((num_experts, *w13.shape[1:]), dtype=w13.dtype, device="meta"),
                torch.empty((num_experts, *w2.shape[1:]), dtype=w2.dtype, device="meta"),
                routed_ids, use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
                use_int4_w4a16=False, per_channel_quant=False, block_shape=None,
            )
        # not the TMA down kernel: it sizes and caches its buffers by the per-call scratch
        config, down_config, _, sorted_token_ids, expert_ids, post_padded = prepared
        table = row_of if passes == 1 else torch.where(
            (row_of >= lo) & (row_of < hi), row_of - lo, -1).to(torch.int32)
        block_experts = expert_ids.clone()
        remap_expert_ids_(block_experts, table, keep_negative=True)  # other passes' skipped
        out = _fused_moe_kernel_sequence(
            hidden_states, w13, w2, topk_weights, routed_ids, sorted_token_ids,
            block_experts, post_padded, config, down_config, False,
            b1=b1, b2=b2,
            use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False,
            use_int4_w4a16=False, per_channel_quant=False, w1_scale=None, w2_scale=None,
            w1_zp=None, w2_zp=None, a1_scale=None, a2_scale=None, block_shape=None,
            activation=cfg.activation, is_gated=cfg.is_gated, no_combine=cfg.no_combine,
            inplace=(cfg.inplace if inplace is None else inplace) and passes == 1,
            apply_router_weight_on_input=cfg.apply_router_weight_on_input,
            routed_scaling_factor=cfg.routed_scaling_factor, gemm1_alpha=cfg.gemm1_alpha,
            gemm1_limit=cfg.gemm1_clamp_limit, filter_expert=filter_expert, hooks=None,
            swiglu_limit=cfg.swiglu_limit, gate_up_interleaved=cfg.gate_up_interleaved,
        )
        if passes == 1:
            return out
        total = out.float() if total is None else total.add_(out)
        del w13, w2, b1, b2, out  # before the next pass dequantizes its experts
    out = total.to(hidden_states.dtype)
    if cfg.inplace if inplace is None else inplace:
        return hidden_states.copy_(out)
    return out


def run_on_slots_native(
    layer,
    hidden_states: torch.Tensor,
    topk_output,
    routed_ids: torch.Tensor,
    layer_slots: torch.Tensor,
    banks_with_null_slots: Dict[str, torch.Tensor],
    num_slots: int,
) -> torch.Tensor:
    """The layer's routed-expert output from the slots, with SGLang's native torch MoE (the
    CPU path of ``UnquantizedFusedMoEMethod.forward_cpu``). Shapes as in
    ``run_on_slots_triton``, except the banks: ``[S + k, ...]``, whose last k rows are zero.
    An entry at -1 in top-k column j goes to zero slot ``S + j`` with router weight 0
    (SGLang's native MoE needs the ids of a row to be distinct)."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    elsewhere = routed_ids < 0
    null = num_slots + torch.arange(routed_ids.shape[1], device=routed_ids.device)
    slot_ids = layer_slots[routed_ids.clamp(min=0).long()]
    slot_ids = torch.where(elsewhere, null.to(slot_ids.dtype), slot_ids).to(routed_ids.dtype)
    weights = topk_output.topk_weights.masked_fill(elsewhere, 0)
    banks = banks_with_null_slots
    fmt = getattr(getattr(layer, "quant_method", None), "format", None)
    if fmt is not None and fmt.label != "unquantized":
        # the slots this call reads, dequantized by the format's definition
        used, slot_ids = torch.unique(slot_ids, return_inverse=True)
        slot_ids = slot_ids.to(routed_ids.dtype)
        rows = {n: b[used.long()] for n, b in banks.items()}
        w13, w2 = fmt.dequantize(layer.quant_method.base_method, rows, hidden_states.dtype)
        banks = {**rows, "w13_weight": w13, "w2_weight": w2}
    slots_layer = SimpleNamespace(
        num_experts=banks["w13_weight"].shape[0],
        w13_weight=banks["w13_weight"],
        w2_weight=banks["w2_weight"],
        w13_weight_bias=banks.get("w13_weight_bias"),
        w2_weight_bias=banks.get("w2_weight_bias"),
    )
    return moe_forward_native(
        slots_layer,
        hidden_states,
        StandardTopKOutput(weights, slot_ids, topk_output.router_logits),
        layer.moe_runner_config,
    )


def routed_scale(layer, x: torch.Tensor) -> float:
    """The factor CPU-executed partials get so that they add to the GPU partial: SGLang's
    Triton runner applies ``routed_scaling_factor`` itself (``moe_sum_reduce``); its native
    CPU MoE leaves it to the model (e.g. ``DeepseekV2MoE`` multiplies on non-CUDA devices)."""
    if not x.is_cuda:
        return 1.0
    return layer.moe_runner_config.routed_scaling_factor or 1.0


def run_on_slots(
    call,
    routed_ids: torch.Tensor,
    layer_slots: torch.Tensor,
    cache,
    skip_negative_ids: bool = False,
    inplace: Optional[bool] = None,
    fill: Optional[Callable[[Optional[tuple]], None]] = None,
    use_null_slot: bool = False,
) -> torch.Tensor:
    """``run_on_slots_triton`` on CUDA, ``run_on_slots_native`` elsewhere, over every row of
    the cache's slot banks (LRU slots and prefill buffers alike).

    Args:
        call: the ``LayerCall``.
        routed_ids: int ``[T, k]`` local ids, -1 for entries served elsewhere.
        layer_slots: int32 ``[E]`` slot row of each local expert the call may use.
        cache: the ``ExpertCache``.
        skip_negative_ids: some ids may be -1, or some experts have no slot (CUDA: their
            blocks are skipped).
        inplace: as in ``run_on_slots_triton`` (CUDA only; the native path never writes
            its input).
        fill: as in ``run_on_slots_triton`` (the native path launches it first).
        use_null_slot: with ``skip_negative_ids`` on CUDA, the skipped entries are computed
            against the cache's all-zero ``null_slot`` where it has one (a decode call's few
            CPU entries: SGLang's kernels then run without ``filter_expert``), not skipped.
    """
    if call.x.is_cuda:
        null_slot = getattr(cache, "null_slot", None) if use_null_slot else None
        return run_on_slots_triton(
            call.layer,
            call.x,
            call.topk_weights,
            routed_ids,
            layer_slots,
            cache.slot_banks if null_slot is None else cache.banks_with_null_slots,
            skip_negative_ids=skip_negative_ids,
            inplace=inplace,
            fill=fill,
            null_slot=null_slot,
        )
    if fill is not None:
        fill(None)
    return run_on_slots_native(
        call.layer,
        call.x,
        call.topk_output,
        routed_ids,
        layer_slots,
        cache.banks_with_null_slots,
        cache.num_slots,
    )
