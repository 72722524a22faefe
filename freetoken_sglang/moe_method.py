"""The fused-MoE method that serves a ``FusedMoE`` layer from the host pool and the GPU cache.

It replaces the layer's SGLang MoE method of a served format (``experts/formats.py``;
``patches/moe_layer.py``). Its
parameters are views of the layer's rows in the host pool, so checkpoint loading writes
straight into the final host layout; its ``apply`` hands each layer call to one executor
(``execute/``), which runs SGLang's own MoE kernels over the slots (paper §3.1-3.2).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from freetoken_sglang.execute.contract import LayerCall

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
        base_method: the layer's original SGLang method (``UnquantizedFusedMoEMethod``,
            ``Fp8MoEMethod``, ...); it still creates the parameters and builds the MoE runner
            config, so the layouts, math and flags match stock SGLang.
        fmt: the ``ExpertFormat`` of ``base_method`` (``experts/formats.py``).
        create_weights_original: ``base_method``'s unhooked ``create_weights``.
    """

    def __init__(self, runtime, base_method, fmt, create_weights_original):
        torch.nn.Module.__init__(self)
        self.runtime = runtime
        self.base_method = base_method
        self.format = fmt
        # the format's quantization arguments of SGLang's Triton MoE kernels (fixed per layer),
        # set by create_weights once the format has accepted base_method
        self.triton_quant = None
        self._create_weights_original = create_weights_original
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
        """Register the layer's expert parameters as views of its rows of the host pool.

        SGLang's own method (``base_method``) creates them first on the meta device, so their
        names, shapes, dtypes and weight-loader attributes are exactly stock SGLang's; each
        ``[E, ...]`` parameter becomes a pool bank (``experts/formats.py`` checks them). The
        weight loader runs with ``base_method`` as the layer's method (``_loading_as``).

        Raises:
            UnsupportedModelError: the format is not served in this configuration (e.g. a
                format without GPU slot kernels under the GPU cache on CUDA), or the
                parameters are not the banks the format describes.
        """
        from freetoken_sglang.families import UnsupportedModelError

        reason = self.format.supports(self.base_method)
        rt = self.runtime
        if not reason:
            self.triton_quant = self.format.triton(self.base_method)
            if rt.config.fp4_kernels == "dequantized":
                if self.triton_quant is None or not self.triton_quant.fp4 or \
                        rt.backend != "gpu" or rt.device.type != "cuda":
                    reason = ("--freetoken-fp4-kernels dequantized has no effect here: it "
                              "applies to FP4 experts (MXFP4, NVFP4) in the GPU expert cache "
                              "on CUDA; drop the flag")
                else:  # every call through SGLang's kernels over dequantized slots
                    self.triton_quant = dataclasses.replace(self.triton_quant, fp4=False)
        if not reason and self.triton_quant is None and rt.backend == "gpu" and \
                rt.device.type == "cuda":
            reason = ("the GPU expert cache has no kernels for this format yet; serve it with "
                      "--freetoken-backend cpu (every routed expert on the C executor, which "
                      "reads it)")
        if reason:
            raise UnsupportedModelError(
                f"--enable-freetoken ({type(self.base_method).__name__}): {reason}")
        before = set(layer._parameters)
        if extra_weight_attrs.get("weight_loader") is not None:
            extra_weight_attrs["weight_loader"] = _loading_as(
                layer, self.base_method, extra_weight_attrs["weight_loader"])
        try:
            with torch.device("meta"):
                self._create_weights_original(
                    self.base_method,
                    layer,
                    num_experts,
                    hidden_size,
                    intermediate_size_per_partition,
                    params_dtype,
                    with_bias=with_bias,
                    **extra_weight_attrs,
                )
        except (ValueError, AssertionError) as e:  # SGLang's own checks of the layer's shapes
            raise UnsupportedModelError(
                f"--enable-freetoken ({self.format.label} experts): SGLang's "
                f"{type(self.base_method).__name__} refuses MoE layer {layer.layer_id}: "
                f"{e or type(e).__name__}"
            ) from e
        params = {
            n: p for n, p in layer._parameters.items() if n not in before and p is not None
        }
        specs = self.format.check_banks(
            self.base_method, layer, params, num_experts, hidden_size,
            intermediate_size_per_partition, params_dtype, with_bias,
        )
        pool = self.runtime.pool_for_layer(layer, num_experts, specs,
                                           dict(self.format.initial_values))
        self.ordinal = pool.ordinal(layer.layer_id)
        self.num_experts = num_experts
        for name, meta in params.items():
            param = _parameter_like(meta, pool.layer_rows(name, layer.layer_id))
            layer.register_parameter(name, param)
        self.runtime.register_layer(layer, self)

    def create_moe_runner(self, layer: torch.nn.Module, moe_runner_config):
        self.runtime.check_cpu_activation(moe_runner_config)
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
        if rt.replay is not None:  # benchmarks only (observe/routing_replay.py)
            topk_output = topk_output._replace(
                topk_ids=rt.replay.ids_for(self.ordinal, topk_output.topk_ids))
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
        if self.ordinal == rt.pool.num_layers - 1 and rt.cache is not None \
                and rt.cache.late is not None:
            rt.cache.late.join()  # the forward's late fills end inside it (and its graph)
        return StandardCombineInput(hidden_states=out)


def _parameter_like(meta: torch.nn.Parameter, data: torch.Tensor) -> torch.nn.Parameter:
    """A parameter over ``data`` of ``meta``'s class (a plain ``Parameter``, or one of
    SGLang's ``layers/parameter.py`` classes, whose ``weight_loader`` is a property) with
    its attributes (weight_loader, quant_method, ...), without re-running its ``__init__``."""
    cls = type(meta)
    if cls is torch.nn.Parameter:
        param = torch.nn.Parameter(data, requires_grad=False)
    else:  # BasevLLMParameter.__new__(cls, data, **kwargs) in SGLang 0.5.17
        param = cls.__new__(cls, data=data)
    param.__dict__.update(meta.__dict__)
    return param


_loading = threading.Lock()  # SGLang's loader threads (e.g. DeepSeek's) share a layer's swap


def _loading_as(layer: torch.nn.Module, base_method, loader):
    """``loader`` (``FusedMoE.weight_loader``) run with ``base_method`` as the layer's
    ``quant_method``: SGLang 0.5.17's ``FusedMoE._weight_loader_impl`` picks how a tensor
    lands by that method's class (e.g. ModelOpt's per-tensor scales), so every bank loads as
    in stock SGLang. While any load of the layer runs, ``layer.quant_method`` reads
    ``base_method`` in every thread; loads run before serving (or, for a weight update,
    between batches)."""

    @functools.wraps(loader)
    def weight_loader(*args, **kwargs):
        with _loading:  # the first of the layer's concurrent loads puts base_method in front
            users = layer.__dict__.get("_freetoken_loading", 0)
            if users == 0:
                layer.__dict__["quant_method"] = base_method  # found before nn.Module's _modules
            layer.__dict__["_freetoken_loading"] = users + 1
        try:
            return loader(*args, **kwargs)
        finally:
            with _loading:
                users = layer.__dict__["_freetoken_loading"] - 1
                layer.__dict__["_freetoken_loading"] = users
                if users == 0:
                    del layer.__dict__["quant_method"]

    return weight_loader
