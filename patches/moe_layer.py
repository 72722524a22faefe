"""Hooks into SGLang 0.5.17's MoE layer (``sglang.srt.layers.moe.fused_moe_triton.layer``).

- ``FusedMoE.__init__`` (around): refuses MoE layers of a quantization no expert format
  serves (``experts/formats.py``), with a message that names it; marks the layer being built,
  keeping ``FusedMoE``'s class identity; and checks afterwards that FreeToken took the layer
  over (never a silent fallback to stock SGLang's GPU-resident experts).
- ``create_weights`` of each format's SGLang method (around;
  ``UnquantizedFusedMoEMethod`` in ``sglang.srt.layers.quantization.unquant``,
  ``Fp8MoEMethod`` in ``sglang.srt.layers.quantization.fp8``, ``Mxfp4MoEMethod`` in
  ``sglang.srt.layers.quantization.mxfp4``, ``ModelOptNvFp4FusedMoEMethod`` in
  ``sglang.srt.layers.quantization.modelopt_quant``): for a layer marked above,
  installs ``FreeTokenMoEMethod`` as the layer's ``quant_method`` instead, so no expert weight
  is ever allocated on the GPU.
- ``ModelOptNvFp4FusedMoEMethod.__init__`` (around, ``sglang.srt.layers.quantization.
  modelopt_quant``): for a layer FreeToken serves, which never calls SGLang's NVFP4 kernels,
  neither their platform check (Blackwell, or Marlin on SM80+; when it refuses, the rest of
  0.5.17's ``__init__`` is set here, its private ``_cache_permute_indices`` included) nor
  their swizzled scales (``enable_flashinfer_trtllm_moe`` set, so ``create_weights`` skips
  them).
"""

from __future__ import annotations

import contextvars
import inspect

from freetoken_sglang.experts.formats import FORMATS, QUANTIZATIONS
from freetoken_sglang.patches import Hook

_building: contextvars.ContextVar = contextvars.ContextVar(
    "freetoken_building_moe", default=None
)


def fused_moe_init(original, self, *args, **kwargs):
    from freetoken_sglang.families import UnsupportedModelError
    from freetoken_sglang.runtime import get_runtime

    rt = get_runtime()
    if rt is None or getattr(type(self), "is_shared_fused_moe", False):
        return original(self, *args, **kwargs)
    bound = inspect.signature(original).bind(self, *args, **kwargs)
    quant_config = bound.arguments.get("quant_config")
    if quant_config is not None and quant_config.get_name() not in QUANTIZATIONS:
        raise UnsupportedModelError(
            f"--enable-freetoken does not serve {quant_config.get_name()!r} MoE layers yet "
            f"({rt.family}); serve a checkpoint whose experts are unquantized (BF16, FP16, "
            f"FP32) or {', '.join(sorted(QUANTIZATIONS))}"
        )
    token = _building.set(self)
    try:
        result = original(self, *args, **kwargs)
    finally:
        _building.reset(token)
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    if not isinstance(getattr(self, "quant_method", None), FreeTokenMoEMethod):
        method = type(getattr(self, "quant_method", None)).__name__
        raise UnsupportedModelError(
            f"--enable-freetoken does not serve MoE layers whose SGLang method is {method} "
            f"yet ({rt.family}, layer {getattr(self, 'layer_id', '?')}); served formats: "
            f"{', '.join(FORMATS)}"
        )
    return result


def _take_over(fmt):
    def create_weights(original, method, *args, **kwargs):
        layer = kwargs.get("layer", args[0] if args else None)
        if layer is None or _building.get() is not layer:
            return original(method, *args, **kwargs)
        from freetoken_sglang.moe_method import FreeTokenMoEMethod
        from freetoken_sglang.runtime import get_runtime

        ft_method = FreeTokenMoEMethod(get_runtime(), method, fmt, original)
        layer.quant_method = ft_method
        kwargs.pop("layer", None)
        rest = args[1:] if args else ()
        return ft_method.create_weights(layer, *rest, **kwargs)

    create_weights.__name__ = f"create_weights_{fmt.label}"
    return create_weights


def nvfp4_method_init(original, self, quant_config, *args, **kwargs):
    if _building.get() is None:  # not a layer FreeToken serves
        return original(self, quant_config, *args, **kwargs)
    try:
        original(self, quant_config, *args, **kwargs)
    except ValueError as e:
        if "does not support NVFP4" not in str(e):
            raise
        # the rest of 0.5.17's __init__ after its platform check (a private attribute)
        self.quant_config = quant_config
        self._cache_permute_indices = {}
    # Only create_weights runs, on the meta device: this flag makes it skip the swizzled
    # block-scale copies its other kernels read (made with .cuda(), which meta cannot do).
    self.enable_flashinfer_trtllm_moe = True


HOOKS = [
    Hook(
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.__init__",
        fused_moe_init,
        "around",
    ),
    Hook(
        "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod.__init__",
        nvfp4_method_init,
        "around",
    ),
] + [
    Hook(fmt.method.replace(":", ".") + ".create_weights", _take_over(fmt), "around")
    for fmt in FORMATS.values()
]
