"""Hooks into SGLang 0.5.17's MoE layer (``sglang.srt.layers.moe.fused_moe_triton.layer``).

- ``FusedMoE.__init__`` (around): refuses MoE layers of a quantization no expert format
  serves (``experts/formats.py``), with a message that names it; marks the layer being built,
  keeping ``FusedMoE``'s class identity; and checks afterwards that FreeToken took the layer
  over (never a silent fallback to stock SGLang's GPU-resident experts).
- ``create_weights`` of each format's SGLang method (around;
  ``UnquantizedFusedMoEMethod`` in ``sglang.srt.layers.quantization.unquant``,
  ``Fp8MoEMethod`` in ``sglang.srt.layers.quantization.fp8``, ``Mxfp4MoEMethod`` in
  ``sglang.srt.layers.quantization.mxfp4``): for a layer marked above,
  installs ``FreeTokenMoEMethod`` as the layer's ``quant_method`` instead, so no expert weight
  is ever allocated on the GPU.
- ``FusedMoE._weight_loader_impl`` (around, private): SGLang picks how to load a checkpoint
  tensor by the class of the layer's method (e.g. ModelOpt's per-tensor scales); for a layer
  FreeToken took over it sees the SGLang method it replaced, so every bank loads as stock.
- ``ModelOptNvFp4FusedMoEMethod.__init__`` (around, ``sglang.srt.layers.quantization.
  modelopt_quant``): for a layer FreeToken serves, which never calls SGLang's NVFP4 kernels,
  neither their platform check (Blackwell, or Marlin on SM80+) nor their swizzled scales.
"""

from __future__ import annotations

import contextvars
import inspect
import threading

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
            f"({rt.family}); served: unquantized (BF16, FP16, FP32) and "
            f"{', '.join(sorted(QUANTIZATIONS))}"
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


_loading = threading.Lock()  # loader threads (e.g. DeepSeek's) share a layer's swap


def weight_loader_impl(original, self, *args, **kwargs):
    from freetoken_sglang.moe_method import FreeTokenMoEMethod

    method = self.__dict__.get("_modules", {}).get("quant_method")
    if not isinstance(method, FreeTokenMoEMethod):
        return original(self, *args, **kwargs)
    with _loading:  # the first of the layer's concurrent loads puts the base method in front
        users = self.__dict__.get("_freetoken_loading", 0)
        if users == 0:
            self.__dict__["quant_method"] = method.base_method  # found before _modules
        self.__dict__["_freetoken_loading"] = users + 1
    try:
        return original(self, *args, **kwargs)
    finally:
        with _loading:
            users = self.__dict__["_freetoken_loading"] - 1
            self.__dict__["_freetoken_loading"] = users
            if users == 0:
                del self.__dict__["quant_method"]


def nvfp4_method_init(original, self, quant_config, *args, **kwargs):
    if _building.get() is None:  # not a layer FreeToken serves
        return original(self, quant_config, *args, **kwargs)
    try:
        original(self, quant_config, *args, **kwargs)
    except ValueError:  # the platform check; the rest of __init__ (0.5.17) follows
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
        "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE._weight_loader_impl",
        weight_loader_impl,
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
