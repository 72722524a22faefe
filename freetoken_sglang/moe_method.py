"""The fused-MoE method that serves a ``FusedMoE`` layer from the host pool and the GPU cache.

It replaces the layer's ``UnquantizedFusedMoEMethod`` (``patches/moe_layer.py``). Its
parameters are views of the layer's rows in the host pool, so checkpoint loading writes
straight into the final host layout; its ``apply`` de-duplicates the routed experts,
classifies them against the cache, fills the misses, and runs SGLang's own MoE kernels over
the slots (paper §3.2).
"""

from __future__ import annotations

import torch

from freetoken_sglang.pool import bank_specs_for_layer
from freetoken_sglang.cache.residency import decide
from freetoken_sglang.execute.slot_moe import run_on_slots_native, run_on_slots_triton

try:  # SGLang 0.5.17: sglang/srt/layers/quantization/base_config.py
    from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase
except ImportError:  # pragma: no cover - only without SGLang
    FusedMoEMethodBase = object


class FreeTokenMoEMethod(FusedMoEMethodBase, torch.nn.Module):
    """Routed experts of one MoE layer, served from the host pool through the shared cache.

    An ``nn.Module``, like the ``UnquantizedFusedMoEMethod`` it replaces (SGLang registers a
    layer's ``quant_method`` as a child module).

    Args:
        runtime: the process's ``FreeTokenRuntime``.
        base_method: the layer's original ``UnquantizedFusedMoEMethod``; it still builds the
            layer's MoE runner config, so the math and flags match stock SGLang.
    """

    def __init__(self, runtime, base_method):
        torch.nn.Module.__init__(self)
        self.runtime = runtime
        self.base_method = base_method
        self.ordinal = -1
        self.num_experts = 0
        self.moe_runner_config = None

    # ---- FusedMoEMethodBase ---------------------------------------------------------------
    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        with_bias: bool = False,
        **extra_weight_attrs,
    ):
        """Register ``w13_weight [E, 2I, H]``, ``w2_weight [E, H, I]`` (and biases) as views of
        the layer's rows of the host pool banks, with SGLang's weight-loader attributes."""
        from sglang.srt.utils import set_weight_attrs

        specs = bank_specs_for_layer(
            hidden_size=hidden_size,
            intermediate_size=intermediate_size_per_partition,
            dtype=params_dtype,
            is_gated=layer.moe_runner_config.is_gated,
            with_bias=with_bias,
        )
        pool = self.runtime.pool_for_layer(layer, num_experts, specs)
        self.ordinal = pool.ordinal(layer.layer_id)
        self.num_experts = num_experts
        extra_weight_attrs.pop("moe_intermediate_size", None)
        for name in specs:
            param = torch.nn.Parameter(pool.layer_rows(name, layer.layer_id), requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, extra_weight_attrs)
        self.runtime.register_layer(layer, self)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        self.base_method.create_moe_runner(layer, moe_runner_config)
        # FusedMoE.__init__ copies ``quant_method.runner`` onto the layer.
        self.runner = self.base_method.runner

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        # The rows are already in their final layout; the runtime pins the whole pool once
        # every layer has loaded (FreeTokenRuntime.finish_load).
        return None

    def apply(self, layer: torch.nn.Module, dispatch_output):
        """Compute the layer's routed-expert output (paper §3.2): hits run from their slots,
        q misses are filled and run on the GPU, the other misses run on the CPU at the same
        time, and the partial outputs are merged. No host sync on the CUDA path.

        Args:
            dispatch_output: SGLang's ``StandardDispatchOutput`` (hidden_states ``[T, H]``,
                standard top-k output with ``topk_ids [T, k]`` and fp32 ``topk_weights``).

        Returns:
            ``StandardCombineInput`` with ``[T, H]`` hidden states.
        """
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        rt = self.runtime
        cache = rt.cache
        topk_output = dispatch_output.topk_output
        if not TopKOutputChecker.format_is_standard(topk_output):
            topk_output = topk_output.to_standard()
        x = dispatch_output.hidden_states
        split = rt.split_for(x.shape[0])
        on_cpu = split.fill_ratio < 1.0  # some misses may run on the CPU
        phase = "decode" if rt.is_decode_sized(x.shape[0]) else "prefill"
        # The CPU partial is scaled as the GPU partial is: SGLang's Triton runner applies the
        # routed scaling factor (moe_sum_reduce); its native CPU MoE leaves it to the model
        # (e.g. DeepseekV2MoE multiplies its output on non-CUDA devices).
        scale = (self.moe_runner_config.routed_scaling_factor or 1.0) if x.is_cuda else 1.0
        decision = decide(
            cache.residency,
            rt.counters.of_phase(phase),
            self.ordinal,
            self.num_experts,
            topk_output.topk_ids,
            topk_output.topk_weights,
            rt.num_valid,
            split,
            scale,
        )
        if rt.recorder is not None:
            rt.recorder.record_layer(self.ordinal, topk_output.topk_ids)
        if on_cpu:
            rt.cpu_branch.launch(x, decision.cpu)  # copies x before the GPU may overwrite it
        if cache.filler is not None:
            cache.filler.run(decision.plan)
        layer_slots = cache.residency.layer_slots(self.ordinal, self.num_experts)
        if rt.backend == "cpu":
            out = torch.zeros_like(x)
        elif x.is_cuda:
            out = run_on_slots_triton(
                layer,
                x,
                topk_output.topk_weights,
                decision.routed_ids,
                layer_slots,
                cache.slot_banks,
                skip_negative_ids=on_cpu,
            )
        else:
            out = run_on_slots_native(
                layer,
                x,
                topk_output,
                decision.routed_ids,
                layer_slots,
                cache.banks_with_null_slots,
                cache.num_slots,
            )
        if on_cpu:
            out = rt.cpu_branch.merge(out)
        return StandardCombineInput(hidden_states=out)
