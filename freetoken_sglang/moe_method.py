"""The fused-MoE method that serves a ``FusedMoE`` layer from the host pool and the GPU cache.

It replaces the layer's ``UnquantizedFusedMoEMethod`` (``patches/moe_layer.py``). Its
parameters are views of the layer's rows in the host pool, so checkpoint loading writes
straight into the final host layout; its ``apply`` hands each layer call to one executor
(``execute/``), which runs SGLang's own MoE kernels over the slots (paper §3.1-3.2).
"""

from __future__ import annotations

import torch

from freetoken_sglang.execute.contract import LayerCall
from freetoken_sglang.pool import bank_specs_for_layer

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
        """Compute the layer's routed-expert output with the executor the runtime picks for
        the call (``execute/choice.py``): the LRU decode path, full-layer prefill streaming,
        waves, or the CPU backend. No host sync on the CUDA decode path.

        Args:
            dispatch_output: SGLang's ``StandardDispatchOutput`` (hidden_states ``[T, H]``,
                standard top-k output with ``topk_ids [T, k]`` and fp32 ``topk_weights``).

        Returns:
            ``StandardCombineInput`` with ``[T, H]`` hidden states.
        """
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        rt = self.runtime
        topk_output = dispatch_output.topk_output
        if not TopKOutputChecker.format_is_standard(topk_output):
            topk_output = topk_output.to_standard()
        call = LayerCall(
            layer=layer,
            ordinal=self.ordinal,
            x=dispatch_output.hidden_states,
            topk_weights=topk_output.topk_weights,
            topk_ids=topk_output.topk_ids,
            topk_output=topk_output,
        )
        if rt.recorder is not None:
            rt.recorder.record_layer(self.ordinal, topk_output.topk_ids)
        out = rt.executor_for(call.rows).run(call)
        return StandardCombineInput(hidden_states=out)
