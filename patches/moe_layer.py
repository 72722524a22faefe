"""Hooks into SGLang 0.5.17's MoE layer (``sglang.srt.layers.moe.fused_moe_triton.layer``).

- ``FusedMoE.__init__`` (around): refuses quantized MoE layers with a message that names the
  quantization, and marks the layer being built, keeping ``FusedMoE``'s class identity.
- ``UnquantizedFusedMoEMethod.create_weights`` (around; in
  ``sglang.srt.layers.quantization.unquant``): for a layer marked above, installs
  ``FreeTokenMoEMethod`` as the layer's ``quant_method`` instead, so no expert weight is ever
  allocated on the GPU.
"""

from __future__ import annotations

import contextvars
import inspect

from freetoken_sglang.patches import Hook

_building: contextvars.ContextVar = contextvars.ContextVar(
    "freetoken_building_moe", default=None
)


def fused_moe_init(original, self, *args, **kwargs):
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or getattr(type(self), "is_shared_fused_moe", False):
        return original(self, *args, **kwargs)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    quant_config = bound.arguments.get("quant_config")
    if quant_config is not None:
        from freetoken_sglang.families import UnsupportedModelError

        raise UnsupportedModelError(
            f"--enable-freetoken does not support quantized MoE layers yet "
            f"({rt.family} with quantization {quant_config.get_name()!r}); serve a BF16, "
            "FP16 or FP32 checkpoint"
        )
    token = _building.set(self)
    try:
        return original(self, *args, **kwargs)
    finally:
        _building.reset(token)


def unquant_create_weights(original, method, *args, **kwargs):
    layer = kwargs.get("layer", args[0] if args else None)
    if layer is None or _building.get() is not layer:
        return original(method, *args, **kwargs)
    from freetoken_sglang.moe_method import FreeTokenMoEMethod
    from freetoken_sglang.runtime import get_runtime

    ft_method = FreeTokenMoEMethod(get_runtime(), method)
    layer.quant_method = ft_method
    kwargs.pop("layer", None)
    rest = args[1:] if args else ()
    return ft_method.create_weights(layer, *rest, **kwargs)


HOOKS = [
    Hook(
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.__init__",
        fused_moe_init,
        "around",
    ),
    Hook(
        "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod.create_weights",
        unquant_create_weights,
        "around",
    ),
]
